"""GEMM1 of the WGMMA_FP8 engine for per-channel W8A8 (Gluon, sm_90): h = act(x @ w13[e]^T) in fp32.

Per-channel (or per-tensor) weight scales and per-token activation scales are constant along K, so the
K-loop sums each 128-deep step's product unscaled into the fp32 accumulator (`wgmma_fp8._summed_kloop`)
and the epilogue multiplies once: rows by the token's scale, columns by the weight row's.

A tile = 128 sorted rows (`align.paired_blocks`, a math warpgroup per 64) x 64 columns of h. The 64
gate rows and the 64 up rows of those columns land as the two halves of one [128, 128] weight stage (the
producer of `wgmma_fp8_gemm1_tall`, one pass over K), so each warpgroup's wgmma (N = 128) yields gate in
columns 0-63 and up in 64-127. An expert's odd last 64-row block is the first half of its last block:
the second warpgroup then only hands the ring's stages back.

h is written unquantized in fp32 (the reference quantizes h from fp32): its per-token scale needs the
whole row of I, which no tile holds, so `quantize.quantize_rows` quantizes it between the GEMMs. Each
tile folds its rows' max |h| into a per-row maximum (an atomic max), so that pass reads h once. Each
warpgroup stages its [64, 64] of h in shared memory and a TMA store writes it out while the warpgroup
runs the next tile's K-loop: both warpgroups reach a tile's epilogue together, and while they store
the tensor cores idle (without any epilogue GEMM1 ran 8 - 18 % shorter on an H100; the TMA store took
back up to 7 %, docs/performance.md).
"""

from moekit.kernels.triton._details.gemm import _grouped_pid
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _mma_layout,
    _release_stages,
    _ring,
    _summed_kloop,
)
from moekit.kernels.triton._details.wgmma_fp8_gemm1_tall import HALF, _gate_up_step, _half_h
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma


@gluon.jit
def _tile(tile, blocks, tiles, INTER_SIZE: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile `tile`'s block row0, expert, the expert's end row, and N-tile (`blocks`: block experts, block
    starts, expert ends; `tiles`: first, stride, count, valid blocks)."""
    block_expert_ptr, block_start_ptr, expert_end_ptr = blocks
    pid_m, pid_n = _grouped_pid(tile, tiles[3], INTER_SIZE // HALF, GROUP_M)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    return gl.load(block_start_ptr + pid_m), expert, rows_end, pid_n


@gluon.jit
def _channel_math(
    ring,
    blocks,
    tiles,
    scales,
    h_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup, each of the program's tiles in turn (the ring's steps counted on across tiles):
    rows [ROW0, ROW0 + 64) of the tile's block, act(gate, up) of its 64 columns stored in fp32, or only
    the ring's stages handed back if those rows are past the expert's end. `scales`: x's per-token scales
    and row stride, the weight scales, their expert and per-row strides (0 per tensor); `h_out`: h's TMA
    descriptor, this warpgroup's [64, 64] staging buffer, and each row's max |h| (fp32 [R], zeros before
    the launch)."""
    x_scale_ptr, stride_xsm, w_scale_ptr, stride_wse, stride_wsc = scales
    h_desc, h_stage, row_amax_ptr = h_out
    BN: gl.constexpr = 2 * HALF
    layout: gl.constexpr = _mma_layout(BN)
    t0 = 0
    for tile in range(tiles[0], tiles[2], tiles[1]):
        row0, expert, rows_end, pid_n = _tile(tile, blocks, tiles, INTER_SIZE, GROUP_M)
        if row0 + ROW0 >= rows_end:
            _release_stages(ring, t0, KT, NUM_STAGES)
        else:
            acc = _summed_kloop(ring, t0, KT, ROW0, BN, NUM_STAGES)
            first = (row0 + ROW0).to(gl.int64)
            rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
            row_scale = gl.load(x_scale_ptr + first * stride_xsm + rows * stride_xsm)
            cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            # gate rows n .. n + 63 of the expert's 2I, up rows I + n ..
            weight_rows = pid_n * HALF + gl.where(cols < HALF, cols, INTER_SIZE + cols - HALF)
            col_scale = gl.load(w_scale_ptr + expert.to(gl.int64) * stride_wse + weight_rows * stride_wsc)
            scaled = acc * row_scale[:, None] * col_scale[None, :]
            h = _half_h(scaled, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
            tma.store_wait(0)  # the previous tile's h has left the staging buffer
            h_stage.store(h)
            fence_async_shared()
            tma.async_copy_shared_to_global(h_desc, [row0 + ROW0, pid_n * HALF], h_stage)
            # |h| >= 0: the float maximum is the integer one, which every tile of the row folds in.
            amax = gl.max(gl.abs(h), axis=1)
            at_rows = first + gl.arange(0, ROWS_PER_WARPGROUP, layout=amax.type.layout)
            gl.atomic_max(row_amax_ptr + at_rows, amax, sem="relaxed")
        t0 += KT
    tma.store_wait(0)


@gluon.jit
def _channel_loader(
    descriptors,
    ring,
    blocks,
    tiles,
    KT: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """The producer partition (one warp): each of the program's tiles' K-steps, the ring's steps counted on
    across tiles, so that the next tile's first stages land while the math warpgroups store the last."""
    t = 0
    for tile in range(tiles[0], tiles[2], tiles[1]):
        row0, expert, _, pid_n = _tile(tile, blocks, tiles, INTER_SIZE, GROUP_M)
        gate_row = expert * (2 * INTER_SIZE) + pid_n * HALF
        for k in range(KT):
            _gate_up_step(descriptors, ring, t, k, row0, gate_row, gate_row + INTER_SIZE, NUM_STAGES)
            t += 1


@gluon.jit
def _fp8_channel_gemm1(
    x_desc,  # fp8 [R, H] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * 2I, H], block [64, 128]
    x_scale_ptr,  # fp32 [R, 1]: per token
    w_scale_ptr,  # fp32 [E_local, 2I] per channel, or [E_local] per tensor (stride_wsc 0)
    h_desc,  # out fp32 [R, I], block [64, 64]
    row_amax_ptr,  # out fp32 [R]: each row's max |h| (zeros before the launch)
    block_expert_ptr,  # int32 [max_blocks]
    block_start_ptr,  # int32 [max_blocks]
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]: each expert's padded rows start (its end: the next entry)
    stride_xsm,
    stride_wse,
    stride_wsc,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """h = act(x @ w13[e]^T) in fp32, a tile = one 128-row block (`paired_blocks`) x 64 columns of h
    (CONCAT: gate rows n, up rows I + n); a program walks the valid tiles with the grid as stride (a
    program a tile when the grid covers them all, persistent when it is one an SM)."""
    gl.static_assert(w_desc.block_type.shape[0] == HALF)
    gl.static_assert(x_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    gl.static_assert(h_desc.block_type.shape[0] == ROWS_PER_WARPGROUP and h_desc.block_type.shape[1] == HALF)
    KT: gl.constexpr = HIDDEN // SCALE_GROUP
    num_valid = gl.load(num_blocks_ptr)
    tiles = (gl.program_id(0), gl.num_programs(0), num_valid * (INTER_SIZE // HALF), num_valid)
    blocks = (block_expert_ptr, block_start_ptr, expert_end_ptr)
    a_smem, weight_stages, ready, empty = _ring(x_desc, w_desc, 1, 2, NUM_STAGES, 2)
    ring = (a_smem, weight_stages[0], ready, empty)
    scales = (x_scale_ptr, stride_xsm, w_scale_ptr, stride_wse, stride_wsc)
    stages = gl.allocate_shared_memory(gl.float32, [2, ROWS_PER_WARPGROUP, HALF], h_desc.layout)
    first_out = (h_desc, stages.index(0), row_amax_ptr)  # a staging buffer a math warpgroup
    second_out = (h_desc, stages.index(1), row_amax_ptr)
    # Annotated: a tuple bound to an unannotated name hands its constexprs on as run-time values.
    epilogue: gl.constexpr = (INTER_SIZE, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, GROUP_M, NUM_STAGES)
    gl.warp_specialize(
        [
            (_channel_math, (ring, blocks, tiles, scales, first_out, KT, 0) + epilogue),
            (_channel_math, (ring, blocks, tiles, scales, second_out, KT, ROWS_PER_WARPGROUP) + epilogue),
            (_channel_loader, ((x_desc, w_desc), ring, blocks, tiles, KT, INTER_SIZE, GROUP_M, NUM_STAGES)),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )
