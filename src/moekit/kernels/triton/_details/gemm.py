"""Triton JIT code of the fused-MoE path's GEMMs; host code lives in `align.py` and `launch.py`, the
routing preparation in `_jit_align.py`, the MXFP4 decode helpers in `_jit_mxfp4.py`.

Data flow of one layer (P = T*K (token, k) pairs, pair p = t*K + k):
  `_jit_align` (align.py): pairs sorted by local expert, each expert padded to BLOCK_M rows
  -> [_quant_fp8_rows: x -> fp8 [T, H] + fp32 scales; W8A8 only]
  -> _moe_gemm1: gathered x rows @ w13[e]^T (+ b13) -> gated activation -> h [P, I] (pair order)
  -> [_quant_fp8_rows: h -> fp8 [P, I] + scales; W8A8 only]
  -> _moe_gemm2: h rows @ w2[e]^T (+ b2) * router weight -> y [P, H] (pair order)
  -> _moe_sum_k: out[t] = sum_k y[t*K + k] in a fixed k order (deterministic, no atomics).

Every numeric switch is a constexpr whose code is defined below; launch.py maps the spec onto them.
Offsets that scale with T*K (token rows, pair rows) and with the expert index are int64.
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.mxfp4 import (
    _mxfp4_native_bytes,
    _mxfp4_native_scales,
    _mxfp4_tiles,
    _mxfp4_words_tile,
)

# Weight storage (W_FORMAT).
WFMT_FLOAT = tl.constexpr(0)  # bf16 / fp16 / fp32 [E, N, K]
WFMT_FP8 = tl.constexpr(1)  # float8_e4m3fn [E, N, K], fp32 scales per FP8_SCALE
WFMT_MXFP4 = tl.constexpr(2)  # uint8 blocks [E, N, ceil(K/32)*16] + E8M0 scales [E, N, ceil(K/32)]
# MXFP4 in WeightPacking.MXFP4_MMA_WORDS: int32 words [E, N/16, S, 8, 4, 8] in 1 KiB runs (see
# moekit.formats.mxfp4_words) + the same E8M0 scales, every scale byte <= 128.
WFMT_MXFP4_WORDS = tl.constexpr(3)
# FP8 weight scale granularity (FP8_SCALE).
FP8S_TENSOR = tl.constexpr(0)  # [E]
FP8S_CHANNEL = tl.constexpr(1)  # [E, N]
FP8S_BLOCK = tl.constexpr(2)  # [E, ceil(N/128), ceil(K/128)]
# Dynamic activation quantization of the A operand (A_QUANT).
AQ_NONE = tl.constexpr(0)
AQ_TOKEN = tl.constexpr(1)  # scale [rows, 1]
AQ_GROUP = tl.constexpr(2)  # scale [rows, ceil(K/128)]
# Gated activations (ACTIVATION).
ACT_SILU = tl.constexpr(0)
ACT_GELU = tl.constexpr(1)
ACT_GELU_TANH = tl.constexpr(2)
ACT_SWIGLU_OAI = tl.constexpr(3)

# Operand formats of tl.dot_scaled (constexpr objects: the interpreter does not wrap string literals).
_E2M1 = tl.constexpr("e2m1")
_BF16 = tl.constexpr("bf16")

_FP8_MAX = tl.constexpr(448.0)
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # moekit.formats.fp8's floor for amax / 448


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
def _round_to_e4m3(y):
    """Round fp32 `y` (|y| <= 448) to the nearest E4M3 value, ties to even, still in fp32.

    The cast to float8 that follows is then exact everywhere: the Triton interpreter's own
    fp32 -> fp8 cast does not round to nearest-even (measured), the GPU's cvt.rn does.
    Adding and subtracting 2^23 * spacing makes the fp32 adder round at the E4M3 spacing.
    """
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # below 2^-6 the spacing is the subnormal 2^-9
    magic = ((exp + 20) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3) * 2^23
    mag = ((tl.abs(y) + magic) - magic).to(tl.int32, bitcast=True)
    # Copy the sign bit (not `-mag`: negation compiles to 0 - x, which turns -0 into +0).
    return (mag | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_fp8_rows(
    src_ptr,  # [R, C] float rows
    row_mult_ptr,  # fp32 [R] multiplier applied before quantizing (router weight, INPUT placement) or None
    dst_ptr,  # float8_e4m3fn [R, C]
    scale_ptr,  # fp32 [R, G]: G = 1 per token, ceil(C/128) per 1x128 group
    NUM_COLS: tl.constexpr,  # C
    GROUP_COLS: tl.constexpr,  # C per token, 128 per group
    stride_src,
    stride_dst,
    stride_scale,
    HAS_ROW_MULT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, group): scale = max(amax / 448, tiny) (1 if amax == 0), as moekit.formats."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    col_start = group * GROUP_COLS
    offs = tl.arange(0, BLOCK)
    mult = 1.0
    if HAS_ROW_MULT:
        mult = tl.load(row_mult_ptr + row)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    # Loop bounds are constexpr: sizes H and I are fixed per model, and the Triton interpreter cannot
    # loop over runtime bounds with numpy 2.
    for c in range(0, GROUP_COLS, BLOCK):
        cols = col_start + c + offs
        mask = (c + offs < GROUP_COLS) & (cols < NUM_COLS)
        v = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROW_MULT:
            v = v * mult
        amax = tl.maximum(amax, tl.abs(v))
    amax_row = tl.max(amax, axis=0)
    # div_rn: the GPU's default fp32 division is approximate; the reference divides exactly.
    scale = tl.maximum(tl.math.div_rn(amax_row, _FP8_MAX), _FP32_TINY)
    scale = tl.where(amax_row > 0, scale, 1.0)
    for c in range(0, GROUP_COLS, BLOCK):
        cols = col_start + c + offs
        mask = (c + offs < GROUP_COLS) & (cols < NUM_COLS)
        v = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROW_MULT:
            v = v * mult
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -_FP8_MAX), _FP8_MAX)
        tl.store(dst_ptr + row * stride_dst + cols, _round_to_e4m3(q).to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row * stride_scale + group, scale)


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
    MX_NATIVE (bf16 activations, compiled only) selects `tl.dot_scaled` for CHECKPOINT MXFP4 and the
    PTX bf16x2 scaling for MXFP4_MMA_WORDS; otherwise both decode with plain Triton operations
    (interpreter, fp16, fp32). See `_jit_mxfp4.py`.
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
        elif W_FORMAT == WFMT_MXFP4:
            if MX_NATIVE:
                packed = _mxfp4_native_bytes(w_base, w_rows, w_mask, k0, IN_DIM, EVEN_K, stride_wn, BLOCK_K)
                if SWAP_AB:
                    acc = tl.dot_scaled(packed, scales, _E2M1, tl.trans(a), None, _BF16, acc, fast_math=True)
                else:
                    acc = tl.dot_scaled(a, None, _BF16, tl.trans(packed), scales, _E2M1, acc, fast_math=True)
            else:
                w_even, w_odd = _mxfp4_tiles(
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
                if FP8_SCALE == FP8S_BLOCK:
                    ws = tl.load(
                        s_base + (w_rows // 128) * stride_wsn + (k0 // 128) * stride_wsk,
                        mask=w_mask if EVEN_K else w_mask & (k0 < IN_DIM),  # no scale past IN_DIM
                        other=0.0,
                    )
                    part = part * (ws[:, None] if SWAP_AB else ws[None, :])
                if A_QUANT == AQ_GROUP:
                    sa = tl.load(
                        a_scale_ptr + a_rows * stride_asm + (k0 // 128) * stride_ask,
                        mask=a_mask if EVEN_K else a_mask & (k0 < IN_DIM),
                        other=0.0,
                    )
                    part = part * (sa[None, :] if SWAP_AB else sa[:, None])
                acc += part
            else:
                w_op = w.to(tl.float32) if DOT_FP32 else w.to(a.dtype)
                a_op = a.to(tl.float32) if DOT_FP32 else a
                if SWAP_AB:
                    acc = _dot(w_op, tl.trans(a_op), acc, DOT_FP32)
                else:
                    acc = _dot(a_op, w_op, acc, DOT_FP32)
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
def _wait_for_mma(acc):
    """`acc` unchanged, through an empty inline-asm use: Triton must complete every wgmma that writes
    `acc` first, so the next K-step's decode cannot overwrite A registers an MMA still reads.

    Why: Triton 3.6 waits for the register-A wgmma groups of a K-step with `pendings = groups - 1`
    (triton-lang/triton#9433), and the next decode then wrote A registers of in-flight MMAs
    (benchmarks/wgmma_hazard.py: 43 - 86 such writes a K-step). On an H200 that gave rel L2 1e-2 - 5e-2
    with session 5's 11-op bit placement (and may explain session 3's 8-warp race); with the wait, 0
    such writes and 0 failing runs (benchmarks/RESULTS.md, sessions 5 and 6). The cost: no MMA/decode
    overlap inside one program, 3 - 6 % for gpt-oss-120b at T >= 2048 (session 5 against session 4,
    same tiles). Compiled only (the interpreter has no inline asm)."""
    return tl.inline_asm_elementwise("", "=f,0", [acc], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b: IEEE fp32 FMAs for DOT_FP32 (exact-comparison path), else the tensor cores."""
    if DOT_FP32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _gated_activation(
    gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr
):
    """moekit.reference.apply_activation in fp32 registers."""
    if HAS_LIMIT:  # every activation clamps the same way: gate from above, up on both sides
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if ACTIVATION == ACT_SWIGLU_OAI:
        out = gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)
    elif ACTIVATION == ACT_SILU:
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == ACT_GELU:
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): no tanh needed, and no cancellation near z = 0.
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = gate * tl.sigmoid(2.0 * z) * up
    return out


@triton.jit
def _block_rows(sorted_pairs_ptr, block_expert_ptr, block_start_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Pairs of M-block `pid_m` (int64, padding rows masked) and its local expert (int64). The block's
    first row in `sorted_pairs_ptr` is `pid_m * BLOCK_M`, or `block_start_ptr[pid_m]` when given (the
    two block lists of a tail-block launch index one alignment of half the size)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if block_start_ptr is None:
        first = pid_m * BLOCK_M
    else:
        first = tl.load(block_start_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + first + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pairs, pairs < num_pairs, expert


@triton.jit
def _moe_gemm1(
    x_ptr,  # [T, H] act dtype; float8_e4m3fn [T, H] when W8A8
    x_scale_ptr,  # fp32 [T, 1] / [T, ceil(H/128)] (W8A8) or None
    w_ptr,  # w13 [E_local, 2I, H] float / fp8, or MXFP4 bytes uint8 [E_local, 2I, ceil(H/32)*16]
    w_scale_ptr,  # FP8 fp32 [E_local] / [E_local, 2I] / [E_local, ceil(2I/128), ceil(H/128)]; MXFP4 uint8
    #               [E_local, 2I, ceil(H/32)]; or None
    b_ptr,  # b13 [E_local, 2I] or None
    route_w_ptr,  # fp32 [T*K] router weights (INPUT placement) or None
    sorted_pairs_ptr,  # int32 [num_pid_m * BLOCK_M]
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]: first sorted row of each M-block, or None (pid_m * BLOCK_M)
    num_blocks_ptr,  # int32 [1]
    h_ptr,  # [T*K, I] act dtype (fp32 when W8A8)
    part_ptr,  # fp32 [SPLIT_K, T*K, 2I] raw partial sums when SPLIT_K > 1, else None
    num_pairs,
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
    stride_part_split,
    stride_part_m,
    INTER_SIZE: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
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
):
    """h[p, n0:n0+BLOCK_N] = act(x[p // K] @ w13[e]^T + b13[e]) for the pairs of one M-block.

    One dot of 2*BLOCK_N weight rows per tile: the gate and up rows of the same output columns, so
    the activation is applied in registers without a second pass. With SPLIT_K > 1, program
    (., s) sums only the s-th share of H and stores the raw sums to `part_ptr`; `_moe_gemm1_splits`
    adds the shares in order and finishes (bias, activation) instead.
    """
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, tl.cdiv(INTER_SIZE, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return  # the grid is a host-side upper bound; the true block count stays on the device
    pairs, row_mask, expert = _block_rows(
        sorted_pairs_ptr, block_expert_ptr, block_start_ptr, pid_m, num_pairs, BLOCK_M
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
        tl.store(
            h_ptr + pairs[:, None] * stride_hm + offs_n[None, :],
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
    sorted_pairs_ptr,  # int32 [num_pid_m * BLOCK_M]
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]: first sorted row of each M-block, or None (pid_m * BLOCK_M)
    num_blocks_ptr,  # int32 [1]
    y_ptr,  # [T*K, H] (act dtype, or fp32 for fp32 activations)
    part_ptr,  # fp32 [SPLIT_K, T*K, H] raw partial sums when SPLIT_K > 1, else None
    num_pairs,
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
):
    """y[p, n0:n0+BLOCK_N] = w[p] * (h[p] @ w2[e]^T + b2[e]) for the pairs of one M-block; with
    SPLIT_K > 1, the raw sums of the s-th share of I to `part_ptr` (`_moe_sum_k` finishes)."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pairs, row_mask, expert = _block_rows(
        sorted_pairs_ptr, block_expert_ptr, block_start_ptr, pid_m, num_pairs, BLOCK_M
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


@triton.jit
def _moe_gemm1_splits(
    part_ptr,  # fp32 [SPLIT_K, T*K, 2I] raw GEMM1 sums of each share of H
    pair_expert_ptr,  # int32 [T*K] local expert of each pair, -1 if it is not computed here
    b_ptr,  # b13 [E_local, 2I] or None
    route_w_ptr,  # fp32 [T*K] router weights (INPUT placement) or None
    h_ptr,  # [T*K, I]
    stride_part_split,
    stride_part_m,
    stride_be,
    stride_hm,
    INTER_SIZE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_INPUT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ALPHA: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """h[p, cols] = act(sum over s = 0..SPLIT_K-1, in that order, of the GEMM1 shares (+ b13)): the
    epilogue `_moe_gemm1` applies when it sums all of H itself."""
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(pair_expert_ptr + p).to(tl.int64)
    if expert < 0:
        return  # a pair no M-block holds: its h row is never read
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < INTER_SIZE
    if INTERLEAVED:  # rows 2n (gate n) and 2n+1 (up n)
        gate_rows = 2 * cols
        up_rows = 2 * cols + 1
    else:  # rows n and I + n
        gate_rows = cols
        up_rows = cols + INTER_SIZE
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        row = part_ptr + s * stride_part_split + p * stride_part_m
        gate += tl.load(row + gate_rows, mask=mask, other=0.0)
        up += tl.load(row + up_rows, mask=mask, other=0.0)
    if ROUTE_ON_INPUT:
        w = tl.load(route_w_ptr + p)
        gate, up = gate * w, up * w
    if HAS_BIAS:
        gate += tl.load(b_ptr + expert * stride_be + gate_rows, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + expert * stride_be + up_rows, mask=mask, other=0.0).to(tl.float32)
    out = _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
    tl.store(h_ptr + p * stride_hm + cols, out.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_sum_k(
    y_ptr,  # [SHARES, T*K, H] per-pair rows (rows of dropped pairs are never written)
    pair_expert_ptr,  # int32 [T*K] local expert of each pair, -1 if another rank owns it
    b_ptr,  # b2 [E_local, H] or None
    route_w_ptr,  # fp32 [T*K] router weights (OUTPUT placement) or None
    out_ptr,  # [T, H] act dtype
    stride_ys,
    stride_ym,
    stride_be,
    stride_om,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    SHARES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_OUTPUT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum over k = 0..K-1, in that order, of y[p] (+ b2[e]) (times w[p]) for p = t*K + k, where
    y[p] sums the SHARES rows of p in order; dropped pairs add zero. One share of finished rows (GEMM2
    added b2 and the router weight) or, split-K, GEMM2's raw fp32 shares with its epilogue here."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        p = t * TOP_K + k
        expert = tl.load(pair_expert_ptr + p).to(tl.int64)
        # tl.where keeps the mask int1 under every Triton's interpreter (3.9's makes `mask & scalar` int32).
        keep = tl.where(expert >= 0, mask, False)
        y = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SHARES):
            y += tl.load(y_ptr + s * stride_ys + p * stride_ym + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + expert * stride_be + cols, mask=keep, other=0.0).to(tl.float32)
        if ROUTE_ON_OUTPUT:
            y = y * tl.load(route_w_ptr + p)
        acc += y
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
