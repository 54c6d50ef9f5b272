"""GEMM2 of the WGMMA_FP8 engine (Gluon, sm_90): y[pair] = (h @ w2[e]^T) * router weight.

Block-128 scales promote each K-step's product with its scales (`wgmma_fp8._promoted_kloop`); per-token h
scales with per-channel (or per-tensor) weight scales (PER_CHANNEL) sum the steps' products unscaled
(`wgmma_fp8._summed_kloop`) and multiply rows and columns once in the epilogue.

A tile = 128 sorted rows (`align.paired_blocks`) x 128 columns of y, one math warpgroup per 64 rows
sharing the weight stage; the epilogue stores 16-byte runs of each row at its pair's row of y, the
order `reduce._moe_sum_k` reads. An expert's odd last 64-row block is the first half of its last block:
the second warpgroup then computes nothing and only hands the ring's stages back.

Persistent: one program an SM walks the tiles, its producer and ring running on from one tile to the
next, so that a tile's first stages land while the math warpgroups store the one before. GEMM2's K-loop
is short (I / 128 steps: 16 for DeepSeek-V3); on an H200 the one-tile-a-program form spent 12 - 19 %
longer in this kernel, on DeepSeek-V3 and held-out shapes from T = 5 to 16384 (its tile's first loads
waited after every tile's stores). The K-loop and ring are `wgmma_fp8`'s.
"""

from moekit.kernels.triton._details.gemm import _block_first_row, _grouped_pid
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _persistent_loader,
    _promoted_kloop,
    _release_stages,
    _ring,
    _summed_kloop,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _gemm2_tile(
    ring,
    scales,
    row0,
    t0,
    y_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    BN: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    PER_CHANNEL: gl.constexpr,
):
    """One math warpgroup, one tile on the ring's steps t0 on: rows [ROW0, ROW0 + 64) of the block, stored
    at their pairs' rows of y times the router weight (`y_out`: sorted pair ids, router weights, y, the
    pair count, N-tile, y's row stride, the block expert's end row), or nothing if those rows are past
    the expert's end. `scales`: h's scales and row stride, the tile's weight scales and their K-step
    stride (block-128) or column stride (PER_CHANNEL; 0 per tensor)."""
    sorted_pairs_ptr, route_w_ptr, y_ptr, num_pairs, pid_n, stride_ym, rows_end = y_out
    if row0 + ROW0 >= rows_end:
        _release_stages(ring, t0, KT, NUM_STAGES)
    else:
        if PER_CHANNEL:
            acc = _summed_kloop(ring, t0, KT, ROW0, BN, NUM_STAGES)
        else:
            acc = _promoted_kloop(ring, scales, row0, t0, KT, ROW0, BN, NUM_STAGES)
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16 bytes a thread
        sorted_rows = row0 + ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, gl.SliceLayout(1, store_layout))
        pairs = gl.load(sorted_pairs_ptr + sorted_rows)
        live = pairs < num_pairs  # padding rows hold num_pairs
        route_w = gl.load(route_w_ptr + pairs, mask=live, other=0.0)
        out = gl.convert_layout(acc, store_layout)
        if PER_CHANNEL:
            h_scale_ptr, stride_hsm, w_scale_ptr, stride_wsc = scales
            row_scale = gl.load(h_scale_ptr + sorted_rows.to(gl.int64) * stride_hsm)
            col_scale = gl.load(w_scale_ptr + gl.arange(0, BN, gl.SliceLayout(0, store_layout)) * stride_wsc)
            out = out * row_scale[:, None] * col_scale[None, :]
        out = out * route_w[:, None]
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
        gl.store(
            y_ptr + pairs.to(gl.int64)[:, None] * stride_ym + cols[None, :],
            out.to(y_ptr.dtype.element_ty),
            mask=live[:, None],
        )


@gluon.jit
def _persistent_math(
    ring,
    scales_base,
    blocks,
    y_base,
    tiles,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    BN: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    PER_CHANNEL: gl.constexpr,
):
    """One math warpgroup of a persistent program: `_gemm2_tile` of each of the program's tiles in turn,
    the ring's steps counted on across tiles (`tiles`: first tile, stride, count, N-tiles)."""
    block_expert_ptr, block_start_ptr, expert_end_ptr, num_valid = blocks
    h_scale_ptr, stride_hsm, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales_base
    sorted_pairs_ptr, route_w_ptr, y_ptr, num_pairs, stride_ym = y_base
    first, stride, count, num_pid_n = tiles
    t0 = 0
    for tile in range(first, count, stride):
        pid_m, pid_n = _grouped_pid(tile, num_valid, num_pid_n, GROUP_M)
        row0 = _block_first_row(block_start_ptr, pid_m, 2 * ROWS_PER_WARPGROUP)
        expert = gl.load(block_expert_ptr + pid_m)
        rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
        scales = (
            h_scale_ptr,
            stride_hsm,
            w_scale_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn,
            stride_wsk,
        )
        y_out = (sorted_pairs_ptr, route_w_ptr, y_ptr, num_pairs, pid_n, stride_ym, rows_end)
        _gemm2_tile(ring, scales, row0, t0, y_out, KT, ROW0, BN, NUM_STAGES, PER_CHANNEL)
        t0 += KT


@gluon.jit
def _fp8_gemm2(
    h_desc,  # fp8 [R, I] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * H, I], block [128, 128]
    h_scale_ptr,  # fp32 [R, I/128], or [R, 1] (PER_CHANNEL: per token)
    w_scale_ptr,  # fp32 [E_local, H/128, I/128] (any strides), or [E_local, H] / [E_local] (PER_CHANNEL)
    sorted_pairs_ptr,  # int32 [R]: pair id of each sorted row, num_pairs for padding
    route_w_ptr,  # fp32 [T*K]
    y_ptr,  # out [T*K, H] act dtype
    block_expert_ptr,  # int32 [max_blocks]
    block_start_ptr,  # int32 [max_blocks]
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]: each expert's padded rows start (its end: the next entry)
    num_pairs,
    stride_hsm,
    stride_wse,
    stride_wsn,  # from one N-tile's weight scales to the next
    stride_wsk,  # block-128: from one K-step's weight scales to the next; PER_CHANNEL: from one column's
    stride_ym,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
    PER_CHANNEL: gl.constexpr,
):
    """y = (h @ w2[e]^T) * router weight, one program an SM walking the valid tiles (128-row block x 128
    columns of y) with the grid as stride."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(BN == SCALE_GROUP)
    gl.static_assert(h_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    KT: gl.constexpr = INTER_SIZE // SCALE_GROUP
    num_valid = gl.load(num_blocks_ptr)
    num_pid_n: gl.constexpr = HIDDEN // BN
    tiles = (gl.program_id(0), gl.num_programs(0), num_valid * num_pid_n, num_pid_n)
    a_smem, weight_stages, ready, empty = _ring(h_desc, w_desc, 1, 1, NUM_STAGES, 2)
    ring = (a_smem, weight_stages[0], ready, empty)
    blocks = (block_expert_ptr, block_start_ptr, expert_end_ptr, num_valid)
    scales_base = (h_scale_ptr, stride_hsm, w_scale_ptr, stride_wse, stride_wsn, stride_wsk)
    y_base = (sorted_pairs_ptr, route_w_ptr, y_ptr, num_pairs, stride_ym)
    gl.warp_specialize(
        [
            (
                _persistent_math,
                (ring, scales_base, blocks, y_base, tiles, KT, 0, BN, GROUP_M, NUM_STAGES, PER_CHANNEL),
            ),
            (
                _persistent_math,
                (
                    ring,
                    scales_base,
                    blocks,
                    y_base,
                    tiles,
                    KT,
                    ROWS_PER_WARPGROUP,
                    BN,
                    GROUP_M,
                    NUM_STAGES,
                    PER_CHANNEL,
                ),
            ),
            (_persistent_loader, ((h_desc, w_desc), ring, blocks, tiles, HIDDEN, KT, GROUP_M, NUM_STAGES)),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )
