"""One expert's tile of a grouped GEMM, for every weight format: the K-loop both GEMMs share.

Data flow: A rows (gathered tokens for GEMM1, pairs for GEMM2) and one expert's weight rows -> per
K-step: load A; load W (float, FP8) or decode it (MXFP4 bytes through `tl.dot_scaled` or bit
operations, MXFP4_MMA_WORDS straight into the MMA's register operand; `mxfp4.py`) -> MMA into an fp32
accumulator (FP8: promoted per tile, where block scales along K apply) -> per-channel, per-tensor and
per-token scales -> fp32 [BLOCK_M, BLOCK_N] to the GEMM's epilogue (`gemm.py`).
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.codes import (
    AQ_GROUP,
    AQ_NONE,
    AQ_TOKEN,
    FP8S_BLOCK,
    FP8S_CHANNEL,
    FP8S_TENSOR,
    WFMT_FLOAT,
    WFMT_FP8,
    WFMT_MXFP4,
    WFMT_MXFP4_WORDS,
)
from moekit.kernels.triton._details.mxfp4 import (
    _mxfp4_native_bytes,
    _mxfp4_native_scales,
    _mxfp4_tiles,
    _mxfp4_words_tile,
)

# Operand formats of tl.dot_scaled (constexpr objects: the interpreter does not wrap string literals).
_E2M1 = tl.constexpr("e2m1")
_BF16 = tl.constexpr("bf16")


@triton.jit
def _expert_matmul(
    a_ptr,
    a_scale_ptr,
    a_rows,
    a_mask,
    stride_am,
    stride_asm,
    stride_ask,
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
    IN_DIM: tl.constexpr,
    SPLIT_K: tl.constexpr,
    W_FORMAT: tl.constexpr,
    FP8_SCALE: tl.constexpr,
    A_QUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    W_SCALE_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = A[a_rows, K] @ W[expert, w_rows, K]^T with every scale applied, K all of
    IN_DIM or, with SPLIT_K > 1, share `tl.program_id(1)` of its K-steps.

    A and W are contiguous along the reduction axis (checked on the host). Steps past IN_DIM (a ragged
    last step, or the empty end of the last share) read nothing and add zero.
    SWAP_AB computes the transpose W @ A^T instead: the weight rows fill the MMA's M side (64 on
    Hopper) and the few token rows of a decode step its N side (16), so small batches waste no MMA
    rows. MXFP4 never needs it: `tl.dot_scaled` already puts the upcast weights on the register side,
    and the MXFP4_MMA_WORDS format is always computed that way round.
    W_SCALE_BLOCKS: 1 when every row of `w_rows` lies in one 128-row block of FP8 block scales, 2 when
    each half of them does (CONCAT's gate rows, then its up rows), 0 otherwise: with 1 or 2 a K-step's
    weight scales are one or two numbers (folded into A's row scales) instead of a gathered vector.
    MX_NATIVE (bf16 activations, compiled only) selects `tl.dot_scaled` for CHECKPOINT MXFP4 and the
    PTX bf16x2 scaling for MXFP4_MMA_WORDS; otherwise both decode with plain Triton operations
    (interpreter, fp16, fp32). See `mxfp4.py`.
    """
    K_STEPS: tl.constexpr = ((IN_DIM + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K  # a share's
    EVEN_K: tl.constexpr = K_STEPS * SPLIT_K * BLOCK_K == IN_DIM  # every step inside IN_DIM: no K masks
    if SPLIT_K == 1:
        k_begin = 0  # the literal keeps the compiled loop as it is without split-K
    else:
        k_begin = tl.program_id(1) * (K_STEPS * BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am
    w_base = w_ptr + expert * stride_we
    s_base = w_scale_ptr  # None for float weights: no pointer arithmetic on it
    if W_FORMAT != WFMT_FLOAT:
        s_base = w_scale_ptr + expert * stride_wse
    # MXFP4_MMA_WORDS decode straight into the MMA's register operand: always weights-first.
    SWAPPED: tl.constexpr = SWAP_AB or W_FORMAT == WFMT_MXFP4_WORDS
    if SWAPPED:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    PREFETCH_SCALES: tl.constexpr = W_FORMAT == WFMT_MXFP4_WORDS or (W_FORMAT == WFMT_MXFP4 and MX_NATIVE)
    if PREFETCH_SCALES:
        # Scale tiles are too small for cp.async (1 byte per thread), so the software pipeline skips
        # them: prefetch one K-step ahead in registers instead of stalling on HBM every step.
        next_scales = _mxfp4_native_scales(
            s_base, w_rows, w_mask, k_begin, IN_DIM, stride_wsn, stride_wsk, BLOCK_K
        )
    # FP8 weights and W4A8 compute each K-step's product on its own and promote it into acc (`_promote`).
    PROMOTED: tl.constexpr = W_FORMAT == WFMT_FP8 or (W_FORMAT == WFMT_MXFP4 and A_QUANT != AQ_NONE)
    FEW_WS: tl.constexpr = W_FORMAT == WFMT_FP8 and FP8_SCALE == FP8S_BLOCK and W_SCALE_BLOCKS > 0
    if FEW_WS:
        second_half = tl.arange(0, BLOCK_N) >= BLOCK_N // 2
        lo_row = tl.min(tl.where(second_half, 2147483647, w_rows), axis=0)
        ws_base = s_base + (lo_row // 128) * stride_wsn
        if W_SCALE_BLOCKS == 2:
            # A ragged last tile may have no row in its second half: read the first half's scale then
            # (those columns are masked), never a scale row past the weight's.
            hi_row = tl.min(tl.where(second_half & w_mask, w_rows, 2147483647), axis=0)
            hi_row = tl.where(hi_row == 2147483647, lo_row, hi_row)
            ws_base_hi = s_base + (hi_row // 128) * stride_wsn
    # Constexpr bounds: the interpreter cannot loop over runtime ones (see _quant_fp8_rows).
    for k_rel in range(0, K_STEPS * BLOCK_K, BLOCK_K):
        k0 = k_begin + k_rel
        ks = k0 + offs_k
        if EVEN_K:  # an all-true mask along K would keep the loads from vectorizing
            k_mask = tl.full([BLOCK_K], True, tl.int1)
        else:
            k_mask = ks < IN_DIM
        a = tl.load(a_base + ks[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        if PREFETCH_SCALES:
            scales = next_scales
            next_scales = _mxfp4_native_scales(
                s_base, w_rows, w_mask, k0 + BLOCK_K, IN_DIM, stride_wsn, stride_wsk, BLOCK_K
            )
        if W_FORMAT == WFMT_MXFP4_WORDS:
            out_dtype: tl.constexpr = tl.float32 if DOT_FP32 else a.dtype
            w = _mxfp4_words_tile(
                w_base,
                w_blocks,
                w_block_mask,
                scales,
                k0,
                IN_DIM,
                EVEN_K,
                stride_wn,
                MX_NATIVE,
                out_dtype,
                BLOCK_N,
                BLOCK_K,
            )
            acc = _dot(w, tl.trans(a.to(out_dtype)), acc, DOT_FP32)
            if MX_NATIVE:
                acc = _wait_for_mma(acc)
        elif W_FORMAT == WFMT_MXFP4 and A_QUANT != AQ_NONE:
            # W4A8: FP8 codes of A times the E2M1 values, each group's scale folded in relative to the
            # row's largest over the step (`_mxfp4_tiles` with FOLD), in K order as FP8 on the FP8
            # tensor cores; promoted into fp32 once a step with that largest scale and A's scales.
            w_low, w_high, w_scale = _mxfp4_tiles(
                w_base,
                s_base,
                w_rows,
                w_mask,
                k0,
                IN_DIM,
                stride_wn,
                stride_wsn,
                stride_wsk,
                BLOCK_N,
                BLOCK_K,
                True,
            )
            w_op = tl.reshape(tl.permute(tl.join(w_low, w_high), (0, 2, 1)), (BLOCK_K, BLOCK_N))
            w_op = w_op.to(tl.float8e4nv)
            zero = tl.zeros(acc.shape, dtype=tl.float32)
            if SWAP_AB:
                part = _dot(tl.trans(w_op), tl.trans(a), zero, DOT_FP32)
            else:
                part = _dot(a, w_op, zero, DOT_FP32)
            ws = w_scale[:, None] if SWAP_AB else w_scale[None, :]
        elif W_FORMAT == WFMT_MXFP4:
            if MX_NATIVE:
                packed = _mxfp4_native_bytes(w_base, w_rows, w_mask, k0, IN_DIM, EVEN_K, stride_wn, BLOCK_K)
                if SWAP_AB:
                    acc = tl.dot_scaled(packed, scales, _E2M1, tl.trans(a), None, _BF16, acc, fast_math=True)
                else:
                    acc = tl.dot_scaled(a, None, _BF16, tl.trans(packed), scales, _E2M1, acc, fast_math=True)
            else:
                w_even, w_odd, _ = _mxfp4_tiles(
                    w_base,
                    s_base,
                    w_rows,
                    w_mask,
                    k0,
                    IN_DIM,
                    stride_wn,
                    stride_wsn,
                    stride_wsk,
                    BLOCK_N,
                    BLOCK_K,
                )
                a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
                if DOT_FP32:
                    a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
                else:  # E2M1 times a power of two is exact in bf16 (and in fp16 within its range)
                    w_even, w_odd = w_even.to(a.dtype), w_odd.to(a.dtype)
                if SWAP_AB:
                    acc = _dot(tl.trans(w_even), tl.trans(a_even), acc, DOT_FP32)
                    acc = _dot(tl.trans(w_odd), tl.trans(a_odd), acc, DOT_FP32)
                else:
                    acc = _dot(a_even, w_even, acc, DOT_FP32)
                    acc = _dot(a_odd, w_odd, acc, DOT_FP32)
        else:
            if SWAP_AB:  # [BLOCK_N, BLOCK_K]
                w = tl.load(
                    w_base + w_rows[:, None] * stride_wn + ks[None, :],
                    mask=w_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
            else:  # [BLOCK_K, BLOCK_N]
                w = tl.load(
                    w_base + w_rows[None, :] * stride_wn + ks[:, None],
                    mask=w_mask[None, :] & k_mask[:, None],
                    other=0.0,
                )
            if W_FORMAT == WFMT_FP8:
                if A_QUANT != AQ_NONE:
                    w_op, a_op = w, a  # fp8 x fp8 on the tensor cores
                elif DOT_FP32:
                    w_op, a_op = w.to(tl.float32), a.to(tl.float32)
                else:
                    w_op, a_op = w.to(a.dtype), a  # E4M3 values are exact in bf16 / fp16
                zero = tl.zeros(acc.shape, dtype=tl.float32)
                if SWAP_AB:
                    part = _dot(w_op, tl.trans(a_op), zero, DOT_FP32)  # [BLOCK_N, BLOCK_M]
                else:
                    part = _dot(a_op, w_op, zero, DOT_FP32)
                # Hopper accumulates fp8 MMAs with reduced precision: promote each tile into fp32
                # (BLOCK_K <= 128), which is also where block scales along K must be applied.
                if FEW_WS:  # one or two numbers a K-step, not a gathered vector
                    in_k = EVEN_K or k0 < IN_DIM
                    ws = tl.load(ws_base + (k0 // 128) * stride_wsk, mask=in_k, other=0.0)
                    if W_SCALE_BLOCKS == 2:
                        ws_hi = tl.load(ws_base_hi + (k0 // 128) * stride_wsk, mask=in_k, other=0.0)
                        ws = tl.where(second_half, ws_hi, ws)
                        ws = ws[:, None] if SWAP_AB else ws[None, :]
                elif FP8_SCALE == FP8S_BLOCK:
                    ws = tl.load(
                        s_base + (w_rows // 128) * stride_wsn + (k0 // 128) * stride_wsk,
                        mask=w_mask if EVEN_K else w_mask & (k0 < IN_DIM),  # no scale past IN_DIM
                        other=0.0,
                    )
                    ws = ws[:, None] if SWAP_AB else ws[None, :]
                else:
                    ws = 1.0  # per-tensor and per-channel scales apply once, after the loop
            else:
                w_op = w.to(tl.float32) if DOT_FP32 else w.to(a.dtype)
                a_op = a.to(tl.float32) if DOT_FP32 else a
                if SWAP_AB:
                    acc = _dot(w_op, tl.trans(a_op), acc, DOT_FP32)
                else:
                    acc = _dot(a_op, w_op, acc, DOT_FP32)
        if PROMOTED:  # the step's product and weight scale from its branch above
            acc = _promote(
                acc,
                part,
                ws,
                a_scale_ptr,
                a_rows,
                a_mask,
                k0,
                IN_DIM,
                EVEN_K,
                stride_asm,
                stride_ask,
                A_QUANT,
                SWAP_AB,
            )
    if SWAPPED:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N] for the epilogues
    if W_FORMAT == WFMT_FP8:
        if FP8_SCALE == FP8S_CHANNEL:
            acc = acc * tl.load(s_base + w_rows * stride_wsn, mask=w_mask, other=0.0)[None, :]
        if FP8_SCALE == FP8S_TENSOR:
            acc = acc * tl.load(s_base)
    if A_QUANT == AQ_TOKEN:
        acc = acc * tl.load(a_scale_ptr + a_rows * stride_asm, mask=a_mask, other=0.0)[:, None]
    return acc


@triton.jit
def _promote(
    acc,
    part,
    w_scale,
    a_scale_ptr,
    a_rows,
    a_mask,
    k0,
    IN_DIM: tl.constexpr,
    EVEN_K: tl.constexpr,
    stride_asm,
    stride_ask,
    A_QUANT: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """acc + part * scale: one K-step's fp32 MMA result promoted with its weight scale (a number, or a
    tile broadcast along the weight rows) times, per 1x128 group, A's scales of that step (0 past
    IN_DIM). The scales multiply each other first, so the promotion is one FMA an element: it runs after
    the MMA is waited for, so its ALU work is MMA time."""
    scale = w_scale
    if A_QUANT == AQ_GROUP:
        sa = tl.load(
            a_scale_ptr + a_rows * stride_asm + (k0 // 128) * stride_ask,
            mask=a_mask if EVEN_K else a_mask & (k0 < IN_DIM),
            other=0.0,
        )
        scale = scale * (sa[None, :] if SWAP_AB else sa[:, None])  # the product's token axis
    return acc + part * scale


@triton.jit
def _wait_for_mma(acc):
    """`acc` unchanged, through an empty inline-asm use: Triton must complete every wgmma that writes
    `acc` first, so the next K-step's decode cannot overwrite A registers an MMA still reads.

    Why: Triton 3.6 waits for the register-A wgmma groups of a K-step with `pendings = groups - 1`
    (triton-lang/triton#9433), and the next decode then wrote A registers of in-flight MMAs
    (tools/wgmma_hazard.py: 43 - 86 such writes a K-step). Without the wait the word path gave rel L2
    1e-2 - 5e-2 on an H200; with it, 0 such writes and no failing run. The cost: no MMA/decode overlap
    inside one program, 3 - 6 % for gpt-oss-120b at T >= 2048 on an H200 (same tiles). Compiled only
    (the interpreter has no inline asm)."""
    return tl.inline_asm_elementwise("", "=f,0", [acc], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b: IEEE fp32 FMAs for DOT_FP32 (exact-comparison path), else the tensor cores."""
    if DOT_FP32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
