"""The WGMMA_WORDS engine's K-loop (sm_90, Gluon): fp32 [128 weight rows, pairs] of one expert's weights
against gathered activation rows, each K-step's MXFP4 decode issued under the previous step's wgmma. The
GEMMs around it are in `wgmma_words.py`; the decode engine (`words_decode.py`) shares its decode pieces.

K-loop (`_words_kloop`), step k: wgmma of step k on w(k) (async) -> the codes of step k + 1 from words
loaded one step earlier, load those of step k + 2 -> wait for step k + 1's rows, proxy fence, CTA
barrier (every warpgroup has also waited for its wgmma k - 1) -> cp.async of step k + STAGES - 1 into the
stage wgmma k - 1 read -> wait for wgmma k, w(k) among the wait's `deps` -> w(k + 1): the codes times
their scales, one bf16x2 multiply a register, renamed into the A fragment.
Three placements decide what ptxas makes of it (docs/performance.md): the A-defining multiplies after the
previous wait (else C7513 serializes every wgmma), on packed pairs (else PRMTs), and the ring's barrier
between the decode and the wait (else the decode sinks below it).
"""

from __future__ import annotations

from moekit.formats.mxfp4_words import CHUNKS_PER_RUN
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
    block_in = (16 * tile_rb < rows_left)[:, None, None]
    # Every N-tile whole: no masks in the K-loop.
    return _words_and_factors(w_ptrs + run_offset[None, None, :], s_ptrs, block_in, N_ROWS % 128 == 0)


@gluon.jit
def _words_and_factors(w_ptrs, s_ptrs, block_in, WHOLE: gl.constexpr):
    """Words (uint32) at `w_ptrs` and the fp32 factors of the E8M0 bytes at `s_ptrs` (rows g) and
    `s_ptrs` + 8 (rows g + 8); unless WHOLE, only where `block_in` (zero words elsewhere: weights of 0).
    Shared by both word engines' step loads."""
    if WHOLE:
        words = gl.load(w_ptrs)
        top = gl.load(s_ptrs)
        bottom = gl.load(s_ptrs + 8)
    else:
        words = gl.load(w_ptrs, mask=block_in, other=0)
        top = gl.load(s_ptrs, mask=block_in, other=0)
        bottom = gl.load(s_ptrs + 8, mask=block_in, other=0)
    return words.to(gl.uint32, bitcast=True), _factor(top), _factor(bottom)


@gluon.jit
def _to_fragment(p0, p1, p2, p3, fragment: gl.constexpr):
    """Four [RB, 32, C] tensors of bf16 pairs (uint32) in the word layout (RB 16-row blocks, C 16-column
    chunks) -> [16 RB, 16 C] bf16 in the register-A `fragment` layout: a renaming of registers when every
    input is a finished pair (bf16 arithmetic on the split halves made LLVM compute each half apart: 37
    PRMT a K-step instead of 0)."""
    RB: gl.constexpr = p0.shape[0]
    C: gl.constexpr = p0.shape[2]
    t = gl.join(
        gl.join(_bf16_halves(p0, gl.bfloat16), _bf16_halves(p1, gl.bfloat16)),
        gl.join(_bf16_halves(p2, gl.bfloat16), _bf16_halves(p3, gl.bfloat16)),
    )
    t = gl.reshape(t, [RB, 8, 4, C, 2, 2, 2])  # rb, g, q, chunk, odd, row half, column half
    t = gl.permute(t, [0, 5, 1, 3, 6, 2, 4])  # rb, row half, g, chunk, column half, q, odd
    return gl.convert_layout(gl.reshape(t, [16 * RB, 16 * C]), fragment)


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
    """[16 RB rows, 16 C columns] bf16 ([128, 64] in this engine) in the register-A `fragment` layout (of a
    wgmma or an mma.sync): each pair times its row's factor (one bf16x2 multiply a register), then a
    renaming of registers. These multiplies are the only
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
