"""GEMM1 of the WGMMA_FP8 engine for per-channel W8A8 (Gluon, sm_90): h = act(x @ w13[e]^T) in fp32.

Per-channel (or per-tensor) weight scales and per-token activation scales are constant along K, so the
K-loop sums each 128-deep step's product unscaled into the fp32 accumulator (`wgmma_fp8._summed_kloop`)
and the epilogue multiplies once: rows by the token's scale, columns by the weight row's.

A program = 128 sorted rows (`align.paired_blocks`, a math warpgroup per 64) x 64 columns of h. The 64
gate rows and the 64 up rows of those columns land as the two halves of one [128, 128] weight stage (the
producer of `wgmma_fp8_gemm1_tall`, one pass over K), so each warpgroup's wgmma (N = 128) yields gate in
columns 0-63 and up in 64-127. An expert's odd last 64-row block is the first half of its last block:
the second warpgroup then only hands the ring's stages back.

h is written unquantized in fp32 (the reference quantizes h from fp32): its per-token scale needs the
whole row of I, which no program holds, so `quantize.quantize_rows` quantizes it between the GEMMs.
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
from moekit.kernels.triton._details.wgmma_fp8_gemm1_tall import HALF, _half_h, _tall_loader
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _channel_math(
    ring,
    row0,
    scales,
    h_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup: rows [ROW0, ROW0 + 64) of the block, act(gate, up) of the program's 64 columns
    stored in fp32 (`scales`: x's per-token scales and row stride, the expert's weight scales, their
    per-row stride (0 per tensor), the first gate and up weight rows of the tile within the expert;
    `h_out`: h, N-tile, h's row stride, the block expert's end row); or only the ring's stages handed
    back if those rows are past the expert's end."""
    h_ptr, pid_n, stride_hm, rows_end = h_out
    if row0 + ROW0 >= rows_end:
        _release_stages(ring, 0, KT, NUM_STAGES)
    else:
        BN: gl.constexpr = 2 * HALF
        layout: gl.constexpr = _mma_layout(BN)
        acc = _summed_kloop(ring, 0, KT, ROW0, BN, NUM_STAGES)
        x_scale_ptr, stride_xsm, w_scale_ptr, stride_wsc, gate_row, up_row = scales
        rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
        row_scale = gl.load(x_scale_ptr + (row0 + ROW0).to(gl.int64) * stride_xsm + rows * stride_xsm)
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        weight_rows = gl.where(cols < HALF, gate_row + cols, up_row + cols - HALF)
        col_scale = gl.load(w_scale_ptr + weight_rows * stride_wsc)
        h = _half_h(acc * row_scale[:, None] * col_scale[None, :], ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
        store_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])  # 16 bytes a thread
        rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, store_layout))
        cols = pid_n * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, store_layout))
        at = h_ptr + (row0 + ROW0).to(gl.int64) * stride_hm + (rows * stride_hm)[:, None] + cols[None, :]
        gl.store(at, gl.convert_layout(h, store_layout))


@gluon.jit
def _fp8_channel_gemm1(
    x_desc,  # fp8 [R, H] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * 2I, H], block [64, 128]
    x_scale_ptr,  # fp32 [R, 1]: per token
    w_scale_ptr,  # fp32 [E_local, 2I] per channel, or [E_local] per tensor (stride_wsc 0)
    h_ptr,  # out fp32 [R, I]
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]: each expert's padded rows start (its end: the next entry)
    num_pid_m,
    stride_xsm,
    stride_wse,
    stride_wsc,
    stride_hm,
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
    """h = act(x @ w13[e]^T) in fp32 of one 128-row block (`paired_blocks`) and 64 columns of h (CONCAT:
    gate rows n, up rows I + n)."""
    gl.static_assert(w_desc.block_type.shape[0] == HALF)
    gl.static_assert(x_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, INTER_SIZE // HALF, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = gl.load(block_start_ptr + pid_m)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    KT: gl.constexpr = HIDDEN // SCALE_GROUP
    a_smem, weight_stages, ready, empty = _ring(x_desc, w_desc, 1, 2, NUM_STAGES, 2)
    ring = (a_smem, weight_stages[0], ready, empty)
    gate_row = pid_n * HALF  # within the expert's 2I rows
    expert_scales = w_scale_ptr + expert.to(gl.int64) * stride_wse
    scales = (x_scale_ptr, stride_xsm, expert_scales, stride_wsc, gate_row, INTER_SIZE + gate_row)
    h_out = (h_ptr, pid_n, stride_hm, rows_end)
    first_row = expert * (2 * INTER_SIZE) + gate_row
    gl.warp_specialize(
        [
            (
                _channel_math,
                (ring, row0, scales, h_out, KT, 0, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, NUM_STAGES),
            ),
            (
                _channel_math,
                (
                    ring,
                    row0,
                    scales,
                    h_out,
                    KT,
                    ROWS_PER_WARPGROUP,
                    ACTIVATION,
                    ALPHA,
                    HAS_LIMIT,
                    LIMIT,
                    NUM_STAGES,
                ),
            ),
            (
                _tall_loader,
                ((x_desc, w_desc), ring, row0, first_row, first_row + INTER_SIZE, KT, 1, NUM_STAGES),
            ),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )
