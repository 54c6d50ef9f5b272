"""This rank's share of a layer: the spec and `ExpertWeights` a rank of a parallel group holds.

Data flow: (`RankShare` (mode, rank, N as plain values; `RankShare.of(parallel)`), global `MoESpec`)
-> `plan_shard` -> `ShardPlan`: the local spec, the expert map, and one `Cut` per weight tensor ->
applied to weights in memory (`shard_for`, `expert_shard`, `tensor_shard`) or to safetensors slices by
`moekit.checkpoint.load_gpt_oss_layer(share=...)`, so both hold the same bytes. `FusedMoE` checks, plans
and runs the local spec and weights like any other layer.

Expert parallelism, rank r of N: the rank keeps the whole experts it owns
(`moekit.ep.ownership.expert_ownership`, contiguous, E need not be divisible by N): rows
`expert_ownership(E, N)[r]` of every weight tensor (w13, w2, their scales, b13, b2: all expert-major), a
spec with `num_local_experts` E_r and the expert map global id -> local index (-1 elsewhere).

Tensor parallelism, rank r of N, Il = I/N: every expert keeps its gate rows
[r*Il, (r+1)*Il) and the same up rows, in the stored gate layout (CONCAT: two row ranges; INTERLEAVED:
rows [2r*Il, 2(r+1)*Il), which hold the same gate/up pairs), with their per-row scales and b13 entries;
w2 keeps input columns [r*Il, (r+1)*Il) with their column scale blocks. The gated activation works on
each (gate j, up j) pair alone, so the rank's partial outputs sum to the layer's output. b2 stays on
rank 0 and is zero elsewhere, so the sum adds it once: a b2/N on every rank would round differently
in the act dtype than one b2. Quantization blocks may not straddle two ranks: MXFP4 needs Il to be a
multiple of 32 (w2's blocks run along I), FP8 128x128 blocks need Il to be a multiple of 128 (w13's row
blocks and w2's column blocks); anything else is refused here, before any kernel is planned or any
checkpoint slice read. W8A8 with per-token activation scales quantizes each rank's h slice with its own
scale (as vLLM does), so it is within tolerance of one rank rather than the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.ep.ownership import expert_ownership, local_expert_map
from moekit.errors import ArgumentError, SpecError, UnsupportedSpecError, check_enum, check_int
from moekit.formats import MXFP4_BLOCK
from moekit.parallel.spec import Parallel, ParallelMode
from moekit.spec import Fp8Scale, GateLayout, MoESpec, WeightFormat
from moekit.weights import ExpertWeights

FP8_BLOCK = 128  # the edge of an FP8 BLOCK_128 scale block
_EXPERT_FIELDS = ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2")  # expert-major in every packing


@dataclass(frozen=True)
class RankShare:
    """Which share of a layer one rank holds, as plain values (no process group needed to cut)."""

    mode: ParallelMode
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_enum("RankShare.mode", self.mode, ParallelMode, error=ArgumentError)
        check_int("RankShare.world_size", self.world_size, minimum=1, error=ArgumentError)
        check_int("RankShare.rank", self.rank, minimum=0, error=ArgumentError)
        if self.rank >= self.world_size:
            raise ArgumentError(
                f"RankShare.rank={self.rank} must be in [0, world_size={self.world_size}); pass this "
                "process's rank in its group"
            )

    @classmethod
    def of(cls, parallel: Parallel) -> RankShare:
        """This process's share under `parallel` (its rank and the group's size)."""
        return cls(parallel.mode, parallel.rank, parallel.world_size)


@dataclass(frozen=True)
class Cut:
    """What a rank keeps of one weight tensor: along `dim`, the (start, length) `segments` (in entries
    of the stored tensor), concatenated in order; `zeros`: zeros of the whole tensor's shape instead."""

    dim: int
    segments: tuple[tuple[int, int], ...] = ()
    zeros: bool = False

    def indices(self) -> list[tuple[slice, ...]]:
        """One index per segment (`t[index]` is that segment): for tensors and safetensors slices alike."""
        lead = (slice(None),) * self.dim
        return [(*lead, slice(start, start + length)) for start, length in self.segments]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.zeros:
            return torch.zeros_like(t)
        parts = [t[index] for index in self.indices()]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class ShardPlan:
    """A rank's share of a layer: its spec, expert map (expert parallelism) and weight cuts."""

    spec: MoESpec
    expert_map: torch.Tensor | None
    cuts: dict[str, Cut]  # `ExpertWeights` field -> its cut; a field not listed is kept whole

    def apply(self, weights: ExpertWeights) -> ExpertWeights:
        """`weights` (the global layer's) cut to this share."""
        fields = {n: self.cuts[n].apply(t) for n, t in weights.tensors().items() if n in self.cuts}
        return replace(weights, **fields)


def plan_shard(share: RankShare, spec: MoESpec, *, stores_floats: bool) -> ShardPlan:
    """The share `share` of the global layer `spec` (module docstring); `stores_floats`: w13/w2 hold plain
    floats (no quantization blocks to keep whole). Refusals come here, before anything is cut or read."""
    if share.mode is ParallelMode.EXPERT:
        if spec.uses_expert_map:
            raise SpecError(
                "Parallel.expert shards the global layer, but spec.num_local_experts="
                f"{spec.num_local_experts}; pass the spec and weights of all E experts "
                "(num_local_experts=None)"
            )
        owned = expert_ownership(spec.E, share.world_size)[share.rank]
        rows = Cut(0, ((owned.start, len(owned)),))
        local = replace(spec, num_local_experts=len(owned))
        return ShardPlan(
            local, local_expert_map(spec.E, share.rank, share.world_size), dict.fromkeys(_EXPERT_FIELDS, rows)
        )
    return ShardPlan(*_tensor_plan(spec, stores_floats, share.rank, share.world_size))


def shard_for(
    parallel: Parallel,
    spec: MoESpec,
    weights: ExpertWeights,
    expert_map: torch.Tensor | None = None,
    *,
    presharded: bool = False,
) -> tuple[MoESpec, ExpertWeights, torch.Tensor | None]:
    """This rank's (spec, weights, expert map) of the global layer (`spec`, `weights`) under `parallel`.

    `presharded`: `weights` are this rank's share already (a loader cut them, `plan_shard`'s cuts); only
    the spec and expert map are derived, nothing is cut a second time."""
    if parallel.mode is ParallelMode.EXPERT and expert_map is not None:
        raise ArgumentError(
            "expert_map: Parallel.expert builds this rank's expert map from the group; pass the global "
            "layer (spec.num_local_experts=None) without expert_map"
        )
    if presharded:
        share = plan_shard(RankShare.of(parallel), spec, stores_floats=weights.stores_floats)
        return share.spec, weights, share.expert_map if parallel.mode is ParallelMode.EXPERT else expert_map
    if parallel.mode is ParallelMode.EXPERT:
        return expert_shard(spec, weights, rank=parallel.rank, world_size=parallel.world_size)
    return (*tensor_shard(spec, weights, rank=parallel.rank, world_size=parallel.world_size), expert_map)


def expert_shard(
    spec: MoESpec, weights: ExpertWeights, *, rank: int, world_size: int
) -> tuple[MoESpec, ExpertWeights, torch.Tensor]:
    """Rank `rank`'s expert-parallel (spec with E_r local experts, weights of its experts, expert map)."""
    share = RankShare(ParallelMode.EXPERT, rank, world_size)
    share = plan_shard(share, spec, stores_floats=weights.stores_floats)  # refuses a local spec first
    weights.validate(spec)  # the global shapes, so an error names the tensor the caller passed
    return share.spec, share.apply(weights), share.expert_map


def _block_rule(spec: MoESpec, stores_floats: bool) -> tuple[int, str] | None:
    """(block, what) when the stored weights have quantization blocks a shard must not split."""
    if stores_floats:
        return None
    if spec.weight_format is WeightFormat.MXFP4:
        return MXFP4_BLOCK, f"MXFP4's {MXFP4_BLOCK}-element scale blocks along w2's input dim I"
    if spec.fp8_scale is Fp8Scale.BLOCK_128:
        return FP8_BLOCK, f"FP8 {FP8_BLOCK}x{FP8_BLOCK} scale blocks (w13's row blocks, w2's column blocks)"
    return None


def _check_divisible(spec: MoESpec, stores_floats: bool, world_size: int) -> int:
    i = spec.I
    rule = _block_rule(spec, stores_floats)
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


def _cut(dim: int, segments: list[tuple[int, int]], unit: int = 1) -> Cut:
    """`segments` in elements, `unit` elements per entry of the stored tensor along `dim`."""
    return Cut(dim, tuple((start // unit, length // unit) for start, length in segments))


def _tensor_plan(
    spec: MoESpec, stores_floats: bool, rank: int, world_size: int
) -> tuple[MoESpec, None, dict[str, Cut]]:
    il = _check_divisible(spec, stores_floats, world_size)
    rows = _w13_segments(spec.I, il, rank, spec.gate_layout)
    cols = [(rank * il, il)]
    cuts = {"w13": _cut(1, rows), "w2": _cut(2, cols), "b13": _cut(1, rows)}
    if rank != 0:
        cuts["b2"] = Cut(1, zeros=True)
    if not stores_floats and spec.weight_format is WeightFormat.MXFP4:
        # [E, H, I/32, 16] codes and [E, H, I/32] scales: whole blocks (checked above)
        cuts["w2"] = cuts["w2_scale"] = _cut(2, cols, unit=MXFP4_BLOCK)
        cuts["w13_scale"] = _cut(1, rows)
    elif not stores_floats and spec.fp8_scale is Fp8Scale.PER_CHANNEL:  # w13's follow rows, w2's per H
        cuts["w13_scale"] = _cut(1, rows)
    elif not stores_floats and spec.fp8_scale is Fp8Scale.BLOCK_128:  # [E, row blocks, column blocks]
        cuts["w13_scale"] = _cut(1, rows, unit=FP8_BLOCK)
        cuts["w2_scale"] = _cut(2, cols, unit=FP8_BLOCK)
    return replace(spec, intermediate_size=il), None, cuts


def tensor_shard(
    spec: MoESpec, weights: ExpertWeights, *, rank: int, world_size: int
) -> tuple[MoESpec, ExpertWeights]:
    """Rank `rank`'s tensor-parallel (spec with I/N, weights) of the global layer (module docstring)."""
    weights = weights.unpacked()  # MMA words hold 16-row blocks; slice checkpoint rows
    weights.validate(spec)  # the global shapes, so an error names the tensor the caller passed
    share = plan_shard(
        RankShare(ParallelMode.TENSOR, rank, world_size), spec, stores_floats=weights.stores_floats
    )
    return share.spec, share.apply(weights)
