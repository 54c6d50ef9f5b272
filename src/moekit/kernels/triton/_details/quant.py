"""FP8 row quantization of activations on the device (W8A8), bit for bit as `moekit.formats`.

Data flow: rows [R, C] (x before GEMM1, h before GEMM2) (* the router weight, INPUT placement) -> per
row, or per 1x128 group: amax -> scale = max(amax / 448, tiny) -> codes rounded to E4M3 nearest-even
-> float8_e4m3fn [R, C] + fp32 scales [R, G]. Host side: `quantize.quantize_rows`. GEMM1 quantizes h per
group in its own epilogue when its tile is whole groups (`_fp8_group_codes`).
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.pdl import _pdl_prologue

_FP8_MAX = tl.constexpr(448.0)
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # moekit.formats.fp8's floor for amax / 448


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
def _row_values(src_ptr, row, stride_src, cols, mask, mult, HAS_ROW_MULT: tl.constexpr):
    """Row `row` of `src` at `cols` in fp32 (0 where not `mask`), times the row's multiplier if it has one."""
    v = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROW_MULT:
        v = v * mult
    return v


@triton.jit
def _row_amax(
    src_ptr, row, stride_src, mult, NUM_COLS: tl.constexpr, HAS_ROW_MULT: tl.constexpr, BLOCK: tl.constexpr
):
    """max |value| of row `row` of `src` (times its multiplier), BLOCK columns a step."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    # Loop bounds are constexpr: sizes H and I are fixed per model, and the Triton interpreter cannot
    # loop over runtime bounds with numpy 2.
    for c in range(0, NUM_COLS, BLOCK):
        cols = c + offs
        amax = tl.maximum(
            amax, tl.abs(_row_values(src_ptr, row, stride_src, cols, cols < NUM_COLS, mult, HAS_ROW_MULT))
        )
    return tl.max(amax, axis=0)


@triton.jit
def _quant_fp8_rows(
    src_ptr,  # [R, C] float rows
    row_mult_ptr,  # fp32 [R] multiplier applied before quantizing (router weight, INPUT placement) or None
    dst_ptr,  # float8_e4m3fn [R, C]
    scale_ptr,  # fp32 [R, 1]
    NUM_COLS: tl.constexpr,  # C
    stride_src,
    stride_dst,
    stride_scale,
    HAS_ROW_MULT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
    sorted_pairs_ptr=None,  # int32 [R] or None: rows holding num_pairs (padding) are left alone
    num_pairs=0,
    row_amax_ptr=None,  # fp32 [R] or None: each row's max |value|, already known (one pass, not two)
):
    """One program per row (per token): scale = max(amax / 448, tiny) (1 if amax == 0), as moekit.formats."""
    _pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    if sorted_pairs_ptr is not None:
        if tl.load(sorted_pairs_ptr + row) >= num_pairs:
            return
    offs = tl.arange(0, BLOCK)
    mult = 1.0
    if HAS_ROW_MULT:
        mult = tl.load(row_mult_ptr + row)
    if row_amax_ptr is not None:
        amax = tl.load(row_amax_ptr + row)
    else:
        amax = _row_amax(src_ptr, row, stride_src, mult, NUM_COLS, HAS_ROW_MULT, BLOCK)
    scale = _fp8_scale(amax)
    for c in range(0, NUM_COLS, BLOCK):
        cols = c + offs
        mask = cols < NUM_COLS
        v = _row_values(src_ptr, row, stride_src, cols, mask, mult, HAS_ROW_MULT)
        tl.store(dst_ptr + row * stride_dst + cols, _fp8_codes(v, scale), mask=mask)
    tl.store(scale_ptr + row * stride_scale, scale)


@triton.jit
def _quant_fp8_groups(
    src_ptr,
    row_mult_ptr,
    dst_ptr,
    scale_ptr,
    NUM_COLS: tl.constexpr,
    stride_src,
    stride_dst,
    stride_scale,
    HAS_ROW_MULT: tl.constexpr,
    GROUPS: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """Per 1x128 group, as `_quant_fp8_rows` per token: program (row, g) quantizes the row's groups
    g * GROUPS onward as one [GROUPS, 128] tile, loaded once (a program per group moves 128 values, one
    a thread: too little work to keep HBM busy)."""
    _pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = cols < NUM_COLS
    mult = tl.load(row_mult_ptr + row) if HAS_ROW_MULT else 1.0
    v = _row_values(src_ptr, row, stride_src, cols, mask, mult, HAS_ROW_MULT)
    codes, scale = _fp8_group_codes(v)
    tl.store(dst_ptr + row * stride_dst + cols, codes, mask=mask)
    tl.store(scale_ptr + row * stride_scale + groups, scale, mask=groups * 128 < NUM_COLS)


@triton.jit
def _quant_fp8_groups_sorted(
    src_ptr,  # [T, C] float rows (tokens)
    pair_expert_ptr,  # int32 [T*K]: local expert of each pair, -1 if dropped
    pair_rows_ptr,  # int32 [T*K]: sorted row of each kept pair
    dst_ptr,  # float8_e4m3fn [R, C]
    scale_ptr,  # fp32 [R, G]
    NUM_COLS: tl.constexpr,
    stride_src,
    stride_dst,
    stride_scale,
    TOP_K: tl.constexpr,
    GROUPS: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
    GROUP_COLS: tl.constexpr = 128,  # 1x128 groups; per token: one group of a power of two >= C columns
):
    """`_quant_fp8_groups` of token t (program (t, g)), stored into the sorted row of each of its kept
    pairs: the grouped GEMM then reads its rows whole (TMA), and each token is read and quantized once.
    Padding rows are not written: a row's products never reach another row, and no kernel stores them.
    With GROUP_COLS >= C and GROUPS 1, one scale a token (`_quant_fp8_rows`' codes and scale)."""
    _pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_COLS + tl.arange(0, GROUP_COLS)[None, :]
    mask = cols < NUM_COLS
    v = tl.load(src_ptr + token * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    codes, scale = _fp8_group_codes(v)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        kept = tl.load(pair_expert_ptr + pair) >= 0
        row = tl.load(pair_rows_ptr + pair, mask=kept, other=0).to(tl.int64)
        tl.store(dst_ptr + row * stride_dst + cols, codes, mask=mask & kept)
        tl.store(scale_ptr + row * stride_scale + groups, scale, mask=(groups * GROUP_COLS < NUM_COLS) & kept)


@triton.jit
def _fp8_group_codes(v):
    """fp32 [R, G] (one group a row; zeros where a row has no value) -> (float8_e4m3fn codes
    [R, G], fp32 scales [R]) exactly as moekit.formats: scale = max(amax / 448, tiny), 1 if amax == 0.
    Shared by the quantization pass and GEMM1's epilogue (`gemm._moe_gemm1` with QUANT_H)."""
    scale = _fp8_scale(tl.max(tl.abs(v), axis=1))
    return _fp8_codes(v, scale[:, None]), scale


@triton.jit
def _fp8_scale(amax):
    """max(amax / 448, tiny), or 1 where amax == 0: moekit.formats' activation scale."""
    # div_rn: the GPU's default fp32 division is approximate; the reference divides exactly.
    scale = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FP32_TINY)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def _fp8_codes(v, scale):
    """float8_e4m3fn codes of v / scale, clamped to +-448 and rounded to nearest-even."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -_FP8_MAX), _FP8_MAX)
    return _round_to_e4m3(q).to(tl.float8e4nv)
