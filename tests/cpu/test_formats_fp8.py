"""FP8 E4M3 format tests: scale shapes per granularity (ragged 128 blocks included), exact round
trips of representable values, a per-element error bound, zero groups, saturation, activations per
token and per 1x128 group, error handling and SQNR floors."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.errors import DTypeError, FormatError, ShapeError
from moekit.formats import (
    FP8_E4M3_MAX,
    Fp8Activation,
    Fp8Weight,
    dequantize_fp8_activation,
    dequantize_fp8_weight,
    fp8_weight_scale_shape,
    quantize_fp8_activation,
    quantize_fp8_weight,
)
from moekit.spec import ActivationQuant, Fp8Scale

GRANULARITIES = list(Fp8Scale)
ACT_QUANTS = [ActivationQuant.FP8_PER_TOKEN, ActivationQuant.FP8_PER_GROUP_128]


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 10 * math.log10(x.double().pow(2).sum().item() / (x.double() - y.double()).pow(2).sum().item())


def _expand(scale: torch.Tensor, n: int, k: int, granularity: Fp8Scale) -> torch.Tensor:
    """Independent expansion of a weight scale to [..., n, k] (loops over blocks, test sizes only)."""
    lead = scale.shape[: scale.ndim - {Fp8Scale.PER_TENSOR: 0, Fp8Scale.PER_CHANNEL: 1}.get(granularity, 2)]
    out = torch.empty(*lead, n, k)
    if granularity is Fp8Scale.PER_TENSOR:
        out[...] = scale[..., None, None]
    elif granularity is Fp8Scale.PER_CHANNEL:
        out[...] = scale[..., None]
    else:
        for i in range(scale.shape[-2]):
            for j in range(scale.shape[-1]):
                out[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = scale[..., i, j, None, None]
    return out


def _error_bound(w: torch.Tensor, full_scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequant(quant(w)) - w|.

    E4M3 has 3 mantissa bits: in a normal binade [2^m, 2^(m+1)) the spacing is 2^(m-3), so rounding to
    nearest errs by at most 2^(m-4) <= 2^-4 * |w / scale|. Below the smallest normal 2^-6 the spacing is
    the subnormal step 2^-9, so at most 2^-10. Both scaled back by `scale`, plus 2^-20 relative slack
    for the fp32 division and multiplication. Since |w| <= amax = 448 * scale, this is also within
    2^-4 of the group's range 448 * scale.
    """
    return 2.0**-4 * w.abs() + 2.0**-10 * full_scale + 2.0**-20 * w.abs()


# (lead, n, k, granularity, expected scale shape)
SCALE_SHAPES = [
    ((8,), 256, 512, Fp8Scale.PER_TENSOR, (8,)),  # one scale per expert
    ((), 256, 512, Fp8Scale.PER_TENSOR, ()),  # a single matrix: 0-d scale
    ((8,), 256, 512, Fp8Scale.PER_CHANNEL, (8, 256)),  # one per output row
    ((8,), 256, 512, Fp8Scale.BLOCK_128, (8, 2, 4)),  # exact 128 multiples
    ((3,), 200, 330, Fp8Scale.BLOCK_128, (3, 2, 3)),  # ragged in both N and K
    ((), 1, 1, Fp8Scale.BLOCK_128, (1, 1)),  # smaller than one block
    ((256,), 4096, 7168, Fp8Scale.BLOCK_128, (256, 32, 56)),  # DeepSeek-V3 w13 [E, 2I, H]
    ((2, 4), 129, 127, Fp8Scale.BLOCK_128, (2, 4, 2, 1)),  # two leading dims; N one past a block
]


@pytest.mark.parametrize(("lead", "n", "k", "granularity", "want"), SCALE_SHAPES)
def test_scale_shapes(lead, n, k, granularity, want):
    assert fp8_weight_scale_shape(lead=lead, n=n, k=k, granularity=granularity) == want


# (lead, n, k): the quantize/dequantize cases
WEIGHT_SHAPES = [
    ((3,), 200, 330),  # ragged 128 blocks in N and K, three experts
    ((2,), 256, 128),  # exact blocks
    ((), 7, 5),  # one matrix smaller than a block, no leading dims
]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize(("lead", "n", "k"), WEIGHT_SHAPES)
def test_weight_round_trip_error_bound(granularity, lead, n, k):
    torch.manual_seed(n * k)
    # Row magnitudes spread over 2^-8..2^8 so per-channel and block scales differ from per-tensor.
    w = torch.randn(*lead, n, k) * torch.exp2(torch.randint(-8, 9, (*lead, n, 1)).float())
    q = quantize_fp8_weight(w, granularity=granularity)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == w.shape
    assert q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == fp8_weight_scale_shape(lead=lead, n=n, k=k, granularity=granularity)
    full = _expand(q.scale, n, k, granularity)
    assert ((q.data.float() * full - w).abs() <= _error_bound(w, full)).all()
    out = dequantize_fp8_weight(q.data, q.scale, granularity=granularity)
    assert torch.equal(out, q.data.float() * full)
    # Each group's largest element maps to +-448 exactly (scale = amax / 448), i.e. the range is used.
    codes = q.data.float().abs()
    if granularity is Fp8Scale.PER_TENSOR:
        group_max = codes.amax(dim=(-2, -1))
    elif granularity is Fp8Scale.PER_CHANNEL:
        group_max = codes.amax(dim=-1)
    else:
        group_max = torch.stack(
            [
                codes[..., i : i + 128, j : j + 128].amax(dim=(-2, -1))
                for i in range(0, n, 128)
                for j in range(0, k, 128)
            ]
        )
    assert (group_max == FP8_E4M3_MAX).all()


def test_block_scales_are_per_block_amax():
    # Ragged blocks: the scale of block (i, j) is the amax of exactly the rows/cols it covers.
    torch.manual_seed(1)
    w = torch.randn(2, 200, 330)
    q = quantize_fp8_weight(w, granularity=Fp8Scale.BLOCK_128)
    for i, rows in enumerate((slice(0, 128), slice(128, 200))):
        for j, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 330))):
            want = w[:, rows, cols].abs().amax(dim=(-2, -1)) / 448.0
            assert torch.equal(q.scale[:, i, j], want)


def test_representable_values_round_trip_exactly():
    # Every finite e4m3fn value (0x7F and 0xFF are NaN) with amax 448 -> scale 1: bit-exact round trip.
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    w = values.reshape(1, -1)
    assert w.abs().max().item() == 448.0
    for granularity in GRANULARITIES:
        q = quantize_fp8_weight(w, granularity=granularity)
        assert torch.equal(q.data.view(torch.uint8), codes.reshape(1, -1))
        assert torch.equal(dequantize_fp8_weight(q.data, q.scale, granularity=granularity), w)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_zero_groups_get_scale_one_and_decode_to_zero(granularity):
    # Expert 1 is all zero; expert 0 has a zero row 3 and a zero 128x128 block (rows 128.., cols 0..127).
    torch.manual_seed(2)
    w = torch.randn(2, 200, 330)
    w[1] = 0
    w[0, 3] = 0
    w[0, 128:, :128] = 0
    q = quantize_fp8_weight(w, granularity=granularity)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert (q.scale[1] == 1.0).all()
    if granularity is Fp8Scale.PER_CHANNEL:
        assert q.scale[0, 3].item() == 1.0
    if granularity is Fp8Scale.BLOCK_128:
        assert q.scale[0, 1, 0].item() == 1.0
    out = dequantize_fp8_weight(q.data, q.scale, granularity=granularity)
    assert (out[1] == 0).all() and (out[0, 3] == 0).all() and (out[0, 128:, :128] == 0).all()


def test_saturation_never_exceeds_448():
    # amax = 1.0000499486923218: in fp32, amax / (amax / 448) = 448.00003 > 448 (found by search),
    # so the quantizer must clamp before the cast; the result is exactly 448, never NaN.
    amax = torch.tensor(1.0000499486923218)
    assert (amax / (amax / 448.0)).item() > 448.0
    w = torch.tensor([[1.0000499486923218, -1.0000499486923218, 0.5]])
    for granularity in GRANULARITIES:
        q = quantize_fp8_weight(w, granularity=granularity)
        assert q.data.float().tolist()[0][:2] == [448.0, -448.0]
    # Wide dynamic range inside one group: no NaN, nothing beyond 448, tiny values flush towards 0.
    torch.manual_seed(3)
    w = torch.randn(64, 256) * torch.exp2(torch.randint(-30, 30, (64, 256)).float())
    for granularity in GRANULARITIES:
        data = quantize_fp8_weight(w, granularity=granularity).data.float()
        assert not torch.isnan(data).any() and data.abs().max().item() == 448.0


def test_subnormal_amax_keeps_scale_finite():
    # amax 1e-44 (an fp32 subnormal): amax / 448 underflows to 0 in fp32; the scale is floored at the
    # smallest normal fp32 so w / scale stays finite.
    w = torch.full((2, 4), 1e-44)
    q = quantize_fp8_weight(w, granularity=Fp8Scale.PER_TENSOR)
    assert q.scale.item() == torch.finfo(torch.float32).tiny
    assert not torch.isnan(q.data.float()).any()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_weight_sqnr_floor(granularity):
    # Measured on torch.randn(8, 256, 512), seed 0: 31.55 / 31.62 / 31.56 dB (tensor / channel /
    # block). Floor 30 dB.
    torch.manual_seed(0)
    w = torch.randn(8, 256, 512)
    q = quantize_fp8_weight(w, granularity=granularity)
    assert _sqnr_db(w, dequantize_fp8_weight(q.data, q.scale, granularity=granularity)) > 30.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_output_dtype(dtype):
    # bf16/fp16 output is the fp32 dequantization cast once, not a product computed in low precision.
    w = torch.randn(2, 64, 96)
    q = quantize_fp8_weight(w, granularity=Fp8Scale.PER_CHANNEL)
    out = dequantize_fp8_weight(q.data, q.scale, granularity=Fp8Scale.PER_CHANNEL, dtype=dtype)
    ref = dequantize_fp8_weight(q.data, q.scale, granularity=Fp8Scale.PER_CHANNEL)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))


# ----------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------

# (T, H)
ACT_SHAPES = [
    (16, 2880),  # gpt-oss H: 22.5 groups -> ragged last group of 64
    (5, 256),  # exact groups
    (3, 200),  # one full group and a ragged one of 72
    (4, 100),  # H < 128: a single ragged group
    (7, 1),  # H = 1
    (0, 256),  # zero tokens (an expert no token was routed to)
]


@pytest.mark.parametrize("quant", ACT_QUANTS)
@pytest.mark.parametrize(("t", "h"), ACT_SHAPES)
def test_activation_round_trip(quant, t, h):
    torch.manual_seed(t * 1000 + h)
    # Column magnitudes vary over 2^-6..2^6, so per-group scales differ from the per-token one.
    x = torch.randn(t, h) * torch.exp2(torch.randint(-6, 7, (1, h)).float())
    a = quantize_fp8_activation(x, quant=quant)
    groups = 1 if quant is ActivationQuant.FP8_PER_TOKEN else -(-h // 128)
    assert a.data.shape == (t, h) and a.scale.shape == (t, groups) and a.quant is quant
    # Column ranges of each scale: the whole row per token, else [128g, min(128(g+1), H)).
    spans = (
        [(0, h)]
        if quant is ActivationQuant.FP8_PER_TOKEN
        else [(c, min(c + 128, h)) for c in range(0, h, 128)]
    )
    assert len(spans) == groups
    for g, (lo, hi) in enumerate(spans):
        if t:
            assert torch.equal(a.scale[:, g], x[:, lo:hi].abs().amax(dim=1) / 448.0)
    full = torch.cat([a.scale[:, g : g + 1].expand(t, hi - lo) for g, (lo, hi) in enumerate(spans)], dim=1)
    out = dequantize_fp8_activation(a)
    assert torch.equal(out, a.data.float() * full)
    assert ((out - x).abs() <= _error_bound(x, full)).all()


@pytest.mark.parametrize("quant", ACT_QUANTS)
def test_activation_zero_rows(quant):
    # A token whose hidden state is exactly zero (e.g. padding): scale 1.0, decodes to zeros.
    x = torch.randn(3, 300)
    x[1] = 0
    a = quantize_fp8_activation(x, quant=quant)
    assert (a.scale[1] == 1.0).all()
    out = dequantize_fp8_activation(a)
    assert (out[1] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("quant", ACT_QUANTS)
def test_activation_sqnr_floor(quant):
    # Measured on torch.randn(256, 2880), seed 0: per token 31.54 dB, per group 31.80 dB. Floor 30 dB.
    torch.manual_seed(0)
    x = torch.randn(256, 2880)
    a = quantize_fp8_activation(x, quant=quant)
    assert _sqnr_db(x, dequantize_fp8_activation(a)) > 30.0
    assert dequantize_fp8_activation(a, dtype=torch.bfloat16).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------
# Invalid inputs
# ----------------------------------------------------------------------------------------------------


def test_activation_quant_none_is_refused():
    with pytest.raises(FormatError, match="NONE"):
        quantize_fp8_activation(torch.ones(2, 8), quant=ActivationQuant.NONE)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_raises(bad):
    # Each non-finite kind would otherwise become a NaN or Inf scale for its whole group.
    w = torch.ones(2, 3, 5)
    w[1, 2, 4] = bad
    with pytest.raises(FormatError, match=r"1 of 30 .*\(1, 2, 4\)"):
        quantize_fp8_weight(w, granularity=Fp8Scale.BLOCK_128)
    with pytest.raises(FormatError, match=r"\(2, 4\)"):
        quantize_fp8_activation(w[1], quant=ActivationQuant.FP8_PER_TOKEN)


def test_invalid_containers_are_refused():
    data = torch.zeros(3, 200, 330, dtype=torch.float8_e4m3fn)
    Fp8Weight(data=data, scale=torch.ones(3, 2, 3), granularity=Fp8Scale.BLOCK_128)
    with pytest.raises(ShapeError, match=r"must have shape \[3, 2, 3\], got \[3, 1, 2\]"):
        # The floor-divided shape [E, N // 128, K // 128] a ragged checkpoint must not have.
        Fp8Weight(data=data, scale=torch.ones(3, 1, 2), granularity=Fp8Scale.BLOCK_128)
    with pytest.raises(ShapeError, match="PER_CHANNEL"):
        Fp8Weight(data=data, scale=torch.ones(3), granularity=Fp8Scale.PER_CHANNEL)
    with pytest.raises(DTypeError, match="float8_e4m3fn"):
        Fp8Weight(data=data.float(), scale=torch.ones(3), granularity=Fp8Scale.PER_TENSOR)
    with pytest.raises(DTypeError, match="float32"):
        Fp8Weight(data=data, scale=torch.ones(3, dtype=torch.bfloat16), granularity=Fp8Scale.PER_TENSOR)
    with pytest.raises(FormatError, match="Fp8Scale"):
        Fp8Weight(data=data, scale=torch.ones(3), granularity="per_tensor")
    with pytest.raises(FormatError, match="Fp8Scale"):
        quantize_fp8_weight(torch.ones(4, 4), granularity="block")
    with pytest.raises(ShapeError, match="N, K >= 1"):
        quantize_fp8_weight(torch.ones(4), granularity=Fp8Scale.PER_TENSOR)
    with pytest.raises(DTypeError, match="floating-point"):
        quantize_fp8_weight(torch.ones(4, 4, dtype=torch.int64), granularity=Fp8Scale.PER_TENSOR)
    act = torch.zeros(4, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(ShapeError, match=r"\[4, 2\]"):
        Fp8Activation(data=act, scale=torch.ones(4, 1), quant=ActivationQuant.FP8_PER_GROUP_128)
    with pytest.raises(ShapeError, match=r"\[T, H\]"):
        quantize_fp8_activation(torch.ones(2, 3, 4), quant=ActivationQuant.FP8_PER_TOKEN)
