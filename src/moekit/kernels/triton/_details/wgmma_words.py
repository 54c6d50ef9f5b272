"""The WGMMA_WORDS engine's Gluon kernels (sm_90): both GEMMs of the MXFP4 word path with each K-step's
weight decode under the previous step's wgmma.

Why Gluon: Triton 3.6's `tl.dot` runs the word path's decode and its register-A wgmma one after the other
inside a program (docs/performance.md, the Mixtral-like MXFP4 shape); here the decode of step k + 1 is
issued between wgmma k and its wait.

A program: 8 warps, 128 weight rows (two warpgroups of 64, the wgmma's register-A M side: gate and up of
64 columns of h for GEMM1 (rows 2j and 2j + 1 when interleaved, j and I + j when concatenated), 128
columns of y for GEMM2) against BLOCK_M sorted pairs' activation rows (the wgmma's N side, gathered into
a ring of shared-memory stages by cp.async).
K-loop (`_words_kloop`), step k: wgmma of step k on w(k) (async) -> the codes of step k + 1 from words
loaded one step earlier, load those of step k + 2 -> wait for step k + 1's rows, proxy fence, CTA
barrier (every warpgroup has also waited for its wgmma k - 1) -> cp.async of step k + STAGES - 1 into the
stage wgmma k - 1 read -> wait for wgmma k, w(k) among the wait's `deps` -> w(k + 1): the codes times
their scales, one bf16x2 multiply a register, renamed into the A fragment.
Three placements decide what ptxas makes of it (docs/performance.md): the A-defining multiplies after the
previous wait (else C7513 serializes every wgmma), on packed pairs (else PRMTs), and the ring's barrier
between the decode and the wait (else the decode sinks below it).
HALF_WIDE (the host's `runs_half_wide`): a block at most half full (an expert's last; its padding rows
close it) runs the K-loop with a wgmma of BLOCK_M / 2 pairs, the others the full-width one. Two loops in
one kernel raise register pressure at 128 registers: those kernels address the activation rows by int32
offsets, reload the expert id and recompute the M-block after the loop instead of keeping them live.
"""

from __future__ import annotations

from moekit.formats.mxfp4_words import CHUNKS_PER_RUN
from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.mxfp4 import _bf16_halves, _mul_bf16x2, _mxfp4_word_pair
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_RUN = gl.constexpr(CHUNKS_PER_RUN)


@gluon.jit
def _factor(s):
    """E8M0 bytes -> bf16 pairs 2^(s - 1) (uint32): the scale times the 2^126 the bit placement omits."""
    e = s.to(gl.uint32) + 126
    return (e << 7) | (e << 23)


@gluon.jit
def _load_step(
    w_base,
    s_base,
    k,
    rows_left,
    NB_RUNS: gl.constexpr,
    N_ROWS: gl.constexpr,
    HALF_GAP: gl.constexpr,
    L3: gl.constexpr,
):
    """Step k's words [8, 32, 4] (row block, lane, chunk) and the E8M0 bytes of rows g and g + 8 of each
    lane's block for each chunk's group, all in the word layout L3. Row blocks 4 - 7 sit HALF_GAP rows
    further on (CONCAT gate/up halves). Row blocks from `rows_left` on (a ragged last N-tile) read zero
    words: weights of 0."""
    tile_rb = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    if HALF_GAP == 0:
        rb = tile_rb
    else:
        rb = gl.where(tile_rb >= 4, tile_rb + HALF_GAP // 16, tile_rb)
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    ch = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    chunk = 4 * k + ch
    run_offset = (chunk // _RUN) * (32 * _RUN) + chunk % _RUN
    w_ptrs = w_base + rb[:, None, None] * (NB_RUNS * 32 * _RUN) + lane[None, :, None] * _RUN
    row = 16 * rb[:, None, None] + lane[None, :, None] // 4
    s_ptrs = s_base + (chunk // 2)[None, None, :] * N_ROWS + row
    if N_ROWS % 128 == 0:  # every N-tile whole: no masks in the K-loop
        words = gl.load(w_ptrs + run_offset[None, None, :])
        top = gl.load(s_ptrs)
        bottom = gl.load(s_ptrs + 8)
    else:
        block_in = (16 * tile_rb < rows_left)[:, None, None]
        words = gl.load(w_ptrs + run_offset[None, None, :], mask=block_in, other=0)
        top = gl.load(s_ptrs, mask=block_in, other=0)
        bottom = gl.load(s_ptrs + 8, mask=block_in, other=0)
    return words.to(gl.uint32, bitcast=True), _factor(top), _factor(bottom)


@gluon.jit
def _to_fragment(p0, p1, p2, p3, fragment: gl.constexpr):
    """Four [8, 32, 4] tensors of bf16 pairs (uint32) in the word layout -> [128, 64] bf16 in the
    register-A `fragment` layout: a renaming of registers when every input is a finished pair (bf16
    arithmetic on the split halves made LLVM compute each half apart: 37 PRMT a K-step instead of 0)."""
    t = gl.join(
        gl.join(_bf16_halves(p0, gl.bfloat16), _bf16_halves(p1, gl.bfloat16)),
        gl.join(_bf16_halves(p2, gl.bfloat16), _bf16_halves(p3, gl.bfloat16)),
    )
    t = gl.reshape(t, [8, 8, 4, 4, 2, 2, 2])  # rb, g, q, chunk, odd, row half, column half
    t = gl.permute(t, [0, 5, 1, 3, 6, 2, 4])  # rb, row half, g, chunk, column half, q, odd
    return gl.convert_layout(gl.reshape(t, [128, 64]), fragment)


@gluon.jit
def _codes(words):
    """The four bf16 pairs (uint32, value * 2^-126) of each word: the bulk of the decode."""
    return (
        _mxfp4_word_pair(words, 0),
        _mxfp4_word_pair(words, 1),
        _mxfp4_word_pair(words, 2),
        _mxfp4_word_pair(words, 3),
    )


@gluon.jit
def _scaled_fragment(codes, f_top, f_bottom, fragment: gl.constexpr):
    """[128 rows, 64 columns] bf16 in the register-A `fragment` layout: each pair times its row's factor
    (one bf16x2 multiply a register), then a renaming of registers. These multiplies are the only
    instructions that define a wgmma's A registers; placed after the previous wgmma's wait they let
    ptxas keep the wgmma unserialized (C7513 otherwise)."""
    p0, p1, p2, p3 = codes
    return _to_fragment(
        _mul_bf16x2(p0, f_top),
        _mul_bf16x2(p1, f_bottom),
        _mul_bf16x2(p2, f_top),
        _mul_bf16x2(p3, f_bottom),
        fragment,
    )  # rows g, g + 8, g, g + 8


@gluon.jit
def _copy_a(
    a_ptr,
    a_rows,
    row_mask,
    stride_am,
    k,
    KT: gl.constexpr,
    stage,
    XL: gl.constexpr,
    ROW_OFFSETS_32: gl.constexpr,
):
    """cp.async of step k's 64 columns of A's rows `a_rows` into `stage` (nothing past the last step);
    with ROW_OFFSETS_32, `a_rows` are the rows' int32 element offsets."""
    cols = k * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
    mask = row_mask[:, None] & (k < KT) & (cols[None, :] >= 0)
    if ROW_OFFSETS_32:
        ptrs = a_ptr + (a_rows[:, None] + cols[None, :])
    else:
        ptrs = a_ptr + a_rows[:, None] * stride_am + cols[None, :]
    async_copy.async_copy_global_to_shared(stage, ptrs, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _tile(num_pid_m, NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(M-block, 128-row N-tile) of this program: GROUP_M M-blocks walk one N-tile (its weights stay in L2)"""
    pid = gl.program_id(0)
    width = GROUP_M * NUM_PID_N
    first_m = (pid // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@gluon.jit
def _words_kloop(
    a_ptr,
    a_rows,
    a_mask,
    stride_am,
    w_ptr,
    s_ptr,
    expert,
    row0,
    IN_DIM: gl.constexpr,
    N_ROWS: gl.constexpr,
    HALF_GAP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    ROW_OFFSETS_32: gl.constexpr,
):
    """fp32 [128 weight rows, BLOCK_M] = W[expert, rows, :] @ A[a_rows, :]^T, rows = row0 + 0..63 and
    row0 + 64 + HALF_GAP + 0..63 (a multiple of 16), the word path's weights in register A (decoded one
    step ahead, under the previous step's wgmma) and A's gathered rows in a cp.async ring of STAGES
    shared-memory stages (the wgmma's N side)."""
    gl.static_assert(IN_DIM % 64 == 0)
    gl.static_assert(STAGES >= 3)  # the loop waits with STAGES - 3 copy groups left in flight
    gl.static_assert(N_ROWS % 16 == 0)  # whole row blocks of the words; a last N-tile may hold fewer than 8
    gl.static_assert(HALF_GAP % 16 == 0)
    KT: gl.constexpr = IN_DIM // 64
    NB_RUNS: gl.constexpr = (IN_DIM // 16 + _RUN - 1) // _RUN
    G: gl.constexpr = IN_DIM // 32
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [8, 1, 1], [2, 1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_M, 16]
    )
    fragment: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    XL: gl.constexpr = a_rows.type.layout.parent
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)

    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], a_layout)
    if ROW_OFFSETS_32:  # the caller checked that they fit; 64-bit row pointers spill in the half-wide kernels
        a_rows = a_rows.to(gl.int32) * stride_am
    for s in gl.static_range(STAGES - 1):
        _copy_a(a_ptr, a_rows, a_mask, stride_am, s, KT, a_smem.index(s), XL, ROW_OFFSETS_32)
    w_base = w_ptr + (expert * (N_ROWS // 16) + row0 // 16) * (NB_RUNS * 32 * _RUN)
    s_base = s_ptr + expert * (G * N_ROWS) + row0
    rows_left = N_ROWS - row0
    words, f_top, f_bottom = _load_step(w_base, s_base, 0, rows_left, NB_RUNS, N_ROWS, HALF_GAP, L3)
    w = _scaled_fragment(_codes(words), f_top, f_bottom, fragment)
    words, f_top, f_bottom = _load_step(
        w_base, s_base, gl.minimum(1, KT - 1), rows_left, NB_RUNS, N_ROWS, HALF_GAP, L3
    )
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    gl.thread_barrier()

    acc = gl.zeros([128, BLOCK_M], gl.float32, mma)
    for k in range(KT):
        acc = warpgroup_mma(w, a_smem.index(k % STAGES).permute((1, 0)), acc, is_async=True)
        # Step k + 1 (clamped: the last repeats): its codes now, under wgmma k; its scaling after the wait.
        codes, next_top, next_bottom = _codes(words), f_top, f_bottom
        words, f_top, f_bottom = _load_step(
            w_base, s_base, gl.minimum(k + 2, KT - 1), rows_left, NB_RUNS, N_ROWS, HALF_GAP, L3
        )
        async_copy.wait_group(STAGES - 3)  # step k + 1's rows are in
        # Every thread's rows of step k + 1 are in, and every warpgroup has waited for its wgmma k - 1, so
        # that stage takes step k + STAGES - 1. ptxas keeps the decode above this barrier: under wgmma k.
        fence_async_shared()  # this thread's copies, visible to the async proxy (wgmma)
        gl.thread_barrier()
        refill = k + STAGES - 1
        _copy_a(
            a_ptr, a_rows, a_mask, stride_am, refill, KT, a_smem.index(refill % STAGES), XL, ROW_OFFSETS_32
        )
        acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))
        w = _scaled_fragment(codes, next_top, next_bottom, fragment)
    return acc


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
