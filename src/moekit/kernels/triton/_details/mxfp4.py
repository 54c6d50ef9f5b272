"""Triton JIT code that turns MXFP4 weights into MMA operands (used by `matmul._expert_matmul`).

Data flow: one K-step's weight rows (packed E2M1 bytes or words) and their E8M0 scales -> an MMA
operand, in one of three ways, chosen by the launch (`launch.py`) from the weights' packing and the
activation dtype:
- CHECKPOINT packing, compiled bf16: `_mxfp4_native_bytes` / `_mxfp4_native_scales` hand packed bytes
  and E8M0 scales to `tl.dot_scaled`, whose compiler-generated upcast feeds the MMA from registers;
- CHECKPOINT packing otherwise (interpreter, fp16, fp32): `_mxfp4_tiles` decodes with bit operations;
- MXFP4_MMA_WORDS packing (`moekit.formats.mxfp4_words`): `_mxfp4_words_tile` decodes 32-bit words laid
  out for the wgmma register fragment, scaling bf16 pairs with `mul.rn.bf16x2` when compiled.
"""

import triton
import triton.language as tl
from moekit.formats.mxfp4_words import CHUNKS_PER_RUN, MANTISSA_MASK, PAIR_MASK, PAIR_ROTATIONS

_RUN = tl.constexpr(CHUNKS_PER_RUN)  # 16-column chunks per stored run (32 lanes x _RUN words, contiguous)
_PAIR_MASK = tl.constexpr(PAIR_MASK)
_MANTISSA_MASK = tl.constexpr(MANTISSA_MASK)
_PAIR_ROTATIONS = tl.constexpr(PAIR_ROTATIONS)  # (exponent and sign, mantissa) of each pair


@triton.jit
def _e2m1_to_f32(nibble):
    """E2M1 code (int32, 0..15) -> fp32 with bit operations, no lookup table.

    c = sign(bit 3) | e(bits 1-2) | m(bit 0); |v| = m/2 if e == 0 else (1 + m/2) * 2^(e-1), i.e. the
    fp32 bits ((e + 126) << 23) | (m << 22); 0.5 (e = 0, m = 1) is 0x3F000000.
    """
    mag = nibble & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 0x3F000000, 0))
    return (bits | ((nibble & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tiles(
    w_base,
    s_base,
    w_rows,
    w_mask,
    k0,
    IN_DIM: tl.constexpr,
    stride_wn,
    stride_sn,
    stride_sk,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOLD: tl.constexpr = False,
):
    """MXFP4 rows `w_rows` [BLOCK_N], columns [k0, k0 + BLOCK_K) -> fp32 (even, odd) [BLOCK_K/2, BLOCK_N]
    and a per-row fp32 scale [BLOCK_N] still to apply (1 unless FOLD).

    The low nibble of byte j is element 2j, the high nibble element 2j+1: returning the two halves as
    separate tiles (and splitting A the same way) avoids interleaving them in registers. Scale byte s
    -> 2^(s-127) as the fp32 bits s << 23 (s = 0 gives 0 instead of 2^-127; 0xFF gives Inf, so a NaN
    scale still poisons its block). With FOLD (W4A8) each group is scaled by 2^(s - s_max) instead,
    s_max the row's largest byte over the step, and 2^(s_max - 127) is returned for the caller to apply.
    Bytes and scale groups past the row are masked, and elements past IN_DIM (the ragged tail's padding)
    are zeroed.

    FOLD's values go to FP8 E4M3 for the FP8 MMA, which then sums the whole step. Every E2M1 value times
    2^-d is exact in E4M3 for d <= 8, so a step is exact unless one of its groups sits more than 8
    binades below the row's largest there: its values then round in E4M3, a change under 2^-9 of that
    largest group's share of the sum (which can still move a code of the re-quantized FP8 intermediate;
    the layer stays within W4A8's tolerance). With BLOCK_K = 32 the step is one group and always exact.
    """
    GROUPS: tl.constexpr = BLOCK_K // 32  # 16 bytes (32 elements) share a scale
    num_groups: tl.constexpr = (IN_DIM + 31) // 32
    j = tl.arange(0, BLOCK_K // 2)
    kb = k0 // 2 + j  # byte index along the row
    packed = tl.load(
        w_base + w_rows[None, :] * stride_wn + kb[:, None],
        mask=w_mask[None, :] & (kb < num_groups * 16)[:, None],
        other=0,
    ).to(tl.int32)
    kg = k0 // 32 + tl.arange(0, GROUPS)
    sbytes = tl.load(
        s_base + w_rows[None, :] * stride_sn + kg[:, None] * stride_sk,
        mask=w_mask[None, :] & (kg < num_groups)[:, None],
        other=0,
    ).to(tl.int32)  # [GROUPS, BLOCK_N]
    if FOLD:
        row_byte = tl.max(sbytes, axis=0)
        drop = row_byte[None, :] - sbytes  # binades each group sits below the row's largest, >= 0
        scale = tl.where(drop > 126, 0.0, ((127 - drop) << 23).to(tl.float32, bitcast=True))  # 2^-drop
    else:
        row_byte = tl.full([BLOCK_N], 127, tl.int32)  # 2^0: the groups carry their whole scale
        scale = (sbytes << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (GROUPS, 16, BLOCK_N)), (BLOCK_K // 2, BLOCK_N))
    even = tl.where((k0 + 2 * j < IN_DIM)[:, None], _e2m1_to_f32(packed & 0xF) * scale, 0.0)
    odd = tl.where((k0 + 2 * j + 1 < IN_DIM)[:, None], _e2m1_to_f32(packed >> 4) * scale, 0.0)
    return even, odd, (row_byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_native_bytes(
    w_base, w_rows, w_mask, k0, IN_DIM: tl.constexpr, EVEN_K: tl.constexpr, stride_wn, BLOCK_K: tl.constexpr
):
    """MXFP4 rows `w_rows` [BLOCK_N], columns [k0, k0 + BLOCK_K) as `tl.dot_scaled` takes them: packed
    bytes uint8 [BLOCK_N, BLOCK_K/2], low nibble first. Bytes past the row read as 0; nibbles of a
    ragged tail's padding meet activation columns that the caller zeroed, so they add nothing."""
    kb = tl.multiple_of(k0 // 2, BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    if EVEN_K:  # every step inside IN_DIM: no K mask, so the loads vectorize
        return tl.load(w_base + w_rows[:, None] * stride_wn + kb[None, :], mask=w_mask[:, None], other=0)
    num_bytes: tl.constexpr = (IN_DIM + 31) // 32 * 16
    return tl.load(
        w_base + w_rows[:, None] * stride_wn + kb[None, :],
        mask=w_mask[:, None] & (kb < num_bytes)[None, :],
        other=0,
    )


@triton.jit
def _mxfp4_native_scales(
    s_base, w_rows, w_mask, k0, IN_DIM: tl.constexpr, stride_sn, stride_sk, BLOCK_K: tl.constexpr
):
    """E8M0 scales uint8 [BLOCK_N, BLOCK_K/32] of the same tile; groups past the row read as 0."""
    num_groups: tl.constexpr = (IN_DIM + 31) // 32
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    return tl.load(
        s_base + w_rows[:, None] * stride_sn + kg[None, :] * stride_sk,
        mask=w_mask[:, None] & (kg < num_groups)[None, :],
        other=0,
    )


@triton.jit
def _rotate_right(w, R: tl.constexpr):
    """uint32 `w` rotated right by R bits (one funnel shift when compiled)."""
    if R == 0:
        out = w
    else:
        out = (w >> R) | (w << (32 - R))
    return out


@triton.jit
def _mxfp4_word_pair(w, PAIR: tl.constexpr):
    """Codes PAIR and PAIR + 4 of uint32 words `w` (placed by moekit.formats.mxfp4_words.PAIR_ROTATIONS)
    -> bf16 pairs (as uint32) of value * 2^-126: the magnitude bits at 8..6 / 24..22, the sign at
    15 / 31. One rotation and one mask where the pair's bits share a rotation, two otherwise."""
    R_REST: tl.constexpr = _PAIR_ROTATIONS[PAIR][0]
    R_MANTISSA: tl.constexpr = _PAIR_ROTATIONS[PAIR][1]
    if R_REST == R_MANTISSA:
        out = _rotate_right(w, R_REST) & _PAIR_MASK
    else:
        rest = _rotate_right(w, R_REST) & (_PAIR_MASK & ~_MANTISSA_MASK)
        out = rest | (_rotate_right(w, R_MANTISSA) & _MANTISSA_MASK)
    return out


@triton.jit
def _bf16_halves(p, OUT_DTYPE: tl.constexpr):
    """uint32 bf16 pairs [..] -> OUT_DTYPE [.., 2] (low half first). fp32 takes the bits as they are
    (bf16 is the top half of fp32), so the subnormal 0.5 code never meets a conversion that may flush."""
    if OUT_DTYPE == tl.float32:
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(OUT_DTYPE)
        hi = (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(OUT_DTYPE)
    return tl.join(lo, hi)


@triton.jit
def _mul_bf16x2(p, f):
    """bf16 pairs p * f, both packed in uint32: one `mul.rn.bf16x2` per pair (compiled path only)."""
    return tl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, f], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def _mxfp4_words_tile(
    w_base,
    w_blocks,
    w_block_mask,
    scales,
    k0,
    IN_DIM: tl.constexpr,
    EVEN_K: tl.constexpr,
    stride_wn,
    NATIVE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[rows, k0:k0+BLOCK_K] in OUT_DTYPE [ROWS, BLOCK_K] from MXFP4_MMA_WORDS, scales applied.

    `w_blocks` [ROWS/16]: the tile's 16-row blocks (global block index; `w_block_mask` false past N).
    `scales` uint8 [ROWS, BLOCK_K/32] of the same rows. NATIVE (bf16, compiled) scales the packed pairs
    with bf16x2 multiplies in the words' own register layout, so the reshapes that follow only rename
    registers for the MMA; otherwise the pairs are widened to fp32 and scaled there.
    """
    RB: tl.constexpr = ROWS // 16
    C: tl.constexpr = BLOCK_K // 16
    G: tl.constexpr = BLOCK_K // 32
    NUM_CHUNKS: tl.constexpr = ((IN_DIM + 31) // 32 * 2 + _RUN - 1) // _RUN * _RUN  # padded to whole runs
    chunk = k0 // 16 + tl.arange(0, C)
    lane = tl.arange(0, 32)  # (g, q) of the MMA fragment: 8 row pairs x 4 column pairs
    in_run = (chunk // _RUN) * (32 * _RUN) + chunk % _RUN
    ptrs = w_base + w_blocks[:, None, None] * stride_wn + lane[None, :, None] * _RUN + in_run[None, None, :]
    if EVEN_K:  # every step inside IN_DIM: every chunk it reads is stored
        words = tl.load(ptrs, mask=w_block_mask[:, None, None], other=0)
    else:
        words = tl.load(ptrs, mask=w_block_mask[:, None, None] & (chunk < NUM_CHUNKS)[None, None, :], other=0)
    words = tl.reshape(words, (RB * 32, C)).to(tl.uint32, bitcast=True)
    p0 = _mxfp4_word_pair(words, 0)  # row g,     columns 2q, 2q + 1
    p1 = _mxfp4_word_pair(words, 1)  # row g + 8
    p2 = _mxfp4_word_pair(words, 2)  # row g,     columns 2q + 8, 2q + 9
    p3 = _mxfp4_word_pair(words, 3)  # row g + 8
    # Factor 2^(s - 1) = scale 2^(s - 127) times the 2^126 the bit placement left out (s <= 128).
    exponent = scales.to(tl.uint32) + 126
    if NATIVE:
        f = (exponent << 7) | (exponent << 23)  # bf16 pair
        f = tl.permute(tl.reshape(f, (RB, 2, 8, G)), (0, 2, 3, 1))  # [rb, g, group, row half]
        f_top, f_bottom = tl.split(f)  # rows g and g + 8: [RB, 8, G]
        f_top = tl.reshape(tl.broadcast_to(f_top[:, :, None, :, None], (RB, 8, 4, G, 2)), (RB * 32, C))
        f_bottom = tl.reshape(tl.broadcast_to(f_bottom[:, :, None, :, None], (RB, 8, 4, G, 2)), (RB * 32, C))
        p0 = _mul_bf16x2(p0, f_top)
        p1 = _mul_bf16x2(p1, f_bottom)
        p2 = _mul_bf16x2(p2, f_top)
        p3 = _mul_bf16x2(p3, f_bottom)
        CODE_DTYPE: tl.constexpr = OUT_DTYPE
    else:
        CODE_DTYPE: tl.constexpr = tl.float32
    t = tl.join(
        tl.join(_bf16_halves(p0, CODE_DTYPE), _bf16_halves(p1, CODE_DTYPE)),
        tl.join(_bf16_halves(p2, CODE_DTYPE), _bf16_halves(p3, CODE_DTYPE)),
    )  # [(rb, g, q), c, odd column, row half, column half]
    t = tl.reshape(t, (RB, 8, 4, C, 2, 2, 2))
    t = tl.permute(t, (0, 5, 1, 3, 6, 2, 4))  # [rb, row half, g, c, column half, q, odd column]
    w = tl.reshape(t, (ROWS, BLOCK_K))
    if not NATIVE:
        f32 = (exponent << 23).to(tl.float32, bitcast=True)  # [ROWS, G]
        f32 = tl.reshape(tl.broadcast_to(f32[:, :, None], (ROWS, G, 32)), (ROWS, BLOCK_K))
        w = (w * f32).to(OUT_DTYPE)
    return w
