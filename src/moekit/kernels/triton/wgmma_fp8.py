"""The FP8 W8A8 prefill path on Hopper: Gluon wgmma GEMMs with overlapped promotion, for block-128 scales
(DeepSeek-V3) and for per-channel or per-tensor weights with per-token activations (FP8-dynamic
checkpoints: Mixtral, Qwen3).

Data flow of `wgmma_fp8_moe` (no host sync; graph-capturable):
  ids -> `align_routing` at 64 rows (GEMM1's M-blocks) and `paired_blocks` (GEMM2's 128-row blocks,
  each expert's odd last 64-row block as the first half of one)
  x -> `_quant_fp8_groups_sorted` -> x fp8 [R, H] + scales, in the sorted rows (TMA reads them whole)
  -> block-128: `_fp8_gemm1` on the 64-row blocks, or `_fp8_gemm1_tall` on the paired 128-row blocks
       -> h fp8 [R, I] + scales (activation and h's 1x128 quantization in its epilogue);
     per-channel: `_fp8_channel_gemm1` on the paired blocks -> h fp32 [R, I] -> `quantize_rows` per token
       -> h fp8 [R, I] + scales [R, 1]
  -> `_fp8_gemm2` (one persistent launch over the paired blocks) -> y [T*K, H] * router weight
  -> `sum_k.sum_top_k` -> out [T, H].
Which specs and configs it takes is `wgmma_fp8_reason` and `wgmma_fp8_config_reason`; the planner offers
it only where both are None.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import triton
from moekit.kernels.triton._details.codes import ACT_SILU, activation_constexprs
from moekit.kernels.triton._details.quant import _quant_fp8_groups_sorted
from moekit.kernels.triton.align import (
    AlignedRouting,
    align_routing,
    max_blocks_bound,
    pair_rows,
    paired_blocks,
)
from moekit.kernels.triton.pdl import pdl_args
from moekit.kernels.triton.quantize import quantize_rows
from moekit.kernels.triton.sum_k import sum_top_k
from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationQuant,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)
from moekit.weights import ExpertWeights

TILE_K = 128  # one scale group a K-step
TILE_N = 128  # one weight scale block (and one h scale group) a tile
GEMM1_ROWS = 64  # one M-block of GEMM1: the gate and the up warpgroup each hold 64 x 128
CHANNEL_GEMM1_ROWS = 2 * GEMM1_ROWS  # the per-channel GEMM1's block: GEMM2's paired 128-row blocks
CHANNEL_GEMM1_COLUMNS = 64  # h columns a per-channel GEMM1 tile: 64 gate and 64 up weight rows
# setmaxnreg budgets: the math warpgroups hold the accumulator, the retired and the in-flight
# product (3 x 64 fp32 a thread); the one-warp TMA producer needs few.
MATH_REGISTERS = 232
LOAD_REGISTERS = 40
# GEMM2's ring depth (GEMM1's is the config's num_stages): 180 KiB of 32 KiB stages with its epilogue,
# compiled for sm_90. On an H200 (GEMM2's kernel time, same inputs, outputs equal) 5 stages ran 0.4 - 8 %
# shorter than 4 for DeepSeek-V3 at T = 4096 / 8192 / 16384 and E 128 / H 4096 / I 1536 at T = 4096 /
# 16384; 6 (213 KiB) was no shorter than 5.
GEMM2_STAGES = 5


@dataclass(frozen=True)
class _Gluon:
    """The Gluon pieces the launch needs, imported once."""

    gl: object  # triton.experimental.gluon.language
    tensor_descriptor: type  # host-side TMA descriptor
    gemm1: object  # `_details.wgmma_fp8_gemm1._fp8_gemm1`
    gemm1_tall: object  # `_details.wgmma_fp8_gemm1_tall._fp8_gemm1_tall`
    gemm2: object  # `_details.wgmma_fp8_gemm2._fp8_gemm2`
    channel_gemm1: object  # `_details.wgmma_fp8_channel._fp8_channel_gemm1`


@functools.cache
def _gluon_hopper() -> _Gluon | None:
    """The Gluon kernels and descriptor type, or None where this Triton has no Gluon Hopper support."""
    try:
        from moekit.kernels.triton._details import (
            wgmma_fp8_channel,
            wgmma_fp8_gemm1,
            wgmma_fp8_gemm1_tall,
            wgmma_fp8_gemm2,
        )
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return None
    return _Gluon(
        gl,
        TensorDescriptor,
        wgmma_fp8_gemm1._fp8_gemm1,
        wgmma_fp8_gemm1_tall._fp8_gemm1_tall,
        wgmma_fp8_gemm2._fp8_gemm2,
        wgmma_fp8_channel._fp8_channel_gemm1,
    )


def per_channel(spec: MoESpec) -> bool:
    """Whether `spec` runs the engine's per-channel form (per-channel or per-tensor weight scales, per-token
    activations) rather than its block-128 one."""
    return spec.fp8_scale is not Fp8Scale.BLOCK_128


def wgmma_fp8_reason(spec: MoESpec) -> str | None:
    """None if the Gluon FP8 path computes `spec` (shapes and math), else why not."""
    if spec.weight_format is not WeightFormat.FP8_E4M3:
        return "it is the W8A8 path (FP8 weights and FP8 activations)"
    block = spec.fp8_scale is Fp8Scale.BLOCK_128 and spec.act_quant is ActivationQuant.FP8_PER_GROUP_128
    channel = per_channel(spec) and spec.act_quant is ActivationQuant.FP8_PER_TOKEN
    if not (block or channel):
        return (
            "it is the W8A8 path with block-128 weight scales and 1x128 activation groups, or per-channel / "
            f"per-tensor weight scales and per-token activations; got {spec.fp8_scale.name} weight scales "
            f"with act_quant={spec.act_quant.name}"
        )
    if spec.act_dtype is not torch.bfloat16:
        return f"it takes bf16 activations, got {spec.act_dtype}"
    if spec.has_bias or spec.gate_layout is not GateLayout.CONCAT:
        return "its GEMM1 epilogue takes concatenated gate/up rows without bias"
    # The per-channel GEMM1 writes h unquantized, through the shared gated activation (every kind, the
    # clamp included); the block-128 GEMM1s quantize h in an epilogue written for plain SiLU.
    if block and (spec.activation.kind is not Activation.SILU or spec.activation.limit is not None):
        return "its block-128 GEMM1 epilogue computes plain SiLU(gate) * up"
    if spec.router_weight_placement is not RouterWeightPlacement.OUTPUT:
        return "it applies the router weight to GEMM2's output"
    for name, size in (("H", spec.H), ("I", spec.I)):
        if size % (2 * TILE_K):
            return (
                f"its K-loop runs two 128-deep steps at a time: {name} must be a multiple of 256, got {size}"
            )
    if _gluon_hopper() is None:
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return None


def wgmma_fp8_config_reason(spec: MoESpec, gemm1_block_m: int | None) -> str | None:
    """None if the engine runs `spec` (which `wgmma_fp8_reason` takes) with GEMM1 on `gemm1_block_m` rows,
    else why not: the per-channel form has one GEMM1, on the 128-row blocks."""
    if per_channel(spec) and gemm1_block_m != CHANNEL_GEMM1_ROWS:
        return (
            f"its per-channel GEMM1 runs on {CHANNEL_GEMM1_ROWS}-row blocks only: gemm1_block_m must be "
            f"{CHANNEL_GEMM1_ROWS}, got {gemm1_block_m}"
        )
    return None


def wgmma_fp8_workspace_bytes(spec: MoESpec, num_tokens: int) -> int:
    """Device memory one `wgmma_fp8_moe` call allocates besides `out`: x's and h's FP8 codes and scales in
    the sorted rows (at most `max_blocks_bound` 64-row blocks; per-channel, h in fp32 as well), y, and the
    routing metadata."""
    pairs = num_tokens * spec.K
    rows = GEMM1_ROWS * max_blocks_bound(num_pairs=pairs, num_local_experts=spec.E_local, block_m=GEMM1_ROWS)
    sorted_rows = rows * (spec.H + spec.I) * (1 + 4 / TILE_K)  # codes + fp32 scales per 128
    h_fp32 = 4 * rows * (spec.I + 1) if per_channel(spec) else 0
    y = pairs * spec.H * torch.empty((), dtype=spec.act_dtype).element_size()
    return int(sorted_rows) + h_fp32 + y + 16 * pairs + 4 * rows


@functools.cache  # asked at every launch of the persistent GEMMs
def multiprocessors(device: torch.device) -> int:
    """The SM count of `device`: the persistent GEMMs' grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_rows(tensor: torch.Tensor, rows: int):
    """A TMA descriptor of fp8 `tensor` [R, C] read in [rows, 128] tiles."""
    return tma_tiles(tensor, [rows, TILE_K])


def tma_tiles(tensor: torch.Tensor, block: list[int]):
    """A TMA descriptor of fp8 or fp32 `tensor` [R, C] in `block` tiles, the default shared layout."""
    gluon = _gluon_hopper()
    element = {torch.float8_e4m3fn: gluon.gl.float8e4nv, torch.float32: gluon.gl.float32}[tensor.dtype]
    layout = gluon.gl.NVMMASharedLayout.get_default_for(block, element)
    return gluon.tensor_descriptor.from_tensor(tensor, block, layout)


def wgmma_fp8_moe(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    gemm1_stages: int,
    group_m: int,
    gemm1_block_m: int | None,
    expert_map: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer of `spec` into `out` [T, H] (T > 0); the caller checked the inputs, the spec
    (`wgmma_fp8_reason`), the config (`wgmma_fp8_config_reason`) and the device (sm_90). `gemm1_block_m`,
    `gemm1_stages`: the config's (None for GEMM1 on the alignment's 64-row blocks, 128 on GEMM2's,
    `_details.wgmma_fp8_gemm1_tall` or, per-channel, `_details.wgmma_fp8_channel`; GEMM1's ring depth,
    GEMM2's being GEMM2_STAGES)."""
    gluon = _gluon_hopper()
    aligned = align_routing(
        routing.ids, num_local_experts=spec.E_local, block_m=GEMM1_ROWS, expert_map=expert_map
    )
    xq, xs = sorted_fp8_rows(x if x.stride(1) == 1 else x.contiguous(), aligned, spec=spec)
    tuning = dict(GROUP_M=group_m, MATH_REGISTERS=MATH_REGISTERS, LOAD_REGISTERS=LOAD_REGISTERS, num_warps=4)
    blocks = paired_blocks(aligned)
    gemm1_tuning = dict(tuning, NUM_STAGES=gemm1_stages)
    if per_channel(spec):
        h, hs = _channel_gemm1(xq, xs, weights, aligned, blocks, spec=spec, tuning=gemm1_tuning)
        w2_scale_strides = channel_scale_strides(weights.w2_scale, tile=TILE_N)
    else:
        h = torch.empty(xq.shape[0], spec.I, dtype=torch.float8_e4m3fn, device=x.device)
        hs = torch.empty(xq.shape[0], spec.I // TILE_K, dtype=torch.float32, device=x.device)
        tall = gemm1_block_m is not None
        _gemm1(xq, xs, weights, aligned, blocks, (h, hs), spec=spec, tall=tall, tuning=gemm1_tuning)
        w2_scale_strides = block_scale_strides(weights.w2_scale)  # fp32 [E_local, H/128, I/128]
    y = torch.empty(aligned.num_pairs, spec.H, dtype=spec.act_dtype, device=x.device)
    # An expert's odd last block runs next to its other blocks (the same weight tiles, from L2), not in
    # a launch of its own that streams those experts' weights again: on an H200 the separate tail launch
    # ran DRAM-bound, 556 us of DeepSeek-V3's 5.1 ms at T = 4096.
    # Persistent: a program an SM (at most one a tile); the tiles it walks are counted on the device.
    grid = min(blocks.max_blocks * (spec.H // TILE_N), multiprocessors(x.device))
    gluon.gemm2[(grid,)](
        h_desc=fp8_rows(h, blocks.block_m),  # fp8 [R, I]
        w_desc=fp8_rows(weights.w2.reshape(-1, spec.I), TILE_N),  # fp8 [E_local * H, I]
        h_scale_ptr=hs,  # fp32 [R, I/128] or [R, 1]
        w_scale_ptr=weights.w2_scale,
        sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [R]
        route_w_ptr=routing.weights.contiguous().view(-1),  # fp32 [T*K]
        y_ptr=y,  # [T*K, H]
        block_expert_ptr=blocks.block_expert,  # int32 [max_blocks]
        block_start_ptr=blocks.block_start,  # int32 [max_blocks]
        num_blocks_ptr=blocks.num_valid_blocks,  # int32 [1]
        expert_end_ptr=aligned.expert_offsets,  # int64 [E_local + 1]
        num_pairs=aligned.num_pairs,
        stride_hsm=hs.stride(0),
        **w2_scale_strides,
        stride_ym=y.stride(0),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        NUM_STAGES=GEMM2_STAGES,
        PER_CHANNEL=per_channel(spec),
        **tuning,
    )
    return sum_top_k(y, pair_expert=aligned.pair_expert, out=out, spec=spec)


def _channel_gemm1(xq, xs, weights, aligned, blocks, *, spec: MoESpec, tuning: dict):
    """The per-channel GEMM1 on the paired 128-row blocks, 64 columns of h a tile, h in fp32; then h's
    FP8 codes [R, I] and per-token scales [R, 1] (the rows of pairs only: GEMM2 computes padding rows
    from whatever they hold and never stores them)."""
    h = torch.empty(xq.shape[0], spec.I, dtype=torch.float32, device=xq.device)
    # Each row's max |h|, kept by GEMM1 (an atomic max), so the per-token quantization reads h once instead
    # of twice: that pass then runs at the copy rate, and the atomic max costs GEMM1 under 3 %.
    row_amax = torch.zeros(xq.shape[0], dtype=torch.float32, device=xq.device)
    scales = weights.w13_scale  # fp32 [E_local, 2I] or [E_local]
    # Persistent, one program an SM walking at most this many tiles (the valid ones counted on the device),
    # its ring running on from one tile into the next: the tiles are short (H / 128 K-steps), and a program
    # a tile left each ring fill and epilogue exposed (4 - 9 % longer on an H100, docs/performance.md).
    tiles = blocks.max_blocks * (spec.I // CHANNEL_GEMM1_COLUMNS)
    grid = min(tiles, multiprocessors(xq.device))
    _gluon_hopper().channel_gemm1[(grid,)](
        x_desc=fp8_rows(xq, CHANNEL_GEMM1_ROWS),  # fp8 [R, H]
        w_desc=fp8_rows(weights.w13.reshape(-1, spec.H), CHANNEL_GEMM1_COLUMNS),  # fp8 [E_local * 2I, H]
        x_scale_ptr=xs,  # fp32 [R, 1]
        w_scale_ptr=scales,
        h_desc=tma_tiles(h, [GEMM1_ROWS, CHANNEL_GEMM1_COLUMNS]),  # fp32 [R, I]
        row_amax_ptr=row_amax,  # fp32 [R]
        block_expert_ptr=blocks.block_expert,  # int32 [max_blocks]
        block_start_ptr=blocks.block_start,  # int32 [max_blocks]
        num_blocks_ptr=blocks.num_valid_blocks,  # int32 [1]
        expert_end_ptr=aligned.expert_offsets,  # int64 [E_local + 1]
        stride_xsm=xs.stride(0),
        stride_wse=scales.stride(0),
        stride_wsc=_column_stride(scales),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        **activation_constexprs(spec.activation),
        **tuning,
    )
    return quantize_rows(h, quant=ActivationQuant.FP8_PER_TOKEN, pair_rows_of=aligned, row_amax=row_amax)


def _gemm1(xq, xs, weights, aligned, blocks, gemm1_out, *, spec: MoESpec, tall: bool, tuning: dict) -> None:
    """GEMM1, 128 columns of h a program: on the alignment's 64-row blocks, or (`tall`) on `paired_blocks`'
    128-row blocks in two 64-column passes."""
    h, hs = gemm1_out
    s13 = weights.w13_scale  # fp32 [E_local, 2I/128, H/128]
    if tall:
        kernel, rows, w_rows = _gluon_hopper().gemm1_tall, 2 * GEMM1_ROWS, TILE_N // 2
        block_args = dict(
            block_expert_ptr=blocks.block_expert,  # int32 [max_blocks]
            block_start_ptr=blocks.block_start,  # int32 [max_blocks]
            num_blocks_ptr=blocks.num_valid_blocks,  # int32 [1]
            expert_end_ptr=aligned.expert_offsets,  # int64 [E_local + 1]
            num_pid_m=blocks.max_blocks,
        )
    else:
        kernel, rows, w_rows = _gluon_hopper().gemm1, GEMM1_ROWS, TILE_N
        block_args = dict(
            block_expert_ptr=aligned.block_expert,  # int32 [max_blocks]
            num_blocks_ptr=aligned.num_valid_blocks,  # int32 [1]
            num_pid_m=aligned.max_blocks,
        )
    kernel[(block_args["num_pid_m"] * (spec.I // TILE_N),)](
        x_desc=fp8_rows(xq, rows),  # fp8 [R, H]
        w_desc=fp8_rows(weights.w13.reshape(-1, spec.H), w_rows),  # fp8 [E_local * 2I, H]
        x_scale_ptr=xs,  # fp32 [R, H/128]
        w_scale_ptr=s13,
        h_ptr=h,  # fp8 [R, I]
        h_scale_ptr=hs,  # fp32 [R, I/128]
        **block_args,
        stride_xsm=xs.stride(0),
        **block_scale_strides(s13),
        stride_hm=h.stride(0),
        stride_hsm=hs.stride(0),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        # plain SiLU(gate) * up, the one activation `wgmma_fp8_reason` takes
        ACTIVATION=ACT_SILU.value,
        ALPHA=0.0,
        HAS_LIMIT=False,
        LIMIT=0.0,
        **tuning,
    )


def channel_scale_strides(scales: torch.Tensor, *, tile: int) -> dict:
    """GEMM2's stride arguments of per-channel weight scales [E_local, N] or per-tensor ones [E_local]
    (any strides), read `tile` columns an N-tile: the N-tile's step and the column's (in stride_wsk)."""
    column = _column_stride(scales)
    return dict(stride_wse=scales.stride(0), stride_wsn=tile * column, stride_wsk=column)


def _column_stride(scales: torch.Tensor) -> int:
    """From one output row's weight scale to the next: per-channel [E_local, N]'s, 0 per tensor [E_local]."""
    return scales.stride(1) if scales.dim() == 2 else 0


def block_scale_strides(scales: torch.Tensor) -> dict:
    """The GEMMs' stride arguments of weight block scales [E_local, N/128, K/128] (any strides)."""
    return dict(stride_wse=scales.stride(0), stride_wsn=scales.stride(1), stride_wsk=scales.stride(2))


def sorted_fp8_rows(
    x: torch.Tensor, aligned: AlignedRouting, *, spec: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """x's FP8 codes [R, H] and scales [R, H/128] (per 1x128 group) or [R, 1] (per token, as
    `spec.act_quant` says) in the alignment's sorted rows (each token quantized once, stored at each of
    its kept pairs' rows; padding rows left unwritten)."""
    rows = aligned.max_blocks * aligned.block_m
    per_token = spec.act_quant is ActivationQuant.FP8_PER_TOKEN
    groups = 1 if per_token else spec.H // TILE_K
    xq = torch.empty(rows, spec.H, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    groups_per_program = min(8, triton.next_power_of_2(groups))
    _quant_fp8_groups_sorted[(x.shape[0], triton.cdiv(groups, groups_per_program))](
        **pdl_args(x.device),
        src_ptr=x,  # [T, H]
        pair_expert_ptr=aligned.pair_expert,  # int32 [T*K]
        pair_rows_ptr=pair_rows(aligned),  # int32 [T*K]
        dst_ptr=xq,  # fp8 [R, H]
        scale_ptr=xs,  # fp32 [R, groups]
        NUM_COLS=spec.H,
        stride_src=x.stride(0),
        stride_dst=xq.stride(0),
        stride_scale=xs.stride(0),
        TOP_K=spec.K,
        GROUPS=groups_per_program,
        GROUP_COLS=triton.next_power_of_2(spec.H) if per_token else TILE_K,
    )
    return xq, xs
