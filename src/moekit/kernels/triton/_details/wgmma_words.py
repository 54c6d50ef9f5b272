"""The WGMMA_WORDS engine's Gluon kernels (sm_90): both GEMMs of the MXFP4 word path with each K-step's
weight decode under the previous step's wgmma.

Why Gluon: Triton 3.6's `tl.dot` runs the word path's decode and its register-A wgmma one after the other
inside a program (docs/performance.md, the Mixtral-like MXFP4 shape); here the decode of step k + 1 is
issued between wgmma k and its wait.

A program: 8 warps, 128 weight rows (two warpgroups of 64, the wgmma's register-A M side: gate and up of
64 columns of h for GEMM1 (rows 2j and 2j + 1 when interleaved, j and I + j when concatenated), 128
columns of y for GEMM2) against BLOCK_M sorted pairs' activation rows (the wgmma's N side, gathered into
a ring of shared-memory stages by cp.async).
The K-loop is `wgmma_words_kloop._words_kloop`.
HALF_WIDE (the host's `runs_half_wide`): a block at most half full (an expert's last; its padding rows
close it) runs the K-loop with a wgmma of BLOCK_M / 2 pairs, the others the full-width one. Two loops in
one kernel raise register pressure at 128 registers: those kernels address the activation rows by int32
offsets, reload the expert id and recompute the M-block after the loop instead of keeping them live.
"""

from __future__ import annotations

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.wgmma_words_kloop import _words_kloop
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _tile_of(tile, num_pid_m, NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(M-block, 128-row N-tile) of tile index `tile`: GROUP_M M-blocks walk one N-tile (its weights stay in
    L2), the M-blocks of one expert next to each other."""
    width = GROUP_M * NUM_PID_N
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@gluon.jit
def _tile(num_pid_m, NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr):
    """`_tile_of` this program."""
    return _tile_of(gl.program_id(0), num_pid_m, NUM_PID_N, GROUP_M)


@gluon.jit
def _block_pairs(
    sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M: gl.constexpr, PAIRS: gl.constexpr, layout: gl.constexpr
):
    """The first PAIRS pair ids of M-block `pid_m` (int64, along `layout`); which are pairs, not padding."""
    pairs = gl.load(sorted_pairs_ptr + pid_m * BLOCK_M + gl.arange(0, PAIRS, layout=layout)).to(gl.int64)
    return pairs, pairs < num_pairs


@gluon.jit
def _half_holds_all(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M: gl.constexpr):
    """Whether the M-block's pairs fit its first half: an expert's padding rows close its last block, so
    the block is at most half full when the row at BLOCK_M / 2 is padding."""
    return gl.load(sorted_pairs_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs


@gluon.jit
def _gemm1(
    x_ptr,  # bf16 [T, H]
    w_ptr,  # int32 words [E, 2I/16, S, 8, 4, 8]
    s_ptr,  # uint8 scales [E, 2I, H/32], N-major (strides (G*2I, 1, 2I))
    b_ptr,  # bf16 [E, 2I] or None
    sorted_pairs_ptr,  # int32 [max_blocks * BLOCK_M]
    block_expert_ptr,  # int32 [max_blocks]
    num_blocks_ptr,  # int32 [1]
    h_ptr,  # bf16 [T*K, I], pair order
    num_pairs,
    num_pid_m,
    stride_xm,
    stride_hm,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    INTERLEAVED: gl.constexpr,  # gate/up rows 2j / 2j + 1; else CONCAT: rows j / I + j
    TOP_K: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    HALF_WIDE: gl.constexpr,  # blocks at most half full run a wgmma half as wide (int32 row offsets)
):
    """h[p, 64 pid_n + n] = act(x[p // K] @ w13[e]^T + b13[e]) for the pairs of one M-block: 128 w13 rows,
    the gate and up rows of those 64 columns of h."""
    pid_m, pid_n = _tile(num_pid_m, 2 * INTER_SIZE // 128, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    args = (x_ptr, w_ptr, s_ptr, b_ptr, sorted_pairs_ptr, block_expert_ptr, h_ptr, num_pairs, stride_xm)
    args += (stride_hm, pid_m, pid_n)  # constexprs stay out of tuples: they would lose constexpr-ness
    if not HALF_WIDE:
        _gemm1_tile(
            *args, HIDDEN, INTER_SIZE, INTERLEAVED, TOP_K, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, BLOCK_M,
            BLOCK_M, STAGES, False,
        )  # fmt: skip
    elif _half_holds_all(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M):
        _gemm1_tile(
            *args, HIDDEN, INTER_SIZE, INTERLEAVED, TOP_K, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, BLOCK_M,
            BLOCK_M // 2, STAGES, True,
        )  # fmt: skip
    else:
        _gemm1_tile(
            *args, HIDDEN, INTER_SIZE, INTERLEAVED, TOP_K, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, BLOCK_M,
            BLOCK_M, STAGES, True,
        )  # fmt: skip


@gluon.jit
def _gemm1_tile(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    h_ptr,
    num_pairs,
    stride_xm,
    stride_hm,
    pid_m,
    pid_n,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    TOP_K: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    PAIRS: gl.constexpr,  # the block's first PAIRS rows (the wgmma's N)
    STAGES: gl.constexpr,
    ROW_OFFSETS_32: gl.constexpr,
):
    """`_gemm1` on the first PAIRS rows of M-block `pid_m`."""
    N_ROWS: gl.constexpr = 2 * INTER_SIZE
    gl.static_assert(INTER_SIZE % 64 == 0)  # whole tiles of gate and up rows
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    pairs_x, mask_x = _block_pairs(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M, PAIRS, gl.SliceLayout(1, XL))
    tokens = gl.where(mask_x, pairs_x // TOP_K, 0)
    if INTERLEAVED:
        row0 = pid_n * 128
        HALF_GAP: gl.constexpr = 0
    else:
        row0 = pid_n * 64
        HALF_GAP: gl.constexpr = INTER_SIZE - 64
    acc = _words_kloop(
        x_ptr,
        tokens,
        mask_x,
        stride_xm,
        w_ptr,
        s_ptr,
        expert,
        row0,
        HIDDEN,
        N_ROWS,
        HALF_GAP,
        PAIRS,
        STAGES,
        ROW_OFFSETS_32,
    )
    # A column's gate and up rows (tile rows 2n and 2n + 1, or n and 64 + n) side by side in one thread.
    if INTERLEAVED:
        EL: gl.constexpr = gl.BlockedLayout([2, 4], [4, 8], [8, 1], [0, 1])
    else:
        EL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [0, 1])  # rows n, 32 + n, 64 + n, 96 + n
    acc = gl.convert_layout(acc, EL)
    if b_ptr is not None:
        if ROW_OFFSETS_32:  # the half-wide kernels reload it: live across their loops, it spills
            expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, EL))
        b_rows = row0 + gl.where(r >= 64, r + HALF_GAP, r)
        acc = acc + gl.load(b_ptr + expert * N_ROWS + b_rows).to(gl.float32)[:, None]
    if INTERLEAVED:
        gate, up = gl.split(gl.permute(gl.reshape(acc, [64, 2, PAIRS]), [0, 2, 1]))
    else:
        gate, up = gl.split(gl.permute(gl.reshape(acc, [2, 64, PAIRS]), [1, 2, 0]))
    h = _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT).to(gl.bfloat16)
    SL: gl.constexpr = gl.BlockedLayout([8, 1], [2, 16], [1, 8] if PAIRS >= 128 else [2, 4], [0, 1])
    h = gl.convert_layout(h, SL)
    cols = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, SL))
    pairs, mask = _block_pairs(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M, PAIRS, gl.SliceLayout(0, SL))
    gl.store(h_ptr + pairs[None, :] * stride_hm + cols[:, None], h, mask=mask[None, :])


@gluon.jit
def _gemm2(
    h_ptr,  # bf16 [T*K, I], pair order
    w_ptr,  # int32 words [E, H/16, S, 8, 4, 8]
    s_ptr,  # uint8 scales [E, H, I/32], N-major
    b_ptr,  # bf16 [E, H] or None
    route_w_ptr,  # fp32 [T*K]
    sorted_pairs_ptr,  # int32 [max_blocks * BLOCK_M]
    block_expert_ptr,  # int32 [max_blocks]
    num_blocks_ptr,  # int32 [1]
    y_ptr,  # bf16 [T*K, H], pair order (the top-k sum follows)
    num_pairs,
    num_pid_m,
    stride_hm,
    stride_ym,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    HALF_WIDE: gl.constexpr,  # as `_gemm1`'s
):
    """y[p, 128 pid_n + n] = (h[p] @ w2[e]^T + b2[e]) * router weight[p] for the pairs of one M-block."""
    pid_m, pid_n = _tile(num_pid_m, (HIDDEN + 127) // 128, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    args = (h_ptr, w_ptr, s_ptr, b_ptr, route_w_ptr, sorted_pairs_ptr, block_expert_ptr, y_ptr, num_pairs)
    args += (stride_hm, stride_ym, pid_m, pid_n)  # constexprs stay out: they would lose constexpr-ness
    if not HALF_WIDE:
        _gemm2_tile(*args, HIDDEN, INTER_SIZE, BLOCK_M, BLOCK_M, STAGES, GROUP_M, False)
    elif _half_holds_all(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M):
        _gemm2_tile(*args, HIDDEN, INTER_SIZE, BLOCK_M, BLOCK_M // 2, STAGES, GROUP_M, True)
    else:
        _gemm2_tile(*args, HIDDEN, INTER_SIZE, BLOCK_M, BLOCK_M, STAGES, GROUP_M, True)


@gluon.jit
def _gemm2_tile(
    h_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    route_w_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    y_ptr,
    num_pairs,
    stride_hm,
    stride_ym,
    pid_m,
    pid_n,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    PAIRS: gl.constexpr,  # the block's first PAIRS rows (the wgmma's N)
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    ROW_OFFSETS_32: gl.constexpr,
):
    """`_gemm2` on the first PAIRS rows of M-block `pid_m`."""
    NUM_PID_N: gl.constexpr = (HIDDEN + 127) // 128
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    pairs_a, mask_a = _block_pairs(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M, PAIRS, gl.SliceLayout(1, XL))
    rows_a = gl.where(mask_a, pairs_a, 0)
    acc = _words_kloop(
        h_ptr,
        rows_a,
        mask_a,
        stride_hm,
        w_ptr,
        s_ptr,
        expert,
        pid_n * 128,
        INTER_SIZE,
        HIDDEN,
        0,
        PAIRS,
        STAGES,
        ROW_OFFSETS_32,
    )
    SL: gl.constexpr = gl.BlockedLayout([8, 1], [2, 16], [1, 8] if PAIRS >= 128 else [2, 4], [0, 1])
    acc = gl.convert_layout(acc, SL)
    cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, SL))
    col_in = cols < HIDDEN
    if b_ptr is not None:  # b2 per expert before the router weight, as GPT-OSS adds it
        if ROW_OFFSETS_32:  # the half-wide kernels reload it: live across their loops, it spills
            expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
        acc = acc + gl.load(b_ptr + expert * HIDDEN + cols, mask=col_in, other=0.0).to(gl.float32)[:, None]
    if ROW_OFFSETS_32:
        # The half-wide kernels take the M-block again from the grid (num_pid_m x N-tiles programs): kept
        # live across their loops it spills (the expression before the loop would be merged with this one).
        pid_m = _tile(gl.num_programs(0) // NUM_PID_N, NUM_PID_N, GROUP_M)[0]
    pairs, mask = _block_pairs(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M, PAIRS, gl.SliceLayout(0, SL))
    acc = acc * gl.load(route_w_ptr + pairs, mask=mask, other=0.0)[None, :]
    y = acc.to(gl.bfloat16)
    gl.store(y_ptr + pairs[None, :] * stride_ym + cols[:, None], y, mask=mask[None, :] & col_in[:, None])
