"""The two grouped GEMMs of the fused-MoE layer: one program per (M-block, N-tile, K-share).

Data flow of one layer (P = T*K (token, k) pairs, pair p = t*K + k):
  `align.py`: pairs sorted by local expert, each expert padded to BLOCK_M rows
  -> [`quant._quant_fp8_rows` / `_quant_fp8_groups`: x -> fp8 [T, H] + fp32 scales; W8A8 only]
  -> `_moe_gemm1`: gathered x rows @ w13[e]^T (+ b13) -> gated activation -> h [P, I] (pair order)
     [QUANT_H: h's per-1x128 FP8 codes and scales straight from the epilogue, when a tile is one group]
  -> [`quant`: h -> fp8 [P, I] + scales; W8A8 without QUANT_H]
  -> `_moe_gemm2`: h rows @ w2[e]^T (+ b2) * router weight -> y [P, H] (pair order)
  -> `reduce._moe_sum_k`: out[t] = sum_k y[t*K + k] in a fixed k order (deterministic, no atomics).
With SPLIT_K > 1 both GEMMs store raw fp32 shares instead, which `reduce.py` sums and finishes.

The K-loop of both is `matmul._expert_matmul`. Every numeric switch is a constexpr code of `codes.py`;
`launch.py` maps the spec onto them. Offsets that scale with T*K (token rows, pair rows) and with the
expert index are int64.
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.align import _is_local
from moekit.kernels.triton._details.matmul import _expert_matmul
from moekit.kernels.triton._details.pdl import _pdl_prologue
from moekit.kernels.triton._details.quant import _fp8_group_codes


@triton.constexpr_function
def _scale_blocks_of_rows(rows):
    """`_expert_matmul`'s W_SCALE_BLOCKS for a tile of `rows` adjacent weight rows (a power of two, so
    the tile is aligned to it): one 128-row scale block up to 128 rows, one a half at 256."""
    return 1 if rows <= 128 else (2 if rows == 256 else 0)


@triton.constexpr_function
def _scale_blocks_gemm1(interleaved, inter_size, block_n):
    """W_SCALE_BLOCKS for GEMM1's 2 * block_n rows of w13: INTERLEAVED tiles are that many adjacent
    rows; CONCAT tiles are block_n gate rows then block_n up rows, I further on, each half inside one
    128-row block when 128 divides I."""
    if interleaved:
        return _scale_blocks_of_rows(2 * block_n)
    return 2 if block_n <= 128 and inter_size % 128 == 0 else 0


@triton.jit
def _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Consecutive programs walk GROUP_M M-blocks (mostly of one expert) for the same N-tile, so the
    # weight tile they share stays in L2 instead of being streamed again from HBM.
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _block_rows(
    sorted_pairs_ptr, block_expert_ptr, block_start_ptr, pid_m, num_pairs, num_local, BLOCK_M: tl.constexpr
):
    """Pairs of M-block `pid_m` (int64, padding rows masked) and its local expert (int64). The block's
    first row in `sorted_pairs_ptr` is `pid_m * BLOCK_M`, or `block_start_ptr[pid_m]` when given (the
    two block lists of a tail-block launch index one alignment of half the size). Without a sorted pair
    list, block `pid_m` is pair `pid_m` alone (`align.one_block_per_pair`), its expert the routing id as
    given: an id outside [0, num_local) reads expert 0, never past the weights, and the finish kernels
    drop the pair (as the alignment drops it). Its rows stay a function of `pid_m` alone: masking them by
    the loaded id made both GEMMs of a gpt-oss-120b decode step 15 - 25 % slower on an H200."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if sorted_pairs_ptr is None:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs).to(tl.int64)
        expert = tl.where(_is_local(expert, num_local), expert, 0)
    else:
        first = _block_first_row(block_start_ptr, pid_m, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + first + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pairs, pairs < num_pairs, expert


@triton.jit
def _block_first_row(block_start_ptr, pid_m, BLOCK_M: tl.constexpr):
    """The first sorted row of M-block `pid_m`: `block_start_ptr[pid_m]`, or pid_m * BLOCK_M without it."""
    if block_start_ptr is None:
        return pid_m * BLOCK_M
    else:
        return tl.load(block_start_ptr + pid_m)


@triton.jit
def _moe_gemm1(
    x_ptr,  # [T, H] act dtype; float8_e4m3fn [T, H] when W8A8
    x_scale_ptr,  # fp32 [T, 1] / [T, ceil(H/128)] (W8A8) or None
    w_ptr,  # w13 [E_local, 2I, H] float / fp8, or MXFP4 bytes uint8 [E_local, 2I, ceil(H/32)*16]
    w_scale_ptr,  # FP8 fp32 [E_local] / [E_local, 2I] / [E_local, ceil(2I/128), ceil(H/128)]; MXFP4 uint8
    #               [E_local, 2I, ceil(H/32)]; or None
    b_ptr,  # b13 [E_local, 2I] or None
    route_w_ptr,  # fp32 [T*K] router weights (INPUT placement) or None
    sorted_pairs_ptr,  # int32 [num_pid_m * BLOCK_M], or None: block b is pair b alone
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]: first sorted row of each M-block, or None (pid_m * BLOCK_M)
    num_blocks_ptr,  # int32 [1], or None: every block of the grid holds pairs
    h_ptr,  # [T*K, I] act dtype (fp32 when W8A8; float8_e4m3fn with QUANT_H); [R, I] with H_SORTED
    h_scale_ptr,  # fp32 [T*K, I/128] with QUANT_H, else None
    part_ptr,  # fp32 [SPLIT_K, T*K, 2I] raw partial sums when SPLIT_K > 1, else None
    num_pairs,
    num_local_experts,  # unaligned ids outside [0, it) (unchecked routing) read expert 0, never past
    num_pid_m,
    stride_xm,
    stride_xsm,
    stride_xsk,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_be,
    stride_hm,
    stride_hsm,
    stride_part_split,
    stride_part_m,
    INTER_SIZE: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    QUANT_H: tl.constexpr,
    H_SORTED: tl.constexpr,  # h rows are the alignment's sorted rows (the WGMMA_BF16 GEMM2 reads them by TMA)
    W_FORMAT: tl.constexpr,
    FP8_SCALE: tl.constexpr,
    A_QUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_INPUT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ALPHA: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """h[p, n0:n0+BLOCK_N] = act(x[p // K] @ w13[e]^T + b13[e]) for the pairs of one M-block.

    One dot of 2*BLOCK_N weight rows per tile: the gate and up rows of the same output columns, so
    the activation is applied in registers without a second pass. With SPLIT_K > 1, program
    (., s) sums only the s-th share of H and stores the raw sums to `part_ptr`; `_moe_gemm1_splits`
    adds the shares in order and finishes (bias, activation) instead.
    """
    _pdl_prologue(PDL)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, tl.cdiv(INTER_SIZE, BLOCK_N), GROUP_M)
    if num_blocks_ptr is not None:  # None: every block of the grid holds pairs
        if pid_m >= tl.load(num_blocks_ptr):
            return  # the grid is a host-side upper bound; the true block count stays on the device
    pairs, row_mask, expert = _block_rows(
        sorted_pairs_ptr, block_expert_ptr, block_start_ptr, pid_m, num_pairs, num_local_experts, BLOCK_M
    )
    tokens = pairs // TOP_K
    j = tl.arange(0, 2 * BLOCK_N)
    if INTERLEAVED:  # rows 2n (gate n) and 2n+1 (up n) are adjacent
        w_rows = 2 * pid_n * BLOCK_N + j
        w_mask = w_rows < 2 * INTER_SIZE
    else:  # CONCAT: gate n is row n, up n is row I + n
        col = pid_n * BLOCK_N + (j % BLOCK_N)
        w_rows = tl.where(j < BLOCK_N, col, col + INTER_SIZE)
        w_mask = col < INTER_SIZE
    # The same rows as 16-row blocks (MXFP4_MMA_WORDS; the packing needs 16 | I).
    jb = tl.arange(0, 2 * BLOCK_N // 16)
    if INTERLEAVED:
        w_blocks = pid_n * (2 * BLOCK_N // 16) + jb
        w_block_mask = w_blocks * 16 < 2 * INTER_SIZE
    else:
        col_block = pid_n * (BLOCK_N // 16) + jb % (BLOCK_N // 16)
        w_blocks = tl.where(jb < BLOCK_N // 16, col_block, col_block + INTER_SIZE // 16)
        w_block_mask = col_block * 16 < INTER_SIZE
    acc = _expert_matmul(
        x_ptr,
        x_scale_ptr,
        tokens,
        row_mask,
        stride_xm,
        stride_xsm,
        stride_xsk,
        w_ptr,
        w_scale_ptr,
        expert,
        w_rows,
        w_mask,
        w_blocks,
        w_block_mask,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_wsk,
        HIDDEN,
        SPLIT_K,
        W_FORMAT,
        FP8_SCALE,
        A_QUANT,
        DOT_FP32,
        MX_NATIVE,
        SWAP_AB,
        _scale_blocks_gemm1(INTERLEAVED, INTER_SIZE, BLOCK_N),
        BLOCK_M,
        2 * BLOCK_N,
        BLOCK_K,
    )
    if SPLIT_K > 1:
        _store_share(part_ptr, stride_part_split, stride_part_m, pairs, w_rows, acc, row_mask, w_mask)
    else:
        if ROUTE_ON_INPUT:  # (w * x) @ W^T == w * (x @ W^T); K == 1 so pair == token
            acc = acc * tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        if HAS_BIAS:
            bias = tl.load(b_ptr + expert * stride_be + w_rows, mask=w_mask, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if INTERLEAVED:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        else:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        out = _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        h_rows = pairs
        if H_SORTED:
            h_rows = (_block_first_row(block_start_ptr, pid_m, BLOCK_M) + tl.arange(0, BLOCK_M)).to(tl.int64)
        if QUANT_H:  # the tile is one whole 1x128 group of h a row: GEMM2's FP8 input, made here
            codes, scale = _fp8_group_codes(out)
            tl.store(h_ptr + pairs[:, None] * stride_hm + offs_n[None, :], codes, mask=row_mask[:, None])
            tl.store(h_scale_ptr + pairs * stride_hsm + pid_n, scale, mask=row_mask)
        else:
            tl.store(
                h_ptr + h_rows[:, None] * stride_hm + offs_n[None, :],
                out.to(h_ptr.dtype.element_ty),
                mask=row_mask[:, None] & (offs_n < INTER_SIZE)[None, :],
            )


@triton.jit
def _moe_gemm2(
    h_ptr,  # [T*K, I] act dtype; float8_e4m3fn when W8A8
    h_scale_ptr,  # fp32 [T*K, 1] / [T*K, ceil(I/128)] (W8A8) or None
    w_ptr,  # w2 [E_local, H, I] float / fp8, or MXFP4 bytes uint8 [E_local, H, ceil(I/32)*16]
    w_scale_ptr,  # FP8 fp32 [E_local] / [E_local, H] / [E_local, ceil(H/128), ceil(I/128)]; MXFP4 uint8
    #               [E_local, H, ceil(I/32)]; or None
    b_ptr,  # b2 [E_local, H] or None
    route_w_ptr,  # fp32 [T*K] router weights (OUTPUT placement) or None
    sorted_pairs_ptr,  # int32 [num_pid_m * BLOCK_M], or None: block b is pair b alone
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]: first sorted row of each M-block, or None (pid_m * BLOCK_M)
    num_blocks_ptr,  # int32 [1], or None: every block of the grid holds pairs
    y_ptr,  # [T*K, H] (act dtype, or fp32 for fp32 activations)
    part_ptr,  # fp32 [SPLIT_K, T*K, H] raw partial sums when SPLIT_K > 1, else None
    num_pairs,
    num_local_experts,  # unaligned ids outside [0, it) (unchecked routing) read expert 0, never past
    num_pid_m,
    stride_hm,
    stride_hsm,
    stride_hsk,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_be,
    stride_ym,
    stride_part_split,
    stride_part_m,
    HIDDEN: tl.constexpr,
    INTER_SIZE: tl.constexpr,
    W_FORMAT: tl.constexpr,
    FP8_SCALE: tl.constexpr,
    A_QUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_OUTPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """y[p, n0:n0+BLOCK_N] = w[p] * (h[p] @ w2[e]^T + b2[e]) for the pairs of one M-block; with
    SPLIT_K > 1, the raw sums of the s-th share of I to `part_ptr` (`_moe_sum_k` finishes)."""
    _pdl_prologue(PDL)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    if num_blocks_ptr is not None:  # None: every block of the grid holds pairs
        if pid_m >= tl.load(num_blocks_ptr):
            return
    pairs, row_mask, expert = _block_rows(
        sorted_pairs_ptr, block_expert_ptr, block_start_ptr, pid_m, num_pairs, num_local_experts, BLOCK_M
    )
    w_rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_mask = w_rows < HIDDEN
    w_blocks = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)  # 16-row blocks (MXFP4_MMA_WORDS)
    w_block_mask = w_blocks * 16 < HIDDEN
    acc = _expert_matmul(
        h_ptr,
        h_scale_ptr,
        pairs,
        row_mask,
        stride_hm,
        stride_hsm,
        stride_hsk,
        w_ptr,
        w_scale_ptr,
        expert,
        w_rows,
        w_mask,
        w_blocks,
        w_block_mask,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_wsk,
        INTER_SIZE,
        SPLIT_K,
        W_FORMAT,
        FP8_SCALE,
        A_QUANT,
        DOT_FP32,
        MX_NATIVE,
        SWAP_AB,
        _scale_blocks_of_rows(BLOCK_N),
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if SPLIT_K > 1:
        _store_share(part_ptr, stride_part_split, stride_part_m, pairs, w_rows, acc, row_mask, w_mask)
    else:
        if HAS_BIAS:  # b2 is added per expert before the router weight, as GPT-OSS does
            bias = tl.load(b_ptr + expert * stride_be + w_rows, mask=w_mask, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if ROUTE_ON_OUTPUT:
            acc = acc * tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        tl.store(
            y_ptr + pairs[:, None] * stride_ym + w_rows[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_mask[:, None] & w_mask[None, :],
        )


@triton.jit
def _store_share(part_ptr, stride_part_split, stride_part_m, pairs, w_rows, acc, row_mask, w_mask):
    """A split-K program's raw fp32 sums to share `tl.program_id(1)` of `part_ptr` [SPLIT_K, T*K, N] (rows
    `pairs`, columns `w_rows`); `_moe_gemm1_splits` / `_moe_sum_k` add the shares and finish."""
    part = part_ptr + tl.program_id(1) * stride_part_split + pairs[:, None] * stride_part_m
    tl.store(part + w_rows[None, :], acc, mask=row_mask[:, None] & w_mask[None, :])
