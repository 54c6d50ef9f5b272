"""GEMM2 of the WGMMA_BF16 engine (Gluon, sm_90): y[pair] = (h @ w2[e]^T + b2[e]) * router weight, for
16-bit float weights and activations.

h comes from the tl.dot GEMM1 in the alignment's sorted rows (each expert's pairs padded to whole
blocks), so TMA reads it whole, as it reads w2. A tile = 128 sorted rows x BN (128 or 256) columns of y,
one math warpgroup per 64 rows sharing the weight stage; the epilogue stores 16-byte runs of each row
at its pair's row of y, the order `reduce._moe_sum_k` reads. Over `align.paired_blocks` an expert's odd
last 64-row block is the first half of a block: the second warpgroup then only hands the ring back.

Persistent (one program an SM walking the tiles, the producer's ring running on across tiles), as the
FP8 engine's GEMM2: GEMM2's K-loop is short (I / 64 steps: 12 for Qwen3-30B), so a one-tile program's
first loads and last stores are a large share of its time. Unlike FP8 there is no per-step promotion:
the wgmma chain accumulates in place and one group stays in flight while the next stage is waited for.
The ring and producer are `wgmma_fp8`'s.
"""

from moekit.kernels.triton._details.gemm import _block_first_row, _grouped_pid
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    _persistent_loader,
    _release_stages,
    _ring,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait


@gluon.constexpr_function
def _mma_layout_16bit(BN):
    """One warpgroup's wgmma accumulator layout for 16-bit operands (K 16 an instruction), 64 x BN."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])


# 16 bytes a thread along a row for the epilogues' stores: the accumulator layout would store 4 at a time.
STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))


@gluon.jit
def _tile_rows(sorted_pairs_ptr, first_row, rows_end, num_pairs, pid_n, BN: gl.constexpr):
    """A math warpgroup's 64 sorted rows from `first_row`, N-tile `pid_n`'s BN columns, the rows' pairs and
    which rows are live (a pair, not padding, and inside the block's expert), laid out as STORE_LAYOUT."""
    rows = first_row + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, STORE_LAYOUT))
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, STORE_LAYOUT))
    pairs = gl.load(sorted_pairs_ptr + rows)
    live = (pairs < num_pairs) & (rows < rows_end)  # padding rows hold num_pairs
    return rows, cols, pairs, live


@gluon.jit
def _accumulating_kloop(ring, T0, KT: gl.constexpr, A_ROW0: gl.constexpr, NUM_STAGES: gl.constexpr):
    """sum over K-steps k of A_k @ B_k^T in fp32 for this warpgroup's 64 rows (from A_ROW0 of the A stage),
    K-step k being the ring's step T0 + k. A stage is handed back once the wgmma reading it has retired:
    the wait for one group in flight retires step k - 1 while step k runs."""
    a_smem, b_smem, ready, empty = ring
    BN: gl.constexpr = b_smem.shape[1]
    acc = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, _mma_layout_16bit(BN))
    for k in range(KT):
        t = T0 + k
        s = t % NUM_STAGES
        mbarrier.wait(ready.index(s), (t // NUM_STAGES) & 1)
        a_tile = a_smem.index(s).slice(A_ROW0, ROWS_PER_WARPGROUP, dim=0)
        acc = warpgroup_mma(a_tile, b_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if k > 0:
            mbarrier.arrive(empty.index((t - 1) % NUM_STAGES), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((T0 + KT - 1) % NUM_STAGES), count=1)
    return acc


@gluon.jit
def _tile(
    ring,
    row0,
    t0,
    y_base,
    where,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_ON_OUTPUT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup, one tile on the ring's steps t0 on: rows [ROW0, ROW0 + 64) of the block, stored
    at their pairs' rows of y (`y_base`: sorted pair ids, router weights, b2 and its expert stride, y,
    the pair count, H, y's row stride; `where`: the block's expert, its end row, the N-tile), or nothing
    if those rows are past the expert's end."""
    sorted_pairs_ptr, route_w_ptr, b_ptr, stride_be, y_ptr, num_pairs, hidden, stride_ym = y_base
    expert, rows_end, pid_n = where
    BN: gl.constexpr = ring[1].shape[1]
    if row0 + ROW0 >= rows_end:
        _release_stages(ring, t0, KT, NUM_STAGES)
    else:
        acc = _accumulating_kloop(ring, t0, KT, ROW0, NUM_STAGES)
        rows, cols, pairs, live = _tile_rows(sorted_pairs_ptr, row0 + ROW0, rows_end, num_pairs, pid_n, BN)
        out = gl.convert_layout(acc, STORE_LAYOUT)
        if HAS_BIAS:  # b2 is added per expert before the router weight, as the reference does
            bias = gl.load(b_ptr + expert.to(gl.int64) * stride_be + cols, mask=cols < hidden, other=0.0)
            out = out + bias.to(gl.float32)[None, :]
        if ROUTE_ON_OUTPUT:
            out = out * gl.load(route_w_ptr + pairs, mask=live, other=0.0)[:, None]
        gl.store(
            y_ptr + pairs.to(gl.int64)[:, None] * stride_ym + cols[None, :],
            out.to(y_ptr.dtype.element_ty),
            mask=live[:, None] & (cols < hidden)[None, :],
        )


@gluon.jit
def _persistent_math(
    ring,
    blocks,
    y_base,
    tiles,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    GROUP_M: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_ON_OUTPUT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup of a persistent program: `_tile` of each of the program's tiles in turn, the
    ring's steps counted on across tiles (`tiles`: first tile, stride, count, N-tiles)."""
    block_expert_ptr, block_start_ptr, expert_end_ptr, num_valid = blocks
    first, stride, count, num_pid_n = tiles
    BLOCK_M: gl.constexpr = ring[0].shape[1]
    t0 = 0
    for tile in range(first, count, stride):
        pid_m, pid_n = _grouped_pid(tile, num_valid, num_pid_n, GROUP_M)
        row0 = _block_first_row(block_start_ptr, pid_m, BLOCK_M)
        expert = gl.load(block_expert_ptr + pid_m)
        rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
        _tile(
            ring, row0, t0, y_base, (expert, rows_end, pid_n), KT, ROW0, HAS_BIAS, ROUTE_ON_OUTPUT, NUM_STAGES
        )
        t0 += KT


@gluon.jit
def _bf16_gemm2(
    h_desc,  # [R, I] sorted rows, block [128, 64]
    w_desc,  # [E_local * H, I], block [BN, 64]
    b_ptr,  # [E_local, H] or None
    sorted_pairs_ptr,  # int32 [R]: pair id of each sorted row, num_pairs for padding
    route_w_ptr,  # fp32 [T*K] or None (INPUT placement: GEMM1 applied it)
    y_ptr,  # out [T*K, H] act dtype
    block_expert_ptr,  # int32 [max_blocks]
    block_start_ptr,  # int32 [max_blocks], or None: block b starts at row 128 b
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]: each expert's padded rows start (its end: the next entry)
    num_pairs,
    stride_be,
    stride_ym,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_ON_OUTPUT: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """y = (h @ w2[e]^T + b2[e]) * router weight, one program an SM walking the valid tiles (128-row block
    x BN columns of y) with the grid as stride."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    gl.static_assert(h_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    KT: gl.constexpr = (INTER_SIZE + BK - 1) // BK  # TMA fills a partial last K-step with zeros
    num_valid = gl.load(num_blocks_ptr)
    num_pid_n: gl.constexpr = (HIDDEN + BN - 1) // BN
    tiles = (gl.program_id(0), gl.num_programs(0), num_valid * num_pid_n, num_pid_n)
    a_smem, weight_stages, ready, empty = _ring(h_desc, w_desc, 1, 1, NUM_STAGES, 2)
    ring = (a_smem, weight_stages[0], ready, empty)
    blocks = (block_expert_ptr, block_start_ptr, expert_end_ptr, num_valid)
    y_base = (sorted_pairs_ptr, route_w_ptr, b_ptr, stride_be, y_ptr, num_pairs, HIDDEN, stride_ym)
    gl.warp_specialize(
        [
            (
                _persistent_math,
                (ring, blocks, y_base, tiles, KT, 0, GROUP_M, HAS_BIAS, ROUTE_ON_OUTPUT, NUM_STAGES),
            ),
            (
                _persistent_math,
                (
                    ring,
                    blocks,
                    y_base,
                    tiles,
                    KT,
                    ROWS_PER_WARPGROUP,
                    GROUP_M,
                    HAS_BIAS,
                    ROUTE_ON_OUTPUT,
                    NUM_STAGES,
                ),
            ),
            (_persistent_loader, ((h_desc, w_desc), ring, blocks, tiles, HIDDEN, KT, GROUP_M, NUM_STAGES)),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )
