"""The MMA_WORDS_DECODE engine's Gluon GEMM (sm_90): either GEMM of the MXFP4 word path at decode sizes,
raw fp32 split-K shares out (the finish kernels of `reduce.py` apply bias, activation, router weight).

Why a kernel of its own: at a few tokens an expert the layer's time is the hit experts' weight stream.
The tl.dot word path keeps about one K-step of it in flight a program (it waits for its stage, decodes,
waits for the MMA, only then issues the next copy), and its CTA-wide waits stall every warp on the
slowest. Here each warp runs its own 16 weight rows with mma.sync: no barrier in the K-loop, and each
thread keeps the weight words and scale bytes of the next DEPTH K-steps in flight in registers.

A program: 4 warps, 64 weight rows (16 a warp: the MMA's M side, decoded straight into its A registers)
against one M-block's pairs (the MMA's N side: N_TILE = 8 for one pair a block, else BLOCK_M), one share
of the K-steps of 128 columns (one stored run of the words: 32 contiguous bytes a thread). The share's
activation rows are copied into shared memory once, before the loop (the host bounds their size,
`words_decode.share_reason`). The queue holds DEPTH fixed register slots that the unrolled loop refills in
turn: a rotating queue would copy the registers of loads still in flight, and each copy waits for its load.
Grid: (M-blocks x 64-row N-tiles, SPLIT_K).
"""

from __future__ import annotations

from moekit.formats.mxfp4_words import CHUNKS_PER_RUN, COLS_PER_CHUNK, ROWS_PER_BLOCK
from moekit.kernels.triton._details.wgmma_words_kloop import _codes, _scaled_fragment, _words_and_factors
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

_RUN = gl.constexpr(CHUNKS_PER_RUN)
ROWS: gl.constexpr = gl.constexpr(4 * ROWS_PER_BLOCK)  # weight rows a program: 4 warps (the layouts below)
STEP: gl.constexpr = gl.constexpr(CHUNKS_PER_RUN * COLS_PER_CHUNK)  # K a step: one run, four scale groups


@gluon.jit
def _load_step(w_base, s_base, k, rows_left, IN_DIM: gl.constexpr, N_ROWS: gl.constexpr, L3: gl.constexpr):
    """Step k's words [4, 32, 8] (row block, lane, chunk) and the bf16-pair factors of rows g and g + 8 of
    each lane's block for each chunk's scale group, in the word layout L3. Row blocks from `rows_left` on
    read zero words."""
    G: gl.constexpr = IN_DIM // 32
    NB_RUNS: gl.constexpr = (IN_DIM // 16 + _RUN - 1) // _RUN
    rb = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    ch = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w_ptrs = w_base + rb[:, None, None] * (NB_RUNS * 32 * _RUN) + k * (32 * _RUN) + lane[None, :, None] * _RUN
    # Groups past IN_DIM (the last step's, when 128 does not divide it) read the last group's scale: their
    # words are the run's zero padding, so any finite factor gives 0 (a mask costs a PRMT a load).
    group = gl.minimum(4 * k + ch // 2, G - 1)
    row = 16 * rb[:, None, None] + lane[None, :, None] // 4
    s_ptrs = s_base + group[None, None, :] * N_ROWS + row
    block_in = (16 * rb < rows_left)[:, None, None]
    return _words_and_factors(w_ptrs + ch[None, None, :], s_ptrs, block_in, N_ROWS % ROWS == 0)


@gluon.jit
def _copy_a(a_ptr, a_rows, row_mask, stride_am, k, k_end, stage, IN_DIM: gl.constexpr, XL: gl.constexpr):
    """cp.async of step k's 128 columns of A's rows `a_rows` into `stage` (zeros from step k_end on and past
    IN_DIM)."""
    cols = k * STEP + gl.arange(0, STEP, layout=gl.SliceLayout(0, XL))
    mask = row_mask[:, None] & (k < k_end) & (cols < IN_DIM)[None, :]
    async_copy.async_copy_global_to_shared(
        stage, a_ptr + a_rows[:, None] * stride_am + cols[None, :], mask=mask
    )


@gluon.jit
def _x_step(x_smem, i, b_operand: gl.constexpr):
    """Step i's activation rows [128, N_TILE] as the MMA's B operand (ldmatrix)."""
    return x_smem.index(i).permute((1, 0)).load(b_operand)


@gluon.jit
def _decode_gemm(
    a_ptr,  # bf16 [rows, IN_DIM]: x [T, H] (GEMM1, row = pair // A_ROW_DIV) or h [T*K, I] (GEMM2)
    w_ptr,  # int32 words [E_local, N_ROWS/16, S, 8, 4, 8]
    s_ptr,  # uint8 scales [E_local, N_ROWS, IN_DIM/32], N-major (strides (G*N_ROWS, 1, N_ROWS))
    sorted_pairs_ptr,  # int32 [num_pid_m * BLOCK_M], or None: block b is pair b alone
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]: first sorted row of each M-block, or None (pid_m * BLOCK_M)
    num_blocks_ptr,  # int32 [1], or None: every block of the grid holds pairs
    part_ptr,  # fp32 [SPLIT_K, T*K, N_ROWS]: raw sums of each share of IN_DIM
    num_pairs,
    num_local_experts,  # an unaligned id outside [0, it) reads expert 0; the finish kernels drop its pair
    stride_am,
    stride_part_split,
    stride_part_m,
    IN_DIM: gl.constexpr,
    N_ROWS: gl.constexpr,
    A_ROW_DIV: gl.constexpr,  # TOP_K for GEMM1 (x's row of a pair is its token), 1 for GEMM2
    BLOCK_M: gl.constexpr,  # rows of an M-block in sorted_pairs_ptr
    N_TILE: gl.constexpr,  # the MMA's N: BLOCK_M, or 8 for one pair a block
    SPLIT_K: gl.constexpr,
    DEPTH: gl.constexpr,  # K-steps of weights in flight a thread: 3 or 4
):
    """part[s, p, 64 pid_n + r] = sum over share s's columns of W[e, 64 pid_n + r, :] . A[row of p, :] for
    the pairs p of one M-block (expert e)."""
    gl.static_assert(IN_DIM % 32 == 0)  # whole scale groups; the words pad the last run
    gl.static_assert(N_ROWS % 16 == 0)  # whole row blocks of the words
    gl.static_assert(DEPTH >= 3 and DEPTH <= 4)
    NUM_PID_N: gl.constexpr = (N_ROWS + ROWS - 1) // ROWS
    KT: gl.constexpr = (IN_DIM + STEP - 1) // STEP
    SHARE: gl.constexpr = (KT + SPLIT_K - 1) // SPLIT_K
    G: gl.constexpr = IN_DIM // 32
    NB_RUNS: gl.constexpr = (IN_DIM // 16 + _RUN - 1) // _RUN
    pid = gl.program_id(0)
    pid_m = pid // NUM_PID_N
    pid_n = pid % NUM_PID_N
    if num_blocks_ptr is not None:
        if pid_m >= gl.load(num_blocks_ptr):
            return
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    fragment: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])

    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    m = gl.arange(0, N_TILE, layout=gl.SliceLayout(1, XL))
    if sorted_pairs_ptr is None:
        pairs = gl.where(m == 0, pid_m, num_pairs).to(gl.int64)
        expert = gl.where((expert >= 0) & (expert < num_local_experts), expert, 0)
    else:
        if block_start_ptr is None:
            first = pid_m * BLOCK_M
        else:
            first = gl.load(block_start_ptr + pid_m)
        pairs = gl.load(sorted_pairs_ptr + first + m).to(gl.int64)
    row_mask = pairs < num_pairs
    a_rows = gl.where(row_mask, pairs // A_ROW_DIV, 0)

    k_begin = gl.program_id(1) * SHARE
    k_end = gl.minimum(k_begin + SHARE, KT)
    last = gl.maximum(k_end - 1, 0)
    row0 = pid_n * ROWS
    rows_left = N_ROWS - row0
    w_base = w_ptr + (expert * (N_ROWS // 16) + row0 // 16) * (NB_RUNS * 32 * _RUN)
    s_base = s_ptr + expert * (G * N_ROWS) + row0

    # The share's activation rows, all in shared memory before the loop (padded with zero steps to whole
    # rounds of DEPTH): the loop then has no barrier, each warp runs its 16 weight rows on its own.
    ROUNDS: gl.constexpr = (SHARE + DEPTH - 1) // DEPTH
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [ROUNDS * DEPTH, N_TILE, STEP], x_layout)
    for s in gl.static_range(ROUNDS * DEPTH):
        _copy_a(a_ptr, a_rows, row_mask, stride_am, k_begin + s, k_end, x_smem.index(s), IN_DIM, XL)
    async_copy.commit_group()
    # DEPTH steps of weights in flight a thread, each in a fixed slot of registers that the round's steps
    # refill in turn: a rotating queue would copy registers that pending loads still write, and every such
    # move waits for its load. Steps past the share's end repeat its last step on zero activation rows.
    w0, t0, b0 = _load_step(w_base, s_base, gl.minimum(k_begin, last), rows_left, IN_DIM, N_ROWS, L3)
    w1, t1, b1 = _load_step(w_base, s_base, gl.minimum(k_begin + 1, last), rows_left, IN_DIM, N_ROWS, L3)
    w2, t2, b2 = _load_step(w_base, s_base, gl.minimum(k_begin + 2, last), rows_left, IN_DIM, N_ROWS, L3)
    if DEPTH == 4:
        w3, t3, b3 = _load_step(w_base, s_base, gl.minimum(k_begin + 3, last), rows_left, IN_DIM, N_ROWS, L3)
    async_copy.wait_group(0)
    gl.thread_barrier()

    acc = gl.zeros([ROWS, N_TILE], gl.float32, mma)
    n = k_end - k_begin
    for i in range(0, n, DEPTH):
        acc = mma_v2(_scaled_fragment(_codes(w0), t0, b0, fragment), _x_step(x_smem, i, b_operand), acc)
        k = gl.minimum(k_begin + i + DEPTH, last)
        w0, t0, b0 = _load_step(w_base, s_base, k, rows_left, IN_DIM, N_ROWS, L3)
        acc = mma_v2(_scaled_fragment(_codes(w1), t1, b1, fragment), _x_step(x_smem, i + 1, b_operand), acc)
        k = gl.minimum(k_begin + i + 1 + DEPTH, last)
        w1, t1, b1 = _load_step(w_base, s_base, k, rows_left, IN_DIM, N_ROWS, L3)
        acc = mma_v2(_scaled_fragment(_codes(w2), t2, b2, fragment), _x_step(x_smem, i + 2, b_operand), acc)
        k = gl.minimum(k_begin + i + 2 + DEPTH, last)
        w2, t2, b2 = _load_step(w_base, s_base, k, rows_left, IN_DIM, N_ROWS, L3)
        if DEPTH == 4:
            acc = mma_v2(
                _scaled_fragment(_codes(w3), t3, b3, fragment), _x_step(x_smem, i + 3, b_operand), acc
            )
            k = gl.minimum(k_begin + i + 3 + DEPTH, last)
            w3, t3, b3 = _load_step(w_base, s_base, k, rows_left, IN_DIM, N_ROWS, L3)

    OL: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])
    acc = gl.convert_layout(acc, OL)
    r = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OL))
    out_pairs = gl.convert_layout(pairs, gl.SliceLayout(0, OL))
    mask = (out_pairs < num_pairs)[None, :] & (r < N_ROWS)[:, None]
    ptrs = part_ptr + gl.program_id(1) * stride_part_split + out_pairs[None, :] * stride_part_m + r[:, None]
    gl.store(ptrs, acc, mask=mask)
