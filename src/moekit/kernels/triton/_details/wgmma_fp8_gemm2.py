"""GEMM2 of the WGMMA_FP8 engine (Gluon, sm_90): y[pair] = (h @ w2[e]^T) * router weight.

One program = 128 sorted rows (`align.paired_blocks`) x 128 columns of y, one math warpgroup per 64
rows sharing the weight stage; the epilogue stores 16-byte runs of each row at its pair's row of y,
the order `reduce._moe_sum_k` reads. An expert's odd last 64-row block is the first half of its last
block: the second warpgroup then computes nothing and only hands the ring's stages back. The K-loop,
ring and producer are `wgmma_fp8`'s.
"""

from moekit.kernels.triton._details.gemm import _grouped_pid
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _loader,
    _promoted_kloop,
    _release_stages,
    _ring,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _gemm2_math(
    ring,
    scales,
    row0,
    y_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    BN: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup: rows [ROW0, ROW0 + 64) of the block, stored at their pairs' rows of y times the
    router weight (`y_out`: sorted pair ids, router weights, y, the pair count, N-tile, y's row stride,
    the block expert's end row), or nothing if those rows are past the expert's end."""
    sorted_pairs_ptr, route_w_ptr, y_ptr, num_pairs, pid_n, stride_ym, rows_end = y_out
    if row0 + ROW0 >= rows_end:
        _release_stages(ring, KT, NUM_STAGES)
    else:
        acc = _promoted_kloop(ring, scales, row0, KT, ROW0, BN, NUM_STAGES)
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16 bytes a thread
        pairs = gl.load(
            sorted_pairs_ptr + row0 + ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, gl.SliceLayout(1, store_layout))
        )
        live = pairs < num_pairs  # padding rows hold num_pairs
        route_w = gl.load(route_w_ptr + pairs, mask=live, other=0.0)
        out = gl.convert_layout(acc, store_layout) * route_w[:, None]
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
        gl.store(
            y_ptr + pairs.to(gl.int64)[:, None] * stride_ym + cols[None, :],
            out.to(y_ptr.dtype.element_ty),
            mask=live[:, None],
        )


@gluon.jit
def _fp8_gemm2(
    h_desc,  # fp8 [R, I] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * H, I], block [128, 128]
    h_scale_ptr,  # fp32 [R, I/128]
    w_scale_ptr,  # fp32 [E_local, H/128, I/128] (any strides)
    sorted_pairs_ptr,  # int32 [R]: pair id of each sorted row, num_pairs for padding
    route_w_ptr,  # fp32 [T*K]
    y_ptr,  # out [T*K, H] act dtype
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]: each expert's padded rows start (its end: the next entry)
    num_pid_m,
    num_pairs,
    stride_hsm,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_ym,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """y = (h @ w2[e]^T) * router weight of one 128-row M-block and one 128-column N-tile."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(BN == SCALE_GROUP)
    gl.static_assert(h_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, HIDDEN // BN, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = gl.load(block_start_ptr + pid_m)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    KT: gl.constexpr = INTER_SIZE // SCALE_GROUP
    a_smem, weight_stages, ready, empty = _ring(h_desc, w_desc, 1, NUM_STAGES, 2)
    ring = (a_smem, weight_stages[0], ready, empty)
    scales = (
        h_scale_ptr,
        stride_hsm,
        w_scale_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn,
        stride_wsk,
    )
    y_out = (sorted_pairs_ptr, route_w_ptr, y_ptr, num_pairs, pid_n, stride_ym, rows_end)
    w_rows = (expert * HIDDEN + pid_n * BN,)
    gl.warp_specialize(
        [
            (_gemm2_math, (ring, scales, row0, y_out, KT, 0, BN, NUM_STAGES)),
            (_gemm2_math, (ring, scales, row0, y_out, KT, ROWS_PER_WARPGROUP, BN, NUM_STAGES)),
            (
                _loader,
                ((h_desc, w_desc), a_smem, weight_stages, ready, empty, row0, w_rows, KT, NUM_STAGES),
            ),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )
