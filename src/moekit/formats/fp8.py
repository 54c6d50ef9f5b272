"""FP8 E4M3 (float8_e4m3fn, max 448) weights and activations with float32 scales.

Data flow (weights, static):
    float w [..., N, K] -> quantize_fp8_weight(granularity) -> Fp8Weight(data float8_e4m3fn [..., N, K],
    scale float32 of fp8_weight_scale_shape(...)) -> dequantize_fp8_weight -> float [..., N, K]
Data flow (activations, dynamic, before a W8A8 GEMM):
    float x [T, H] -> quantize_fp8_activation(quant) -> Fp8Activation(data [T, H], scale [T, 1] per
    token or [T, ceil(H/128)] per 1x128 group) -> dequantize_fp8_activation -> float [T, H]

Scales multiply to dequantize (DeepSeek-V3's `weight_scale_inv` convention): value = data * scale,
scale = amax / 448 per group. Every dimension of a weight before the last two is a leading dim
(experts, usually [E]); blocks of 128x128 and 1x128 groups may be ragged at the edges.
`dequantize_fp8_weight` does not look at scale values or codes (a host sync); loaders call `check_fp8_scales`
and `check_fp8_codes` once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.errors import DeviceError, DTypeError, FormatError, ShapeError
from moekit.spec import ActivationQuant, Fp8Scale

FP8_E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
_BLOCK = 128  # DeepSeek-V3's weight block edge and activation group width
# Floor for amax / 448 so that w / scale stays finite when amax is an fp32 subnormal (amax/448 could
# underflow to 0). Only groups with amax < 448 * 2^-126 (~5e-36) are affected.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_weight_scale_shape(
    *, lead: tuple[int, ...], n: int, k: int, granularity: Fp8Scale
) -> tuple[int, ...]:
    """Scale shape of an FP8 weight [*lead, n, k]: lead, lead+(n,), or lead+(ceil(n/128), ceil(k/128))."""
    lead = tuple(int(d) for d in lead)
    if granularity is Fp8Scale.PER_TENSOR:
        return lead
    if granularity is Fp8Scale.PER_CHANNEL:
        return (*lead, n)
    if granularity is Fp8Scale.BLOCK_128:
        return (*lead, _cdiv(n, _BLOCK), _cdiv(k, _BLOCK))
    raise FormatError(
        f"granularity must be an Fp8Scale ({', '.join(g.name for g in Fp8Scale)}), got {granularity!r}"
    )


def _check_float_input(x: Tensor, *, what: str, shape_doc: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise DTypeError(f"{what} needs a floating-point tensor {shape_doc}, got {got}")
    x32 = x.to(torch.float32)
    if x32.is_cuda and torch.cuda.is_current_stream_capturing():
        return x32  # reading the check's result would synchronize; a captured forward skips it
    finite = torch.isfinite(x32)
    if not bool(finite.all()):
        bad = ~finite
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"{what}: {int(bad.sum())} of {x32.numel()} values are not finite (after conversion to "
            f"float32), first at index {first}: {x32[first].item()!r}; fix or clamp the input before "
            "quantizing (a non-finite value would poison its whole group's scale)"
        )
    return x32


def _scale_from_amax(amax: Tensor) -> Tensor:
    # amax == 0: scale 1.0. Any positive scale decodes the all-zero codes to zeros; 1.0 keeps the
    # scale and its reciprocal finite and is easy to spot in a dump.
    # Divide by a tensor, not a Python scalar: CUDA turns `t / 448.0` into `t * fp32(1/448)`, which
    # differs from true division in the last bit for about half of all values (measured on an H200),
    # and that bit flips FP8 codes of bf16 inputs that sit on a rounding tie. True division everywhere
    # keeps the CPU and GPU references identical and matches the kernels' `div_rn`.
    scale = (amax / torch.full_like(amax, FP8_E4M3_MAX)).clamp_min(_MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _to_fp8(scaled: Tensor) -> Tensor:
    # w / (amax/448) can exceed 448 by an fp32 rounding step. torch 2.13's CPU cast happens to saturate
    # (measured: 1e6 -> 448), but e4m3fn has no Inf and the overflow behaviour of a cast is not part of
    # any contract we rely on, so clamp first. The cast itself rounds to nearest, ties to even.
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def _expand_blocks(scale: Tensor, *, rows: int, cols: int) -> Tensor:
    """[..., ceil(rows/128), ceil(cols/128)] -> [..., rows, cols] (ragged edges cut off)."""
    full = scale.repeat_interleave(_BLOCK, dim=-2).repeat_interleave(_BLOCK, dim=-1)
    return full[..., :rows, :cols]


def _expand_weight_scale(scale: Tensor, *, n: int, k: int, granularity: Fp8Scale) -> Tensor:
    if granularity is Fp8Scale.PER_TENSOR:
        return scale[..., None, None]
    if granularity is Fp8Scale.PER_CHANNEL:
        return scale[..., None]
    return _expand_blocks(scale, rows=n, cols=k)


@dataclass(frozen=True)
class Fp8Weight:
    """FP8 weight codes `data` float8_e4m3fn [..., N, K] and float32 `scale` (multiply to dequantize),
    shaped per `granularity` as `fp8_weight_scale_shape` says."""

    data: Tensor
    scale: Tensor
    granularity: Fp8Scale

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, Fp8Scale):
            raise FormatError(
                f"granularity must be an Fp8Scale ({', '.join(g.name for g in Fp8Scale)}), "
                f"got {self.granularity!r}"
            )
        if not isinstance(self.data, Tensor) or self.data.dtype != FP8_DTYPE:
            got = self.data.dtype if isinstance(self.data, Tensor) else type(self.data).__name__
            raise DTypeError(
                f"FP8 weight data must be {FP8_DTYPE}, got {got}; quantize it with quantize_fp8_weight"
            )
        if not isinstance(self.scale, Tensor) or self.scale.dtype != torch.float32:
            got = self.scale.dtype if isinstance(self.scale, Tensor) else type(self.scale).__name__
            raise DTypeError(f"FP8 weight scale must be float32 (multiply to dequantize), got {got}")
        if self.data.ndim < 2:
            raise ShapeError(f"FP8 weight data must be [..., N, K], got shape {list(self.data.shape)}")
        *lead, n, k = self.data.shape
        want = fp8_weight_scale_shape(lead=tuple(lead), n=n, k=k, granularity=self.granularity)
        if tuple(self.scale.shape) != want:
            raise ShapeError(
                f"FP8 {self.granularity.name} scale for data {list(self.data.shape)} must have shape "
                f"{list(want)}, got {list(self.scale.shape)}; check the granularity (a [E, N/128, K/128] "
                "scale is BLOCK_128, [E, N] is PER_CHANNEL, [E] is PER_TENSOR)"
            )
        if self.data.device != self.scale.device:
            raise DeviceError(
                f"FP8 data on {self.data.device} and scale on {self.scale.device}; move both to one device"
            )


def quantize_fp8_weight(w: Tensor, *, granularity: Fp8Scale) -> Fp8Weight:
    """Quantize float `w` [..., N, K] to FP8 E4M3 with one scale per tensor, output row or 128x128 block.

    All dims before the last two are leading (one scale set per expert). Scale = amax / 448 per group,
    computed in float32.
    """
    if not isinstance(granularity, Fp8Scale):
        fp8_weight_scale_shape(lead=(), n=1, k=1, granularity=granularity)  # raises the FormatError
    w32 = _check_float_input(w, what="quantize_fp8_weight", shape_doc="[..., N, K]")
    if w32.ndim < 2 or w32.shape[-2] == 0 or w32.shape[-1] == 0:
        raise ShapeError(
            f"quantize_fp8_weight needs w of shape [..., N, K] with N, K >= 1, got {list(w32.shape)}"
        )
    *lead, n, k = w32.shape
    mag = w32.abs()
    if granularity is Fp8Scale.PER_TENSOR:
        amax = mag.amax(dim=(-2, -1))
    elif granularity is Fp8Scale.PER_CHANNEL:
        amax = mag.amax(dim=-1)
    else:
        nb, kb = _cdiv(n, _BLOCK), _cdiv(k, _BLOCK)
        # Zero padding leaves each ragged block's amax unchanged (|0| never wins a max over |w|).
        padded = torch.nn.functional.pad(mag, (0, kb * _BLOCK - k, 0, nb * _BLOCK - n))
        amax = padded.reshape(*lead, nb, _BLOCK, kb, _BLOCK).amax(dim=(-3, -1))
    scale = _scale_from_amax(amax)
    data = _to_fp8(w32 / _expand_weight_scale(scale, n=n, k=k, granularity=granularity))
    return Fp8Weight(data=data, scale=scale.contiguous(), granularity=granularity)


def dequantize_fp8_weight(
    data: Tensor, scale: Tensor, *, granularity: Fp8Scale, dtype: torch.dtype = torch.float32
) -> Tensor:
    """FP8 weight codes [..., N, K] times their expanded float32 scale -> `dtype` [..., N, K]."""
    weight = Fp8Weight(data=data, scale=scale, granularity=granularity)  # validates
    n, k = weight.data.shape[-2:]
    full = _expand_weight_scale(weight.scale, n=n, k=k, granularity=granularity)
    return (weight.data.to(torch.float32) * full).to(dtype)


# float8_e4m3fn has no infinities; S.1111.111 (0x7F, 0xFF) is its NaN, which no quantizer writes.
_E4M3_NAN_BITS = 0x7F


# Bytes scanned at a time: the scan's masks are a byte an element, so a layer's codes (11 GB for
# DeepSeek-V3's) are read a slice of experts at a time.
_SCAN_CHUNK_BYTES = 256 << 20


def _leading_slices(data: Tensor):
    """(start index along dim 0, slice) pairs covering `data`, each about `_SCAN_CHUNK_BYTES`; a tensor
    without a leading dimension, or one entry of which is already that large, comes whole or an entry at a
    time."""
    if data.dim() < 3:
        yield 0, data
        return
    per = max(1, _SCAN_CHUNK_BYTES // max(1, data[0].numel()))
    for start in range(0, data.shape[0], per):
        yield start, data[start : start + per]


def find_fp8_nan_codes(codes: Tensor) -> tuple[int, tuple[int, ...] | None]:
    """(how many, index of the first) of the NaN codes (E4M3 0x7F / 0xFF) in float8_e4m3fn `codes`, read a
    slice at a time; it synchronizes with the device."""
    if not isinstance(codes, Tensor) or codes.dtype != torch.float8_e4m3fn:
        got = codes.dtype if isinstance(codes, Tensor) else type(codes).__name__
        raise DTypeError(f"FP8 weight codes must be a float8_e4m3fn tensor, got {got}")
    count, first = 0, None
    for part_start, part in _leading_slices(codes.view(torch.uint8)):
        bad = (part & _E4M3_NAN_BITS) == _E4M3_NAN_BITS
        part_count = int(bad.sum())
        if part_count and first is None:
            index = [int(i) for i in bad.nonzero()[0]]
            first = (index[0] + part_start, *index[1:])
        count += part_count
    return count, first


def check_fp8_codes(codes: Tensor, *, name: str) -> None:
    """Raise FormatError if any code of `codes` is NaN (`find_fp8_nan_codes`), naming `name`, the count and
    the first index: a weight no quantizer writes, which would turn every token routed through it into
    NaN. Call once at load time."""
    count, first = find_fp8_nan_codes(codes)
    if count:
        raise FormatError(
            f"{name}: {count} of {codes.numel()} FP8 weight codes are NaN (E4M3 0x7F / 0xFF), first at index "
            f"{first} of shape {list(codes.shape)}; the checkpoint is corrupt. Re-export the weight."
        )


def check_fp8_scales(scales: Tensor, *, name: str) -> None:
    """Raise FormatError if any FP8 weight scale is not finite or not > 0 (the quantizer makes amax / 448,
    floored at a positive tiny), naming `name`, the count and the first index. Call once at load time;
    it synchronizes with the device."""
    if not isinstance(scales, Tensor) or scales.dtype != torch.float32:
        got = scales.dtype if isinstance(scales, Tensor) else type(scales).__name__
        raise DTypeError(f"{name}: FP8 weight scales must be a float32 tensor, got {got}")
    bad = ~(torch.isfinite(scales) & (scales > 0))
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"{name}: {count} of {scales.numel()} FP8 weight scales are not finite and > 0, first "
            f"{scales[first].item()!r} at index {first} of shape {list(scales.shape)}; the checkpoint is "
            "corrupt (every weight it scales would be NaN, inf or zero). Re-export the weight."
        )


def _activation_scale_shape(t: int, h: int, quant: ActivationQuant) -> tuple[int, int]:
    return (t, 1) if quant is ActivationQuant.FP8_PER_TOKEN else (t, _cdiv(h, _BLOCK))


def _check_quant(quant: object) -> None:
    if not isinstance(quant, ActivationQuant) or quant is ActivationQuant.NONE:
        raise FormatError(
            f"FP8 activation quantization needs quant=FP8_PER_TOKEN or FP8_PER_GROUP_128, got {quant!r}; "
            "with ActivationQuant.NONE, pass the activations through unquantized"
        )


@dataclass(frozen=True)
class Fp8Activation:
    """Dynamically quantized activations: data float8_e4m3fn [T, H]; float32 scale [T, 1] (per token)
    or [T, ceil(H/128)] (per 1x128 group along H; the last group may be ragged)."""

    data: Tensor
    scale: Tensor
    quant: ActivationQuant

    def __post_init__(self) -> None:
        _check_quant(self.quant)
        if not isinstance(self.data, Tensor) or self.data.dtype != FP8_DTYPE:
            got = self.data.dtype if isinstance(self.data, Tensor) else type(self.data).__name__
            raise DTypeError(f"FP8 activation data must be {FP8_DTYPE}, got {got}")
        if not isinstance(self.scale, Tensor) or self.scale.dtype != torch.float32:
            got = self.scale.dtype if isinstance(self.scale, Tensor) else type(self.scale).__name__
            raise DTypeError(f"FP8 activation scale must be float32, got {got}")
        if self.data.ndim != 2:
            raise ShapeError(f"FP8 activation data must be [T, H], got shape {list(self.data.shape)}")
        want = _activation_scale_shape(*self.data.shape, self.quant)
        if tuple(self.scale.shape) != want:
            raise ShapeError(
                f"FP8 {self.quant.name} scale for data {list(self.data.shape)} must have shape {list(want)}, "
                f"got {list(self.scale.shape)}"
            )
        if self.data.device != self.scale.device:
            raise DeviceError(
                f"FP8 data on {self.data.device} and scale on {self.scale.device}; move both to one device"
            )


def quantize_fp8_activation(x: Tensor, *, quant: ActivationQuant) -> Fp8Activation:
    """Quantize float activations `x` [T, H] per token or per 1x128 group (scale = amax / 448)."""
    _check_quant(quant)
    x32 = _check_float_input(x, what="quantize_fp8_activation", shape_doc="[T, H]")
    if x32.ndim != 2 or x32.shape[1] == 0:
        raise ShapeError(
            f"quantize_fp8_activation needs x of shape [T, H] with H >= 1 (T = 0 is fine), got "
            f"{list(x32.shape)}; flatten leading dims into T"
        )
    t, h = x32.shape
    if quant is ActivationQuant.FP8_PER_TOKEN:
        scale = _scale_from_amax(x32.abs().amax(dim=-1, keepdim=True))
        full = scale
    else:
        g = _cdiv(h, _BLOCK)
        padded = torch.nn.functional.pad(x32.abs(), (0, g * _BLOCK - h))  # zeros do not change amax
        scale = _scale_from_amax(padded.reshape(t, g, _BLOCK).amax(dim=-1))
        full = scale.repeat_interleave(_BLOCK, dim=-1)[:, :h]
    return Fp8Activation(data=_to_fp8(x32 / full), scale=scale.contiguous(), quant=quant)


def dequantize_fp8_activation(a: Fp8Activation, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """`a.data` times its expanded scale -> `dtype` [T, H]."""
    if not isinstance(a, Fp8Activation):
        raise FormatError(f"dequantize_fp8_activation needs an Fp8Activation, got {type(a).__name__}")
    h = a.data.shape[1]
    if a.quant is ActivationQuant.FP8_PER_TOKEN:
        full = a.scale
    else:
        full = a.scale.repeat_interleave(_BLOCK, dim=-1)[:, :h]
    return (a.data.to(torch.float32) * full).to(dtype)
