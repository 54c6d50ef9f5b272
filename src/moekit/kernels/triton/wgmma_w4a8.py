"""W4A8 on Hopper: MXFP4 weights against per-token FP8 activations on FP8 wgmma, for prefill, where the
layer is compute-bound and FP8 tensor cores run twice bf16's rate (`_details.wgmma_w4a8`).

Data flow of `wgmma_w4a8_moe` (no host sync; graph-capturable):
  ids -> `align_routing` at BLOCK_M rows
  x -> `wgmma_fp8.sorted_fp8_rows`: each token's FP8 codes (one scale a token) into the sorted rows of its
     pairs
  -> GEMM1 (GATED) -> h fp32 [R, I] in the sorted rows (fp32: the reference quantizes h from fp32; h in
     bf16 moved the layer's rel L2 against the reference from 4.2e-3 to 1.3e-2, over the 1e-2 tolerance,
     for 0.7 % of gpt-oss-120b's time at T = 16384 on an H200)
  -> `quantize_rows` per token -> FP8 h [R, I] + scales
  -> GEMM2 -> b2, router weight -> y [T*K, H] in pair order -> `sum_k.sum_top_k` -> out [T, H].
Which specs it takes is `wgmma_w4a8_reason`; it reads MXFP4_W4A8 weights (`mxfp4_w4a8.pack_w4a8`, made at
load by the kernel's `prepare_weights`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from moekit.formats import mxfp4_w4a8
from moekit.kernels.triton._details.codes import activation_constexprs
from moekit.kernels.triton.align import align_routing, max_blocks_bound
from moekit.kernels.triton.quantize import quantize_rows
from moekit.kernels.triton.sum_k import sum_top_k
from moekit.kernels.triton.wgmma_fp8 import fp8_rows, multiprocessors, sorted_fp8_rows
from moekit.routing import RoutingResult
from moekit.spec import ActivationQuant, GateLayout, MoESpec, RouterWeightPlacement, WeightFormat
from moekit.weights import ExpertWeights, WeightPacking, gate_layout_permutation

BLOCK_M = 128  # sorted rows a program (the wgmma's N) and the alignment's block
STAGES = range(2, 7)  # activation tiles in flight: 16 KiB a stage
# The math partitions' and the TMA producer's register budgets (2 x 4 warps x 232 + 32 x 40 of the SM's
# 64 K): the pair K-loop holds two steps' decoded bytes and the next two steps' words beside its
# accumulator and product.
MATH_REGISTERS, LOAD_REGISTERS = 232, 40
# Blocks at most a quarter or half full (an expert's last) run a wgmma on their first 32 or 64 rows.
NARROW_BLOCKS = True
# One program an SM, each walking the tiles (M-block, N-tile) its id strides over, so that a program's next
# tile is loaded under its last one's epilogue; else a program a tile.
PERSISTENT = True
# The next pair of K-steps' decode under the pair's wgmmas, where ptxas serializes every wgmma instruction
# of the kernel (C7513), or after the pair's wait, the pair's wgmmas pipelined: under them from this many
# tokens an expert (`decode_under_mma`). On an H100 (whole layer, graph replay, L2 flushed, FP8 per token,
# one timing each) after the wait ran 4 - 7 % faster at 1 - 32 tokens an expert (gpt-oss-120b T = 1, 64,
# 1024; gpt-oss-20b T = 1, 64) and 3 % at 128 (gpt-oss-20b T = 1024), level at 128 (gpt-oss-120b T = 4096),
# and 0.3 - 1 % slower at 512 (gpt-oss-120b T = 16384, gpt-oss-20b T = 4096) and 3.5 % at 2048 (gpt-oss-20b
# T = 16384).
DECODE_UNDER_MMA_FROM_TOKENS_PER_EXPERT = 512


def decode_under_mma(spec: MoESpec, num_tokens: int) -> bool:
    """Whether the K-loop decodes the next pair of steps under the pair's wgmmas (see the constant above):
    by the (token, expert) pairs each expert sees."""
    return spec.tokens_per_expert(num_tokens) >= DECODE_UNDER_MMA_FROM_TOKENS_PER_EXPERT


@functools.cache
def _kernel():
    """The Gluon GEMM, or None where this Triton has no Gluon Hopper support."""
    try:
        from moekit.kernels.triton._details import wgmma_w4a8
    except ImportError:
        return None
    return wgmma_w4a8._w4a8_gemm


def wgmma_w4a8_reason(spec: MoESpec) -> str | None:
    """None if the WGMMA_W4A8 engine computes `spec`, else why not."""
    if spec.weight_format is not WeightFormat.MXFP4 or spec.act_quant is ActivationQuant.NONE:
        return "it is the W4A8 path: MXFP4 weights with FP8 activations (act_quant)"
    if spec.act_quant is not ActivationQuant.FP8_PER_TOKEN:
        return (
            f"it scales activations per token (FP8_PER_TOKEN), once after the K-loop; {spec.act_quant.name} "
            "would need a promotion every 128 columns"
        )
    if spec.router_weight_placement is not RouterWeightPlacement.OUTPUT:
        return "it applies the router weight to GEMM2's output (OUTPUT placement)"
    if (2 * spec.I) % mxfp4_w4a8.PROGRAM_ROWS:
        return (
            f"its GEMM1 programs take 128 w13 rows (64 columns of h): 2I must be a multiple of 128, "
            f"got {2 * spec.I}"
        )
    for name, size in (("H", spec.H), ("I", spec.I)):
        if size % 16:
            return f"TMA reads the FP8 rows: {name} must be a multiple of 16 bytes, got {size}"
    if _kernel() is None:
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return None


def pack_weights(weights: ExpertWeights) -> ExpertWeights:
    """CHECKPOINT MXFP4 weights -> MXFP4_W4A8 (w13's rows interleaved gate/up, as the kernel reads them)."""
    w13, s13 = weights.w13, weights.w13_scale
    if weights.gate_layout is not GateLayout.INTERLEAVED:
        perm = gate_layout_permutation(weights.I, source=weights.gate_layout, target=GateLayout.INTERLEAVED)
        w13, s13 = w13[:, perm.to(w13.device)], s13[:, perm.to(s13.device)]
    w13, d13 = mxfp4_w4a8.pack_w4a8(w13, s13, in_dim=weights.H)
    w2, d2 = mxfp4_w4a8.pack_w4a8(weights.w2, weights.w2_scale, in_dim=weights.I)
    return replace(
        weights,
        packing=WeightPacking.MXFP4_W4A8,
        w13=w13,
        w2=w2,
        w13_scale=d13,
        w2_scale=d2,
        hidden_size=weights.H,
    )


def wgmma_w4a8_workspace_bytes(spec: MoESpec, num_tokens: int) -> int:
    """Device memory one `wgmma_w4a8_moe` call allocates besides `out`: x's FP8 rows and scales, h in fp32
    and in FP8 (sorted rows, at most `max_blocks_bound` blocks), y, and the routing metadata."""
    pairs = num_tokens * spec.K
    rows = BLOCK_M * max_blocks_bound(num_pairs=pairs, num_local_experts=spec.E_local, block_m=BLOCK_M)
    y = pairs * spec.H * torch.empty((), dtype=spec.act_dtype).element_size()
    return rows * (spec.H + 5 * spec.I + 12) + y + 20 * pairs + 4 * rows


def _grid(tiles: int, device: torch.device) -> tuple[int]:
    """Programs for at most `tiles` tiles (the valid ones are counted on the device)."""
    return (min(tiles, multiprocessors(device)) if PERSISTENT else tiles,)


def wgmma_w4a8_moe(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    num_stages: int,
    group_m: int,
    expert_map: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer of `spec` into `out` [T, H] (T > 0); the caller checked the inputs, the spec
    (`wgmma_w4a8_reason`), the weights' packing (MXFP4_W4A8) and the device (sm_90)."""
    gemm = _kernel()
    aligned = align_routing(
        routing.ids, num_local_experts=spec.E_local, block_m=BLOCK_M, expert_map=expert_map
    )
    # TMA reads [BLOCK_M, 128] tiles of the FP8 rows: columns past H or I read as zeros
    xq, xs = sorted_fp8_rows(x if x.stride(1) == 1 else x.contiguous(), aligned, spec=spec)
    rows = xq.shape[0]
    common = dict(
        route_w_ptr=routing.weights.contiguous().view(-1),  # fp32 [T*K]
        sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [max_blocks * BLOCK_M]
        block_expert_ptr=aligned.block_expert,  # int32 [max_blocks]
        num_blocks_ptr=aligned.num_valid_blocks,  # int32 [1]
        num_pairs=aligned.num_pairs,
        BN=BLOCK_M,
        NS=num_stages,
        GROUP_M=group_m,
        INTERLEAVED=spec.gate_layout is GateLayout.INTERLEAVED,
        **activation_constexprs(spec.activation),
        MATH_REGISTERS=MATH_REGISTERS,
        LOAD_REGISTERS=LOAD_REGISTERS,
        NARROW=NARROW_BLOCKS,
        DECODE_UNDER_MMA=decode_under_mma(spec, routing.ids.shape[0]),
        num_warps=4,
    )
    h = torch.empty(rows, spec.I, dtype=torch.float32, device=x.device)
    gemm[_grid(aligned.max_blocks * (2 * spec.I // 128), x.device)](
        a_desc=fp8_rows(xq, BLOCK_M),
        a_scale_ptr=xs,  # fp32 [R, 1]
        w_ptr=weights.w13,  # int32 [E, 2I/16, KT, 32, 8]
        d_ptr=weights.w13_scale,  # int32 [E, 2I, KT + R]
        b_ptr=weights.b13,  # [E, 2I] or None
        out_ptr=h,
        stride_d=weights.w13_scale.stride(1),
        stride_out=h.stride(0),
        KT=mxfp4_w4a8.steps(spec.H),
        N_ROWS=2 * spec.I,
        N_OUT=2 * spec.I,
        GATED=True,
        **common,
    )
    # The rows of pairs only: GEMM2 computes padding rows' columns from whatever they hold and never stores
    # them, as GEMM1 does with x's (`sorted_fp8_rows` writes no padding row either).
    hq, hs = quantize_rows(h, quant=ActivationQuant.FP8_PER_TOKEN, pair_rows_of=aligned)
    y = torch.empty(aligned.num_pairs, spec.H, dtype=spec.act_dtype, device=x.device)
    n_rows = mxfp4_w4a8.padded_rows(spec.H)
    gemm[_grid(aligned.max_blocks * (n_rows // 128), x.device)](
        a_desc=fp8_rows(hq, BLOCK_M),
        a_scale_ptr=hs,  # fp32 [R, 1]
        w_ptr=weights.w2,  # int32 [E, H'/16, KT, 32, 8]
        d_ptr=weights.w2_scale,  # int32 [E, H', KT + R]
        b_ptr=weights.b2,  # [E, H] or None
        out_ptr=y,
        stride_d=weights.w2_scale.stride(1),
        stride_out=y.stride(0),
        KT=mxfp4_w4a8.steps(spec.I),
        N_ROWS=n_rows,
        N_OUT=spec.H,
        GATED=False,
        **common,
    )
    return sum_top_k(y, pair_expert=aligned.pair_expert, out=out, spec=spec)
