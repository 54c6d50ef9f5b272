"""MXFP4 format tests: bit-exact tier (codes, scale bytes, ties, nibble order, padding), properties of
the two scale rules, error handling, an SQNR floor and a CPU speed guard for dequantization."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.errors import DTypeError, FormatError, ShapeError
from moekit.formats import (
    DEFAULT_SCALE_RULE,
    FP4_E2M1_VALUES,
    MXFP4_BLOCK,
    Mxfp4ScaleRule,
    Mxfp4Weight,
    check_mxfp4_scales,
    decode_e8m0,
    dequantize_mxfp4,
    mxfp4_groups,
    quantize_mxfp4,
)

RULES = list(Mxfp4ScaleRule)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pack(codes: list[int]) -> torch.Tensor:
    """32 codes -> 16 bytes, low nibble = even element (written out independently of the module)."""
    return torch.tensor([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)], dtype=torch.uint8)


def _unpack(blocks: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] bytes -> [..., G * 32] codes."""
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1)
    return codes.reshape(*blocks.shape[:-2], -1)


def _ref_code(q: float) -> int:
    """Oracle: nearest E2M1 code by brute force over the grid, exact ties to the even code, saturate."""
    mag = min(abs(q), 6.0)
    dists = [abs(mag - g) for g in GRID]
    best = min(dists)
    code = min(i for i, d in enumerate(dists) if d == best and (dists.count(best) == 1 or i % 2 == 0))
    return code | (8 if math.copysign(1.0, q) < 0 else 0)


def _half_step(mag: float) -> float:
    """Half the E2M1 grid spacing around a magnitude <= 6: spacing 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6]."""
    return 0.25 if mag <= 2 else 0.5 if mag <= 4 else 1.0


def _roundtrip(x: torch.Tensor, rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE) -> torch.Tensor:
    w = quantize_mxfp4(x, rule=rule)
    return dequantize_mxfp4(w.blocks, w.scales, in_dim=w.in_dim)


# ----------------------------------------------------------------------------------------------------
# Bit-exact tier
# ----------------------------------------------------------------------------------------------------


def test_fp4_table_is_the_spec():
    assert FP4_E2M1_VALUES[:8] == GRID
    assert FP4_E2M1_VALUES[8:] == tuple(-v for v in GRID)
    assert math.copysign(1.0, FP4_E2M1_VALUES[8]) == -1.0  # code 8 is -0.0, not +0.0
    assert MXFP4_BLOCK == 32


def test_every_fp4_code_decodes_to_the_table():
    # One block holding codes 0..15 twice; scale byte 127 = 2^0, so values are the table itself.
    codes = list(range(16)) * 2
    out = dequantize_mxfp4(_pack(codes)[None, None], torch.tensor([[127]], dtype=torch.uint8), in_dim=32)
    expected = torch.tensor([FP4_E2M1_VALUES[c] for c in codes])
    assert torch.equal(out[0], expected)
    assert torch.equal(torch.signbit(out[0]), torch.signbit(expected))  # -0.0 stays -0.0


def test_every_e8m0_byte_decodes_exactly():
    out = decode_e8m0(torch.arange(256, dtype=torch.uint8))
    assert out.dtype == torch.float32
    for byte in range(255):
        # math.ldexp is exact; 2^-127 (byte 0) is an fp32 subnormal and must not flush to 0.
        assert out[byte].item() == math.ldexp(1.0, byte - 127), byte
    assert math.isnan(out[255].item())


def test_nibble_order_low_is_even_element():
    # Byte 0x72: low nibble 2 (1.0) is element 0, high nibble 7 (6.0) is element 1.
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72
    out = dequantize_mxfp4(blocks, torch.tensor([[127]], dtype=torch.uint8), in_dim=32)
    assert out[0, :2].tolist() == [1.0, 6.0]
    # And the quantizer writes the same byte: [1.0, 6.0] has amax 6 -> scale 1 under both rules.
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.0, 6.0])
    for rule in RULES:
        w = quantize_mxfp4(x, rule=rule)
        assert w.blocks[0, 0, 0].item() == 0x72
        assert w.scales.item() == 127


@pytest.mark.parametrize("rule", RULES)
def test_dequant_then_quant_reproduces_every_code_and_scale_byte(rule):
    # Every block holds all 16 codes twice, so its amax is 6 * scale and both rules recover the scale:
    # FLOOR: floor(log2(6 * 2^s)) - 2 = s; ROUND_UP: ceil(log2(6 * 2^s / 6)) = s. Bytes 0..252: from
    # 253 on, 6 * 2^(byte - 127) overflows fp32. Byte 0 exercises the fp32-subnormal scale 2^-127.
    codes = list(range(16)) * 2
    scale_bytes = torch.arange(253, dtype=torch.uint8)
    blocks = _pack(codes).expand(253, 16).reshape(253, 1, 16).contiguous()
    scales = scale_bytes.reshape(253, 1)
    x = dequantize_mxfp4(blocks, scales, in_dim=32)
    assert torch.isfinite(x).all()
    w = quantize_mxfp4(x, rule=rule)
    assert torch.equal(w.blocks, blocks)
    assert torch.equal(w.scales, scales)


# Scale 1 is forced by putting 6.0 in the block: amax = 6 gives 2^(floor(log2 6) - 2) = 2^0 (FLOOR)
# and 2^ceil(log2(6/6)) = 2^0 (ROUND_UP). Then each value is rounded on the grid itself.
TIES = [
    (0.25, 0),  # tie 0 | 0.5 -> 0 (even code 0)
    (0.75, 2),  # tie 0.5 | 1 -> 1.0 (code 2)
    (1.25, 2),  # tie 1 | 1.5 -> 1.0
    (1.75, 4),  # tie 1.5 | 2 -> 2.0 (code 4)
    (2.5, 4),  # tie 2 | 3 -> 2.0
    (3.5, 6),  # tie 3 | 4 -> 4.0 (code 6)
    (5.0, 6),  # tie 4 | 6 -> 4.0
    (0.2500001, 1),  # just above a tie -> up (not a tie; checks the tie rule is exact, not a slack)
    (4.9999995, 6),  # just below the 4 | 6 midpoint -> 4.0
    (5.0000005, 7),  # just above it -> 6.0
    (0.1, 0),  # below 0.25 -> 0
    (-0.25, 8),  # negative ties mirror: -0.25 -> -0 (code 8, sign kept as an IEEE cast does)
    (-0.75, 10),
    (-1.25, 10),
    (-1.75, 12),
    (-2.5, 12),
    (-3.5, 14),
    (-5.0, 14),
    (-0.1, 8),  # a negative that rounds to zero keeps its sign: -0
    (-0.0, 8),  # -0.0 input -> code 8
]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(("value", "code"), TIES)
def test_hand_worked_ties_with_scale_one(rule, value, code):
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0
    x[0, 1] = value
    w = quantize_mxfp4(x, rule=rule)
    assert w.scales.item() == 127
    assert _unpack(w.blocks)[0, 1].item() == code


def test_floor_rule_saturates_and_round_up_does_not():
    # Block [7.5, 1.0, 0...]. FLOOR: floor(log2 7.5) = 2, scale 2^(2-2) = 1 (byte 127);
    # 7.5 / 1 = 7.5 > 6 saturates to 6 (code 7), 1.0 stays 1.0 (code 2).
    # ROUND_UP: ceil(log2(7.5/6)) = ceil(0.32) = 1, scale 2 (byte 128); 7.5/2 = 3.75 -> 4 (code 6,
    # dequant 8.0), 1.0/2 = 0.5 -> code 1 (dequant 1.0).
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([7.5, 1.0])
    floor = quantize_mxfp4(x, rule=Mxfp4ScaleRule.FLOOR)
    assert floor.scales.item() == 127
    assert _unpack(floor.blocks)[0, :2].tolist() == [7, 2]
    assert _roundtrip(x, Mxfp4ScaleRule.FLOOR)[0, :2].tolist() == [6.0, 1.0]
    up = quantize_mxfp4(x, rule=Mxfp4ScaleRule.ROUND_UP)
    assert up.scales.item() == 128
    assert _unpack(up.blocks)[0, :2].tolist() == [6, 1]
    assert _roundtrip(x, Mxfp4ScaleRule.ROUND_UP)[0, :2].tolist() == [8.0, 1.0]
    # Largest FLOOR saturation: amax just under 8 * scale (7.99 -> 6, error 1.99 = 25% of amax).
    x[0, 0] = -7.99
    assert _roundtrip(x, Mxfp4ScaleRule.FLOOR)[0, 0].item() == -6.0


def test_default_rule_is_round_up():
    assert DEFAULT_SCALE_RULE is Mxfp4ScaleRule.ROUND_UP


@pytest.mark.parametrize("rule", RULES)
def test_zero_blocks_get_smallest_scale_and_zero_codes(rule):
    # Row 0 all zeros; row 1 has a zero first block and a nonzero second block (blocks are independent).
    x = torch.zeros(2, 64)
    x[1, 40] = 3.0
    w = quantize_mxfp4(x, rule=rule)
    assert w.scales[0].tolist() == [0, 0]  # 0x00 = 2^-127, the smallest legal scale
    assert w.scales[1, 0].item() == 0
    assert w.scales[1, 1].item() != 0
    assert (w.blocks[0] == 0).all() and (w.blocks[1, 0] == 0).all()
    assert torch.equal(dequantize_mxfp4(w.blocks, w.scales, in_dim=64), x)


# in_dim -> (G, valid elements in the last block)
RAGGED = [
    (1, 1, 1),  # single element: 31 padding elements
    (32, 1, 32),  # exact block, no padding
    (33, 2, 1),  # one element into a second block
    (70, 3, 6),  # several blocks, short tail
    (200, 7, 8),  # a non-power-of-two size
    (2880, 90, 32),  # gpt-oss H and I: multiple of 32, G = 90
]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(("in_dim", "groups", "tail"), RAGGED)
def test_ragged_tails(rule, in_dim, groups, tail):
    assert mxfp4_groups(in_dim) == groups
    torch.manual_seed(in_dim)
    # Negative values near the end: padding must neither raise the tail block's amax nor get a sign.
    x = torch.randn(3, in_dim) * 4 - 1
    w = quantize_mxfp4(x, rule=rule)
    assert w.blocks.shape == (3, groups, 16) and w.scales.shape == (3, groups) and w.in_dim == in_dim
    codes = _unpack(w.blocks)
    assert (codes[:, in_dim:] == 0).all()  # padding codes are +0
    # The tail block's scale equals the one computed from the valid elements alone.
    tail_only = torch.zeros(3, 32)
    tail_only[:, :tail] = x[:, in_dim - tail :]
    assert torch.equal(quantize_mxfp4(tail_only, rule=rule).scales[:, 0], w.scales[:, -1])
    out = dequantize_mxfp4(w.blocks, w.scales, in_dim=in_dim)
    assert out.shape == (3, in_dim) and out.is_contiguous()


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-1.0, max_value=1.0, width=32), min_size=32, max_size=32),
    exponent=st.integers(min_value=-140, max_value=120),
    rule=st.sampled_from(RULES),
)
def test_rules_against_oracle_and_bounds(values, exponent, rule):
    # Random blocks at magnitudes from fp32 subnormals to 2^120 (both E8M0 clamp ends nearby).
    x = (torch.tensor(values, dtype=torch.float64) * 2.0**exponent).to(torch.float32)[None]
    w = quantize_mxfp4(x, rule=rule)
    e = w.scales.item() - 127
    assert w.scales.item() != 0xFF
    scale = 2.0**e
    amax = x.abs().max().item()
    qs = [v / scale for v in x[0].double().tolist()]  # exact in float64 (power-of-two scale)
    assert _unpack(w.blocks)[0].tolist() == [_ref_code(q) for q in qs]
    out = dequantize_mxfp4(w.blocks, w.scales, in_dim=32)[0].double().tolist()
    if amax == 0:
        assert e == -127
        return
    qmax = amax / scale
    if rule is Mxfp4ScaleRule.ROUND_UP:
        assert qmax <= 6.0  # never clips
        assert e == -127 or qmax > 3.0  # and it is the smallest such power of two
        for v, q, d in zip(x[0].tolist(), qs, out, strict=True):
            assert abs(d - v) <= _half_step(abs(q)) * scale
            assert abs(d) <= 6.0 * scale < 2.0 * amax or e == -127
    else:
        assert e == -127 or 4.0 <= qmax < 8.0  # amax lands in E2M1's top binade
        for v, q, d in zip(x[0].tolist(), qs, out, strict=True):
            bound = _half_step(abs(q)) if abs(q) <= 6 else abs(q) - 6.0  # saturated: error q - 6
            assert abs(d - v) <= bound * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_dtypes_and_leading_dims(dtype):
    # [E, N, in_dim] with E = 3 must equal per-expert quantization; output dtype is a cast of fp32.
    torch.manual_seed(0)
    x = torch.randn(3, 5, 70)
    w = quantize_mxfp4(x)
    assert w.blocks.shape == (3, 5, 3, 16)
    for e in range(3):
        we = quantize_mxfp4(x[e])
        assert torch.equal(we.blocks, w.blocks[e]) and torch.equal(we.scales, w.scales[e])
    out = dequantize_mxfp4(w.blocks, w.scales, in_dim=70, dtype=dtype)
    assert out.dtype == dtype
    assert torch.equal(out, dequantize_mxfp4(w.blocks, w.scales, in_dim=70).to(dtype))


def test_bf16_input_is_accepted():
    # Checkpoint weights are usually bf16; they convert to fp32 exactly.
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = quantize_mxfp4(x)
    assert torch.equal(w.blocks, quantize_mxfp4(x.float()).blocks)


# ----------------------------------------------------------------------------------------------------
# Invalid data and inputs
# ----------------------------------------------------------------------------------------------------


def test_nan_scale_byte_decodes_to_nan_and_is_reported():
    blocks = torch.full((2, 3, 16), 0x22, dtype=torch.uint8)
    scales = torch.full((2, 3), 127, dtype=torch.uint8)
    scales[1, 2] = 0xFF
    out = dequantize_mxfp4(blocks, scales, in_dim=96)
    assert torch.isnan(out[1, 64:]).all() and not torch.isnan(out[:, :64]).any()  # only that block
    check_mxfp4_scales(scales[:1], name="ok")  # clean scales pass
    with pytest.raises(FormatError, match=r"mlp1_weight\.scales: 1 of 6 .*0xFF.*\(1, 2\)"):
        check_mxfp4_scales(scales, name="mlp1_weight.scales")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_raises(bad):
    # NaN and both infinities: E2M1 has no Inf/NaN, and one would poison the block's scale.
    x = torch.ones(2, 40)
    x[1, 37] = bad
    with pytest.raises(FormatError, match=r"1 of 80 .*\(1, 37\)"):
        quantize_mxfp4(x)


def test_float64_overflowing_fp32_raises():
    # 1e300 is finite in float64 but Inf once converted to the fp32 the quantizer works in.
    with pytest.raises(FormatError, match="not finite"):
        quantize_mxfp4(torch.full((1, 32), 1e300, dtype=torch.float64))


def test_invalid_containers_are_refused():
    blocks = torch.zeros(4, 3, 16, dtype=torch.uint8)
    scales = torch.zeros(4, 3, dtype=torch.uint8)
    Mxfp4Weight(blocks=blocks, scales=scales, in_dim=70)  # G = 3 covers 65..96
    with pytest.raises(ShapeError, match=r"G=3 .*in_dim=100 needs G=ceil\(100/32\)=4"):
        Mxfp4Weight(blocks=blocks, scales=scales, in_dim=100)
    with pytest.raises(ShapeError, match="G, 16"):
        Mxfp4Weight(blocks=blocks.reshape(4, 48), scales=scales, in_dim=70)
    with pytest.raises(ShapeError, match="blocks.shape"):
        Mxfp4Weight(blocks=blocks, scales=scales[:, :2], in_dim=70)
    with pytest.raises(DTypeError, match="uint8"):
        Mxfp4Weight(blocks=blocks.to(torch.int8), scales=scales, in_dim=70)
    with pytest.raises(DTypeError, match="uint8"):
        decode_e8m0(scales.float())
    with pytest.raises(DTypeError, match="floating-point"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ShapeError, match="in_dim"):
        quantize_mxfp4(torch.ones(32))
    with pytest.raises(ShapeError, match="positive int"):
        mxfp4_groups(0)
    with pytest.raises(FormatError, match="Mxfp4ScaleRule"):
        quantize_mxfp4(torch.ones(1, 32), rule="floor")


# ----------------------------------------------------------------------------------------------------
# Lossy round trip and speed
# ----------------------------------------------------------------------------------------------------


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 10 * math.log10(x.double().pow(2).sum().item() / (x.double() - y.double()).pow(2).sum().item())


@pytest.mark.parametrize("rule", RULES)
def test_sqnr_floor_on_gaussian(rule):
    # Measured on torch.randn(256, 2880), seed 0: FLOOR 18.79 dB, ROUND_UP 18.75 dB. Floor 17.5 dB.
    torch.manual_seed(0)
    x = torch.randn(256, 2880)
    assert _sqnr_db(x, _roundtrip(x, rule)) > 17.5


def test_dequantize_gpt_oss_expert_is_fast():
    # One gpt-oss w13 expert: N = 2I = 5760 rows, G = 2880/32 = 90. Measured ~0.12 s on a 2-core CPU
    # (first call up to ~0.35 s while pages fault in); guard at 1 s, best of two calls.
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (5760, 90, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (5760, 90), dtype=torch.uint8, generator=gen)
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        out = dequantize_mxfp4(blocks, scales, in_dim=2880, dtype=torch.bfloat16)
        best = min(best, time.perf_counter() - start)
    assert out.shape == (5760, 2880)
    assert best < 1.0, f"dequantizing one gpt-oss expert took {best:.3f} s"


# ---------------------------------------------------------------------------------------------------------
# MXFP4_MMA_WORDS: the load-time arrangement the Triton kernel decodes into MMA registers
# ---------------------------------------------------------------------------------------------------------
def test_mma_words_pack_a_slice_of_experts_at_a_time_as_all_at_once(monkeypatch):
    from moekit.formats import mxfp4_words

    gen = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (2, 5, 32, 3, 16), generator=gen, dtype=torch.uint8)  # two lead dims
    whole = mxfp4_words._pack_mma_words(blocks)
    # slices of 3 experts of the 10 (the last slice short), and of one: the same words in the same places
    for experts in (3, 1):
        monkeypatch.setattr(mxfp4_words, "PACK_CHUNK_BYTES", experts * 32 * 3 * 16)
        assert torch.equal(mxfp4_words.pack_mma_words(blocks), whole)
    assert torch.equal(mxfp4_words.pack_mma_words(blocks[0, 0]), whole[0, 0])  # no lead dimension


def test_mma_words_round_trip_and_element_positions():
    from moekit.formats.mxfp4_words import BIT_POSITIONS, pack_mma_words, unpack_mma_words

    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 32, 5, 16), generator=gen, dtype=torch.uint8)
    words = pack_mma_words(blocks)
    # 10 chunks in 2 runs of 8, the last 6 words of the second run padding (zero codes)
    assert words.dtype == torch.int32 and tuple(words.shape) == (3, 2, 2, 8, 4, 8)
    assert words.is_contiguous() and not words[:, :, 1, :, :, 2:].any()
    assert torch.equal(unpack_mma_words(words, num_groups=5), blocks)
    with pytest.raises(ShapeError, match="groups"):
        unpack_mma_words(words, num_groups=9)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).reshape(3, 32, 10, 16)  # [E, N, chunk, 16]
    # Word [rb, c // 8, g, q, c % 8], slot j: row 16rb + g + 8*(j % 2), column 16c + 2q + 8*(j % 4 // 2)
    # + j // 4; code bit i of slot j at word bit BIT_POSITIONS[j][i].
    for e, row, col in [(0, 0, 0), (1, 9, 17), (2, 31, 159), (0, 24, 90), (2, 15, 8)]:
        rb, r = divmod(row, 16)
        half_r, g = divmod(r, 8)
        c, k = divmod(col, 16)
        half_c, k = divmod(k, 8)
        q, odd = divmod(k, 2)
        j = half_r + 2 * half_c + 4 * odd
        word = int(words[e, rb, c // 8, g, q, c % 8]) & 0xFFFFFFFF
        code = sum(((word >> p) & 1) << i for i, p in enumerate(BIT_POSITIONS[j]))
        assert code == int(codes[e, row, c, col % 16])


def test_mma_word_rotations_decode_every_code_of_every_slot():
    """Rotating a word right by its pair's rotations and masking (what `_mxfp4_word_pair` does) gives,
    in each bf16 half, the E2M1 value times 2^-126 for every code in every slot."""
    from moekit.formats.mxfp4_words import BIT_POSITIONS, MANTISSA_MASK, PAIR_MASK, PAIR_ROTATIONS

    def rotate_right(w: int, r: int) -> int:
        return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for slot in range(8):
        pair, half = slot % 4, slot // 4
        for code in range(16):
            word = sum(((code >> i) & 1) << p for i, p in enumerate(BIT_POSITIONS[slot]))
            r_rest, r_mantissa = PAIR_ROTATIONS[pair]
            bits = (rotate_right(word, r_rest) & PAIR_MASK & ~MANTISSA_MASK) | (
                rotate_right(word, r_mantissa) & MANTISSA_MASK
            )
            assert bits & ~(0xFFFF << (16 * half)) == 0  # nothing lands in the other slot's half
            as_bf16 = torch.tensor([(bits >> (16 * half)) << 16], dtype=torch.int64).to(torch.int32)
            value = float(as_bf16.view(torch.float32)) * 2.0**126
            assert value == (-1) ** (code >> 3) * e2m1[code & 7], (slot, code, value)


def test_mma_words_refuse_what_they_cannot_hold():
    from moekit.formats.mxfp4_words import fits_mma_words, pack_mma_words

    with pytest.raises(ShapeError, match="N % 16"):
        pack_mma_words(torch.zeros(2, 24, 3, 16, dtype=torch.uint8))
    assert fits_mma_words(24, torch.zeros(24, 3, dtype=torch.uint8)) is not None
    assert "129" in fits_mma_words(32, torch.full((32, 3), 129, dtype=torch.uint8))
    assert fits_mma_words(32, torch.full((32, 3), 128, dtype=torch.uint8)) is None
