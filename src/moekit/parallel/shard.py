"""This rank's share of a layer: the spec and `ExpertWeights` a rank of a parallel group holds.

Data flow: (`Parallel`, global `MoESpec`, global `ExpertWeights`, expert map) -> `shard_for` -> (local
spec, local weights, expert map) for `FusedMoE` to check, plan and run like any other layer.

Expert parallelism (`expert_shard`), rank r of N: the rank keeps the whole experts it owns
(`moekit.ep.ownership.expert_ownership`, contiguous, E need not be divisible by N): rows
`expert_ownership(E, N)[r]` of every weight tensor (w13, w2, their scales, b13, b2: all expert-major), a
spec with `num_local_experts` E_r and the expert map global id -> local index (-1 elsewhere).

Tensor parallelism (`tensor_shard`), rank r of N, Il = I/N: every expert keeps its gate rows
[r*Il, (r+1)*Il) and the same up rows, in the stored gate layout (CONCAT: two row ranges; INTERLEAVED:
rows [2r*Il, 2(r+1)*Il), which hold the same gate/up pairs), with their per-row scales and b13 entries;
w2 keeps input columns [r*Il, (r+1)*Il) with their column scale blocks. The gated activation works on
each (gate j, up j) pair alone, so the rank's partial outputs sum to the layer's output. b2 stays on
rank 0 and is zero elsewhere, so the sum adds it once: a b2/N on every rank would round differently
in the act dtype than one b2. Quantization blocks may not straddle two ranks: MXFP4 needs Il to be a
multiple of 32 (w2's blocks run along I), FP8 128x128 blocks need Il to be a multiple of 128 (w13's row
blocks and w2's column blocks); anything else is refused here, before any kernel is planned.
W8A8 with per-token activation scales quantizes each rank's h slice with its own scale (as vLLM does),
so it is within tolerance of one rank rather than the same numbers.

The slices are taken from the full weights in memory (only the slices are copied); reading a rank's
slice straight from safetensors is not done here.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit.ep.ownership import expert_ownership, local_expert_map
from moekit.errors import ArgumentError, SpecError, UnsupportedSpecError
from moekit.formats import MXFP4_BLOCK
from moekit.parallel.spec import Parallel, ParallelMode
from moekit.spec import Fp8Scale, GateLayout, MoESpec, WeightFormat
from moekit.weights import ExpertWeights

FP8_BLOCK = 128  # the edge of an FP8 BLOCK_128 scale block


def shard_for(
    parallel: Parallel, spec: MoESpec, weights: ExpertWeights, expert_map: torch.Tensor | None = None
) -> tuple[MoESpec, ExpertWeights, torch.Tensor | None]:
    """This rank's (spec, weights, expert map) of the global layer (`spec`, `weights`) under `parallel`."""
    if parallel.mode is ParallelMode.EXPERT:
        if expert_map is not None:
            raise ArgumentError(
                "expert_map: Parallel.expert builds this rank's expert map from the group; pass the global "
                "layer (spec.num_local_experts=None) without expert_map"
            )
        return expert_shard(spec, weights, rank=parallel.rank, world_size=parallel.world_size)
    return (*tensor_shard(spec, weights, rank=parallel.rank, world_size=parallel.world_size), expert_map)


def expert_shard(
    spec: MoESpec, weights: ExpertWeights, *, rank: int, world_size: int
) -> tuple[MoESpec, ExpertWeights, torch.Tensor]:
    """Rank `rank`'s expert-parallel (spec with E_r local experts, weights of its experts, expert map)."""
    if spec.uses_expert_map:
        raise SpecError(
            f"Parallel.expert shards the global layer, but spec.num_local_experts={spec.num_local_experts}; "
            "pass the spec and weights of all E experts (num_local_experts=None)"
        )
    weights.validate(spec)  # the global shapes, so an error names the tensor the caller passed
    owned = expert_ownership(spec.E, world_size)[rank]
    # Expert-major tensors in every packing: slicing dim 0 copies only this rank's experts.
    fields = {n: t[owned.start : owned.stop].contiguous() for n, t in weights.tensors().items()}
    local = replace(spec, num_local_experts=len(owned))
    return local, replace(weights, **fields), local_expert_map(spec.E, rank, world_size)


def _block_rule(spec: MoESpec, weights: ExpertWeights) -> tuple[int, str] | None:
    """(block, what) when the stored weights have quantization blocks a shard must not split."""
    if weights.stores_floats:
        return None
    if spec.weight_format is WeightFormat.MXFP4:
        return MXFP4_BLOCK, f"MXFP4's {MXFP4_BLOCK}-element scale blocks along w2's input dim I"
    if spec.fp8_scale is Fp8Scale.BLOCK_128:
        return FP8_BLOCK, f"FP8 {FP8_BLOCK}x{FP8_BLOCK} scale blocks (w13's row blocks, w2's column blocks)"
    return None


def _check_divisible(spec: MoESpec, weights: ExpertWeights, world_size: int) -> int:
    i = spec.I
    rule = _block_rule(spec, weights)
    block, what = rule if rule is not None else (1, "")
    if i % world_size == 0 and (i // world_size) % block == 0:
        return i // world_size
    fits = [n for n in range(1, min(i, 1024) + 1) if i % n == 0 and (i // n) % block == 0]
    need = f"a multiple of {block} ({what})" if block > 1 else "a whole number"
    raise UnsupportedSpecError(
        f"tensor parallelism over {world_size} ranks: I/N = {i}/{world_size} must be {need}, so that no "
        f"shard splits a block; use a group of N in {fits} ranks, or expert parallelism"
    )


def _w13_segments(i: int, il: int, rank: int, layout: GateLayout) -> list[tuple[int, int]]:
    """(start, length) row ranges of w13 that rank `rank` keeps, in stored order."""
    if layout is GateLayout.CONCAT:
        return [(rank * il, il), (i + rank * il, il)]
    return [(2 * rank * il, 2 * il)]  # INTERLEAVED: gate j is row 2j, up j is row 2j+1


def _take(t: torch.Tensor, dim: int, segments: list[tuple[int, int]], unit: int = 1) -> torch.Tensor:
    """The `segments` (in elements; `unit` elements per entry of `t` along `dim`) of `t`, concatenated."""
    parts = [t.narrow(dim, start // unit, length // unit) for start, length in segments]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=dim)


def tensor_shard(
    spec: MoESpec, weights: ExpertWeights, *, rank: int, world_size: int
) -> tuple[MoESpec, ExpertWeights]:
    """Rank `rank`'s tensor-parallel (spec with I/N, weights) of the global layer (module docstring)."""
    weights = weights.unpacked()  # MMA words hold 16-row blocks; slice checkpoint rows
    weights.validate(spec)  # the global shapes, so an error names the tensor the caller passed
    il = _check_divisible(spec, weights, world_size)
    i = spec.I
    rows = _w13_segments(i, il, rank, spec.gate_layout)
    cols = [(rank * il, il)]
    fields: dict[str, torch.Tensor | None] = {"w13": _take(weights.w13, 1, rows)}
    if weights.stores_floats or spec.weight_format is not WeightFormat.MXFP4:
        fields["w2"] = _take(weights.w2, 2, cols)  # [E, H, I]: float or FP8 codes
    else:  # MXFP4 [E, H, I/32, 16] codes and [E, H, I/32] scales: whole blocks (checked above)
        fields["w2"] = _take(weights.w2, 2, cols, unit=MXFP4_BLOCK)
        fields["w2_scale"] = _take(weights.w2_scale, 2, cols, unit=MXFP4_BLOCK)
        fields["w13_scale"] = _take(weights.w13_scale, 1, rows)
    if not weights.stores_floats and spec.weight_format is WeightFormat.FP8_E4M3:
        if spec.fp8_scale is Fp8Scale.PER_CHANNEL:  # [E, rows]: w13's follow its rows, w2's are per H
            fields["w13_scale"] = _take(weights.w13_scale, 1, rows)
        elif spec.fp8_scale is Fp8Scale.BLOCK_128:  # [E, row blocks, column blocks]
            fields["w13_scale"] = _take(weights.w13_scale, 1, rows, unit=FP8_BLOCK)
            fields["w2_scale"] = _take(weights.w2_scale, 2, cols, unit=FP8_BLOCK)
    if weights.b13 is not None:
        fields["b13"] = _take(weights.b13, 1, rows)
        fields["b2"] = weights.b2 if rank == 0 else torch.zeros_like(weights.b2)
    return replace(spec, intermediate_size=il), replace(weights, **fields)
