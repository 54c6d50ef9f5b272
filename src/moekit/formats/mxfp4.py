"""MXFP4 (OCP Microscaling v1.0) in the GPT-OSS checkpoint layout.

Data flow:
    float x [..., N, in_dim]
      -> quantize_mxfp4: blocks of 32 along in_dim (ragged tail zero-padded), one E8M0 scale per
         block (rule: FLOOR or ROUND_UP), elements rounded to nearest-even on the E2M1 grid
      -> Mxfp4Weight(blocks uint8 [..., N, G, 16], scales uint8 [..., N, G], in_dim), G = ceil(in_dim/32)
      -> dequantize_mxfp4: 256-entry byte -> (even, odd) value table, times decode_e8m0(scales),
         padded tail dropped -> float [..., N, in_dim]

Byte layout: in each blocks byte the low nibble is the even element, the high nibble the odd one.
Element codes: bit 3 is the sign, bits 0..2 index +{0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.
Scale byte e decodes to 2^(e - 127); 0xFF is NaN and is never emitted by the quantizer.

Pure PyTorch; runs on any device. `dequantize_mxfp4` does not look at scale values (that would force
a host sync); loaders call `check_mxfp4_scales` once when the tensors arrive.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.errors import DeviceError, DTypeError, FormatError, ShapeError

MXFP4_BLOCK = 32
_BYTES_PER_BLOCK = MXFP4_BLOCK // 2  # two E2M1 elements per byte
_E8M0_BIAS = 127
_E8M0_NAN = 0xFF
_E2M1_MAX = 6.0

# code -> value; codes 8..15 are the negatives of 0..7 (8 is -0.0, so signbit survives a round trip).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_VALUES: tuple[float, ...] = _E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES)

# Midpoints between neighbouring magnitudes (code i, i+1) and which way an exact tie goes. Ties go to
# the even code, which is the code whose mantissa bit is 0: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0,
# 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0. `True` = a tie rounds up (strict `>=`).
_E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


class Mxfp4ScaleRule(enum.Enum):
    """How a block's E8M0 scale is chosen from its absolute maximum `amax`."""

    # OCP MX v1.0: 2^(floor(log2(amax)) - 2), i.e. amax's binade mapped onto E2M1's top binade [4, 8).
    # Values in (6, 8) * scale saturate to +-6 (about half of all blocks clip their maximum).
    FLOOR = "floor"
    # 2^ceil(log2(amax / 6)): the smallest power of two that keeps amax within +-6; never clips.
    ROUND_UP = "round_up"


# ROUND_UP never clips, so the block maximum (usually the most important element) is never distorted.
# It is also the default of OpenAI's triton_kernels `downcast_to_mxfp`
# (`DEQUANT_SCALE_ROUNDING_MODE=DequantScaleRoundingMode.ROUND_UP`, numerics_details/mxfp.py).
DEFAULT_SCALE_RULE = Mxfp4ScaleRule.ROUND_UP


def mxfp4_groups(in_dim: int) -> int:
    """Number of 32-element scale groups G covering `in_dim` elements (the last one may be ragged)."""
    if isinstance(in_dim, bool) or not isinstance(in_dim, int) or in_dim < 1:
        raise ShapeError(f"in_dim must be a positive int, got {in_dim!r}")
    return -(-in_dim // MXFP4_BLOCK)


@dataclass(frozen=True)
class Mxfp4Weight:
    """MXFP4 codes and scales of a weight `[..., N, in_dim]` quantized along its last (input) axis.

    blocks: uint8 [..., N, G, 16], two E2M1 codes per byte (low nibble = even element).
    scales: uint8 [..., N, G], E8M0 scale bytes.
    in_dim: the logical input size; elements past it in the last block are padding (code 0).
    """

    blocks: Tensor
    scales: Tensor
    in_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, Tensor) or self.blocks.dtype != torch.uint8:
            got = self.blocks.dtype if isinstance(self.blocks, Tensor) else type(self.blocks).__name__
            raise DTypeError(f"MXFP4 blocks must be a uint8 tensor (two E2M1 codes per byte), got {got}")
        if not isinstance(self.scales, Tensor) or self.scales.dtype != torch.uint8:
            got = self.scales.dtype if isinstance(self.scales, Tensor) else type(self.scales).__name__
            raise DTypeError(f"MXFP4 scales must be a uint8 tensor (E8M0 bytes), got {got}")
        groups = mxfp4_groups(self.in_dim)
        shape = tuple(self.blocks.shape)
        if len(shape) < 3 or shape[-1] != _BYTES_PER_BLOCK:
            raise ShapeError(
                f"MXFP4 blocks must have shape [..., N, G, {_BYTES_PER_BLOCK}], got {list(shape)}; "
                "a flat [..., N, in_dim/2] tensor must be reshaped to [..., N, G, 16] first"
            )
        if shape[-2] != groups:
            raise ShapeError(
                f"MXFP4 blocks {list(shape)} have G={shape[-2]} groups but in_dim={self.in_dim} needs "
                f"G=ceil({self.in_dim}/32)={groups}; check in_dim (H for w13, I for w2)"
            )
        if tuple(self.scales.shape) != shape[:-1]:
            raise ShapeError(
                f"MXFP4 scales shape {list(self.scales.shape)} must equal "
                f"blocks.shape[:-1]={list(shape[:-1])}"
            )
        if self.blocks.device != self.scales.device:
            raise DeviceError(
                f"MXFP4 blocks on {self.blocks.device} and scales on {self.scales.device}; "
                "move both to one device"
            )


def _e8m0_table(device: torch.device) -> Tensor:
    # float64 powers of two are exact; every one of them from 2^-127 (an fp32 subnormal) to 2^127 is
    # exactly representable in fp32. A bit trick (e << 23) would decode 0x00 to 0.0, not 2^-127.
    table = torch.pow(torch.tensor(2.0, dtype=torch.float64), torch.arange(256, dtype=torch.float64) - 127)
    table[_E8M0_NAN] = math.nan
    return table.to(device=device, dtype=torch.float32)


def decode_e8m0(scales: Tensor) -> Tensor:
    """E8M0 bytes -> float32 2^(e - 127), same shape; 0xFF -> NaN."""
    if not isinstance(scales, Tensor) or scales.dtype != torch.uint8:
        got = scales.dtype if isinstance(scales, Tensor) else type(scales).__name__
        raise DTypeError(f"E8M0 scales must be a uint8 tensor, got {got}")
    return _e8m0_table(scales.device)[scales.long()]


def _pair_table(device: torch.device) -> Tensor:
    # byte b -> (value of low nibble, value of high nibble): one gather per byte instead of two
    # shifts, two gathers and an interleave (about 2x faster on CPU for a gpt-oss expert).
    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1).to(device)


def dequantize_mxfp4(
    blocks: Tensor, scales: Tensor, *, in_dim: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """MXFP4 blocks [..., N, G, 16] and scales [..., N, G] -> `dtype` [..., N, in_dim].

    Computed in float32 (exact: an E2M1 value has 2 significant bits and the scale is a power of two),
    then cast to `dtype`. Scale bytes are not checked here; a 0xFF byte yields NaNs for its block.
    """
    weight = Mxfp4Weight(blocks=blocks, scales=scales, in_dim=in_dim)  # validates dtypes and shapes
    lead = tuple(weight.blocks.shape[:-1])  # [..., N, G]
    # index_select + in-place multiply: ~2x faster on CPU than advanced indexing and `*` (measured,
    # gpt-oss expert [5760, 90, 16]), since no second [..., N, G, 32] temporary is allocated.
    codes = weight.blocks.reshape(-1).long()
    values = _pair_table(blocks.device).index_select(0, codes).reshape(*lead, MXFP4_BLOCK)
    values.mul_(decode_e8m0(weight.scales).unsqueeze(-1))
    out = values.reshape(*lead[:-1], lead[-1] * MXFP4_BLOCK)
    if out.shape[-1] != in_dim:
        out = out[..., :in_dim]
    return out.to(dtype).contiguous()


def check_mxfp4_scales(scales: Tensor, *, name: str) -> None:
    """Raise FormatError if any E8M0 byte of `scales` is 0xFF (NaN), naming `name`, the count and the
    first index. Call once at load time; it synchronizes with the device."""
    if not isinstance(scales, Tensor) or scales.dtype != torch.uint8:
        got = scales.dtype if isinstance(scales, Tensor) else type(scales).__name__
        raise DTypeError(f"{name}: MXFP4 scales must be a uint8 tensor (E8M0 bytes), got {got}")
    bad = scales == _E8M0_NAN
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"{name}: {count} of {scales.numel()} MXFP4 scale bytes are 0xFF (E8M0 NaN), first at index "
            f"{first} of shape {list(scales.shape)}; the checkpoint is corrupt or padding scales were read "
            "as data. Re-export the weight, or slice off padding groups before use."
        )


def _check_finite(x: Tensor, *, what: str) -> None:
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = ~finite
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"{what}: {int(bad.sum())} of {x.numel()} values are not finite (after conversion to "
            f"float32), first at index {first}: {x[first].item()!r}; fix or clamp the input before "
            "quantizing (MXFP4/FP8 codes have no Inf, and a NaN would poison its whole block's scale)"
        )


def _scale_exponents(amax: Tensor, *, rule: Mxfp4ScaleRule) -> Tensor:
    """Per-block unbiased scale exponent e (int64), scale = 2^e, clamped to E8M0's [-127, 127].

    `amax` is float64 (exact copies of float32 values), so frexp gives exact binades even for fp32
    subnormals. All-zero blocks get e = -127 (byte 0x00): the smallest legal scale, which decodes
    to zeros whatever a kernel takes 0x00 to mean (2^-127, or 0 with a shift-only decoder).
    """
    if rule is Mxfp4ScaleRule.FLOOR:
        # amax = m * 2^p, m in [0.5, 1) -> floor(log2(amax)) = p - 1.
        _, p = torch.frexp(amax)
        e = p.long() - 1 - 2
    else:
        # ceil(log2(amax / 6)). amax / 6 in float64 cannot round onto a power of two from above:
        # for a float32 amax just above 6 * 2^k the quotient exceeds 2^k by >= 2^(k-23)/1.5, far more
        # than float64's half-ulp, so ceil() never drops below the no-clip exponent.
        m, p = torch.frexp(amax / _E2M1_MAX)
        e = torch.where(m == 0.5, p - 1, p).long()
    e = torch.where(amax > 0, e, torch.full_like(e, -_E8M0_BIAS))
    return e.clamp(-_E8M0_BIAS, _E8M0_BIAS)


def _encode_e2m1(q: Tensor) -> Tensor:
    """Scaled float64 values -> E2M1 codes (uint8), round to nearest, ties to even, saturate at +-6.

    The sign bit follows signbit(q), as an IEEE cast does: -0.0 and negatives that round to zero
    become code 8 (-0), so dequantize -> quantize reproduces every code bit-exactly.
    """
    mag = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        # Each midpoint passed moves one code up; magnitudes above 5 land on code 7 (6.0): saturation.
        code += (mag >= mid) if tie_up else (mag > mid)
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def quantize_mxfp4(x: Tensor, *, rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE) -> Mxfp4Weight:
    """Quantize float `x` [..., N, in_dim] to MXFP4 along its last axis.

    `x` is converted to float32 first (what a kernel would read); the scale and the division by it are
    done in float64 so both are exact at every E8M0 exponent. A ragged last block is padded with
    zeros, whose codes are 0 and which do not affect the block's scale. Raises FormatError on
    non-finite input.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise DTypeError(f"quantize_mxfp4 needs a floating-point tensor [..., N, in_dim], got {got}")
    if not isinstance(rule, Mxfp4ScaleRule):
        raise FormatError(
            f"rule must be a Mxfp4ScaleRule ({', '.join(r.name for r in Mxfp4ScaleRule)}), got {rule!r}"
        )
    if x.ndim < 2 or x.shape[-1] == 0:
        raise ShapeError(
            f"quantize_mxfp4 needs x of shape [..., N, in_dim] with in_dim >= 1, got {list(x.shape)}; "
            "add a leading dim for a single row (x[None])"
        )
    x32 = x.to(torch.float32)
    _check_finite(x32, what="quantize_mxfp4 input")
    in_dim = x32.shape[-1]
    groups = mxfp4_groups(in_dim)
    pad = groups * MXFP4_BLOCK - in_dim
    xb = torch.nn.functional.pad(x32.to(torch.float64), (0, pad))
    xb = xb.reshape(*x32.shape[:-1], groups, MXFP4_BLOCK)
    e = _scale_exponents(xb.abs().amax(dim=-1), rule=rule)  # [..., N, G]
    q = xb / torch.pow(2.0, e.to(torch.float64)).unsqueeze(-1)  # exact: power-of-two divisor
    codes = _encode_e2m1(q)  # [..., N, G, 32]
    pairs = codes.reshape(*codes.shape[:-1], _BYTES_PER_BLOCK, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)  # low nibble = even element
    scales = (e + _E8M0_BIAS).to(torch.uint8)
    return Mxfp4Weight(blocks=blocks.contiguous(), scales=scales.contiguous(), in_dim=in_dim)
