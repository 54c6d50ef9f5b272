"""Expert weights: a typed container that records format, gate layout and packing.

Data flow: checkpoint tensors or float tensors -> `ExpertWeights` (validated against a `MoESpec`)
-> optional load-time conversions that return a *new* container with a new type (`to_layout`,
kernel repacking later) -> kernels and the reference read the fields.

Storage per format (matrices are `[out, in]`, leading dim E experts on this rank):
- BF16 / FP16 / FP32: `w13 [E, 2I, H]`, `w2 [E, H, I]`, no scales.
- FP8_E4M3: `w13`/`w2` float8_e4m3fn with the same shapes, scales fp32 per `Fp8Scale`
  (per-tensor `[E]`, per-channel `[E, N]`, 128x128 blocks `[E, ceil(N/128), ceil(K/128)]`).
- MXFP4: `w13` uint8 blocks `[E, 2I, ceil(H/32), 16]`, `w13_scale` uint8 `[E, 2I, ceil(H/32)]`;
  `w2` `[E, H, ceil(I/32), 16]`, `w2_scale` `[E, H, ceil(I/32)]` (GPT-OSS checkpoint layout).
Biases, when present: `b13 [E, 2I]`, `b2 [E, H]`, any float dtype (fp32 accumulate).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from moekit.errors import (
    DeviceError,
    DTypeError,
    FormatError,
    LayoutMismatchError,
    ShapeError,
    check_enum,
    check_int,
)
from moekit.formats import (
    MXFP4_BLOCK,
    check_fp8_codes,
    check_fp8_scales,
    check_mxfp4_scales,
    dequantize_fp8_weight,
    dequantize_mxfp4,
    fp8_weight_scale_shape,
    mxfp4_groups,
    mxfp4_w4a8,
    quantize_fp8_weight,
    quantize_mxfp4,
)
from moekit.formats.mxfp4 import DEFAULT_SCALE_RULE, Mxfp4ScaleRule
from moekit.formats.mxfp4_words import CHUNKS_PER_RUN, layer_rows_reason, num_runs, unpack_mma_words
from moekit.spec import Fp8Scale, GateLayout, MoESpec, WeightFormat


class WeightPacking(enum.Enum):
    """The physical arrangement of the stored tensors. Kernels declare which packings they read."""

    CHECKPOINT = "checkpoint"  # the layouts in the module docstring, as checkpoints store them
    # Quantized weights dequantized once at load into float [E, 2I, H] / [E, H, I] (no scales), for
    # unfused paths; `format` still records the source format, so the spec check stays meaningful.
    DEQUANTIZED = "dequantized"
    # MXFP4 codes as int32 words [E, N/16, S, 8, 4, 8] laid out for Hopper MMA operand registers
    # (`moekit.formats.mxfp4_words`); scales keep their [E, N, G] shape. Made by the Triton kernel's
    # `prepare_weights`; `unpacked()` returns CHECKPOINT packing.
    MXFP4_MMA_WORDS = "mxfp4_mma_words"
    # MXFP4 for W4A8 on FP8 tensor cores (`moekit.formats.mxfp4_w4a8`): w13 / w2 int32 words
    # [E, N'/16, S, 32, 8] (N' the rows padded to 128; w13's rows interleaved gate/up whatever
    # `gate_layout` says), w13_scale / w2_scale int32 drops and reference factors [E, N', S + R]. Made by
    # the Triton kernel's `prepare_weights` for W4A8 specs on sm_90; `unpacked()` returns CHECKPOINT packing.
    MXFP4_W4A8 = "mxfp4_w4a8"


# The float dtypes weights may be stored (or dequantized) in; fp32 accumulation covers each.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_fp8_scale_given(fmt: WeightFormat, fp8_scale: object) -> None:
    """FP8_E4M3 weights need an `Fp8Scale`; any other format takes none."""
    if fmt is WeightFormat.FP8_E4M3:
        if not isinstance(fp8_scale, Fp8Scale):
            raise DTypeError(f"FP8 weights need fp8_scale (an Fp8Scale), got {fp8_scale!r}")
    elif fp8_scale is not None:
        raise DTypeError(f"fp8_scale={fp8_scale} given for {fmt.name} weights; it is only for FP8_E4M3")


def gate_layout_permutation(
    intermediate_size: int, *, source: GateLayout, target: GateLayout
) -> torch.Tensor:
    """Row index `perm` with `target_rows = source_rows[perm]` for a w13 of 2I rows."""
    i = intermediate_size
    if source is target:
        return torch.arange(2 * i)
    gate_rows = torch.arange(i) * 2  # in INTERLEAVED, gate j is row 2j and up j is row 2j+1
    interleaved_to_concat = torch.cat([gate_rows, gate_rows + 1])
    if source is GateLayout.INTERLEAVED:
        return interleaved_to_concat
    return torch.argsort(interleaved_to_concat)


@dataclass(frozen=True)
class ExpertWeights:
    """w13 / w2 of E_local experts, with scales and biases, typed by format, layout and packing."""

    format: WeightFormat
    gate_layout: GateLayout
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    fp8_scale: Fp8Scale | None = None
    packing: WeightPacking = WeightPacking.CHECKPOINT
    hidden_size: int | None = None  # H; only MXFP4 needs it (blocks hide ragged tails), else derived

    def __post_init__(self) -> None:
        check_enum("ExpertWeights.format", self.format, WeightFormat, error=DTypeError)
        check_enum("ExpertWeights.gate_layout", self.gate_layout, GateLayout, error=LayoutMismatchError)
        check_int("ExpertWeights.hidden_size", self.hidden_size, minimum=1, optional=True, error=ShapeError)
        self._check_structure()

    # ----- derived sizes -------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def H(self) -> int:  # noqa: N802
        if self.packing is WeightPacking.MXFP4_W4A8:  # w2's rows are padded to whole programs
            return self.hidden_size
        return self.w2.shape[1] * self._rows_per_entry

    @property
    def I(self) -> int:  # noqa: N802, E743
        return self.w13.shape[1] * self._rows_per_entry // 2

    @property
    def _rows_per_entry(self) -> int:  # the word packings store 16-row blocks along dim 1
        return 16 if self.packing in (WeightPacking.MXFP4_MMA_WORDS, WeightPacking.MXFP4_W4A8) else 1

    @property
    def has_bias(self) -> bool:
        return self.b13 is not None

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    # ----- structure checks (spec-independent) -----------------------------------------------------
    @property
    def stores_floats(self) -> bool:
        """True when w13/w2 hold plain floats (unquantized format, or dequantized packing)."""
        return not self.format.is_quantized or self.packing is WeightPacking.DEQUANTIZED

    def _check_structure(self) -> None:
        if not isinstance(self.packing, WeightPacking):
            raise LayoutMismatchError(f"ExpertWeights.packing must be a WeightPacking, got {self.packing!r}")
        fmt = self.format
        for name in ("w13", "w2"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise DTypeError(f"ExpertWeights.{name} must be a torch.Tensor, got {type(t).__name__}")
        for name in ("w13_scale", "w2_scale", "b13", "b2"):
            t = getattr(self, name)
            if t is not None and not isinstance(t, torch.Tensor):
                raise DTypeError(
                    f"ExpertWeights.{name} must be None or a torch.Tensor, got {type(t).__name__}; "
                    "convert it with torch.as_tensor"
                )
        words = self.packing is WeightPacking.MXFP4_MMA_WORDS
        w4a8 = self.packing is WeightPacking.MXFP4_W4A8
        if (words or w4a8) and fmt is not WeightFormat.MXFP4:
            raise LayoutMismatchError(f"{self.packing.name} packing is for MXFP4 weights, got {fmt.name}")
        if (self.b13 is None) != (self.b2 is None):
            raise ShapeError("give both biases b13 and b2, or neither")
        if w4a8:
            self._check_w4a8_structure()
            return
        rank = 3 if self.stores_floats else 6 if words else 4 if fmt is WeightFormat.MXFP4 else 3
        for name in ("w13", "w2"):
            t = getattr(self, name)
            if t.dim() != rank:
                raise ShapeError(f"{fmt.name} {name} must have {rank} dims, got shape {tuple(t.shape)}")
        if self.w13.shape[1] * (16 if words else 1) % 2:
            raise ShapeError(f"w13 must have 2I rows (gate and up), got {self.w13.shape[1]} rows")
        if self.w13.shape[0] != self.w2.shape[0]:
            raise ShapeError(f"w13 has {self.w13.shape[0]} experts but w2 has {self.w2.shape[0]}")
        _check_fp8_scale_given(fmt, self.fp8_scale)
        if fmt is WeightFormat.MXFP4 and not self.stores_floats:
            if self.hidden_size is None:
                raise ShapeError("MXFP4 weights need hidden_size (H): blocks of 32 cannot tell a ragged tail")
            w2_rows = self.w2.shape[1] * 16 if words else self.w2.shape[1]
            if self.hidden_size != w2_rows:
                raise ShapeError(f"hidden_size={self.hidden_size} but w2 has {w2_rows} rows (H)")
            groups = mxfp4_groups(self.hidden_size)
            if words and num_runs(groups) != self.w13.shape[2]:
                raise ShapeError(
                    f"hidden_size={self.hidden_size} needs {num_runs(groups)} runs of {CHUNKS_PER_RUN} "
                    f"chunks in the w13 words, got {self.w13.shape[2]}"
                )
            if not words and groups != self.w13.shape[2]:
                raise ShapeError(
                    f"hidden_size={self.hidden_size} needs {groups} groups of {MXFP4_BLOCK} in w13, "
                    f"got {self.w13.shape[2]}"
                )
        elif self.hidden_size is not None and self.hidden_size != self.w13.shape[2]:
            raise ShapeError(f"hidden_size={self.hidden_size} but w13 has {self.w13.shape[2]} columns")
        if self.stores_floats and (self.w13_scale is not None or self.w2_scale is not None):
            raise FormatError(
                f"{fmt.name} weights in {self.packing.name} packing take no scales; got w13_scale/w2_scale"
            )
        if not self.stores_floats and (self.w13_scale is None or self.w2_scale is None):
            raise FormatError(f"{fmt.name} weights need both w13_scale and w2_scale")

    def _check_w4a8_structure(self) -> None:
        if self.hidden_size is None:
            raise ShapeError("MXFP4_W4A8 weights need hidden_size (H): w2's rows are padded")
        if self.w13_scale is None or self.w2_scale is None:
            raise FormatError("MXFP4_W4A8 weights need both w13_scale and w2_scale (drops and factors)")
        e, i = self.w13.shape[0], self.w13.shape[1] * 8
        expected = self.expected_shapes(num_experts=e, hidden=self.hidden_size, intermediate=i)
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            t = getattr(self, name)
            if tuple(t.shape) != expected[name]:
                raise ShapeError(
                    f"MXFP4_W4A8 {name} has shape {tuple(t.shape)}, expected {expected[name]} for "
                    f"E={e}, H={self.hidden_size}, I={i}"
                )

    # ----- validation against a spec ---------------------------------------------------------------
    def validate(self, spec: MoESpec, *, check_nan_scales: bool = False) -> None:
        """Check every tensor against `spec`; raise a moekit error naming the tensor that is wrong."""
        if self.format is not spec.weight_format:
            raise DTypeError(f"weights are {self.format.name} but the spec says {spec.weight_format.name}")
        if self.gate_layout is not spec.gate_layout:
            raise LayoutMismatchError(
                f"weights are in {self.gate_layout.name} gate layout but the spec says "
                f"{spec.gate_layout.name}; "
                f"convert once at load time with weights.to_layout(GateLayout.{spec.gate_layout.name})"
            )
        if self.fp8_scale is not spec.fp8_scale:
            raise DTypeError(f"weights have fp8_scale={self.fp8_scale} but the spec says {spec.fp8_scale}")
        if self.has_bias != spec.has_bias:
            raise ShapeError(
                f"spec.has_bias={spec.has_bias} but weights {'have' if self.has_bias else 'lack'} biases"
            )
        e, h, i = spec.E_local, spec.H, spec.I
        if self.packing is WeightPacking.MXFP4_MMA_WORDS and (
            why := layer_rows_reason(intermediate=i, hidden=h)
        ):
            raise LayoutMismatchError(
                f"MXFP4_MMA_WORDS weights cannot hold this layer ({why}): a tile would start inside a 16-row "
                "block; keep CHECKPOINT packing (moekit.prepare_weights does for this spec)"
            )
        for name, shape in self.expected_shapes(num_experts=e, hidden=h, intermediate=i).items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ShapeError(
                    f"{name} has shape {tuple(t.shape)}, expected {shape} for spec ({spec.describe()})"
                )
        for name, t in self.tensors().items():
            expected = self._expected_dtype(name)
            if expected is not None and t.dtype not in expected:
                raise DTypeError(
                    f"{name} has dtype {t.dtype}, expected one of {expected} for {self.format.name}"
                )
            if t.device != self.device:
                raise DeviceError(
                    f"{name} is on {t.device} but w13 is on {self.device}; move all weights together"
                )
        if check_nan_scales and not self.stores_floats:
            self.check_scales()

    def check_scales(self) -> None:
        """Raise FormatError for a value no checkpoint may hold: an MXFP4 0xFF byte (E8M0 NaN), an FP8
        scale that is not finite or not > 0, an FP8 NaN code. Reads every scale, and every FP8 code (a
        sync): a load-time step."""
        if self.stores_floats or self.packing is WeightPacking.MXFP4_W4A8:  # W4A8: checked when packed
            return
        check = check_mxfp4_scales if self.format is WeightFormat.MXFP4 else check_fp8_scales
        check(self.w13_scale, name="w13_scale")
        check(self.w2_scale, name="w2_scale")
        if self.format is WeightFormat.FP8_E4M3:  # E2M1 has no NaN code
            check_fp8_codes(self.w13, name="w13")
            check_fp8_codes(self.w2, name="w2")

    def expected_shapes(
        self, *, num_experts: int, hidden: int, intermediate: int
    ) -> dict[str, tuple[int, ...]]:
        e, h, i = num_experts, hidden, intermediate
        shapes: dict[str, tuple[int, ...]]
        if self.stores_floats:
            shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
        elif self.packing is WeightPacking.MXFP4_W4A8:
            sh, si, rows2 = mxfp4_w4a8.steps(h), mxfp4_w4a8.steps(i), mxfp4_w4a8.padded_rows(h)
            shapes = {
                "w13": (e, 2 * i // 16, sh, 32, 8),
                "w2": (e, rows2 // 16, si, 32, 8),
                "w13_scale": (e, 2 * i, sh + mxfp4_w4a8.references(h)),
                "w2_scale": (e, rows2, si + mxfp4_w4a8.references(i)),
            }
        elif self.format is WeightFormat.MXFP4:
            gh, gi = mxfp4_groups(h), mxfp4_groups(i)
            words = self.packing is WeightPacking.MXFP4_MMA_WORDS
            shapes = {
                "w13": (e, 2 * i // 16, num_runs(gh), 8, 4, CHUNKS_PER_RUN) if words else (e, 2 * i, gh, 16),
                "w2": (e, h // 16, num_runs(gi), 8, 4, CHUNKS_PER_RUN) if words else (e, h, gi, 16),
                "w13_scale": (e, 2 * i, gh),
                "w2_scale": (e, h, gi),
            }
        else:
            shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
            if self.format is WeightFormat.FP8_E4M3:
                shapes["w13_scale"] = fp8_weight_scale_shape(
                    lead=(e,), n=2 * i, k=h, granularity=self.fp8_scale
                )
                shapes["w2_scale"] = fp8_weight_scale_shape(lead=(e,), n=h, k=i, granularity=self.fp8_scale)
        if self.has_bias:
            shapes["b13"] = (e, 2 * i)
            shapes["b2"] = (e, h)
        return shapes

    def _expected_dtype(self, name: str) -> tuple[torch.dtype, ...] | None:
        if name in ("b13", "b2") or (self.packing is WeightPacking.DEQUANTIZED):
            return FLOAT_DTYPES
        if self.packing is WeightPacking.MXFP4_W4A8:
            return (torch.int32,)
        if self.format is WeightFormat.MXFP4:
            words = self.packing is WeightPacking.MXFP4_MMA_WORDS and name in ("w13", "w2")
            return (torch.int32,) if words else (torch.uint8,)
        if self.format is WeightFormat.FP8_E4M3:
            return (torch.float8_e4m3fn,) if name in ("w13", "w2") else (torch.float32,)
        return (self.format.float_dtype,)

    # ----- load-time conversions -------------------------------------------------------------------
    def to_layout(self, target: GateLayout) -> ExpertWeights:
        """Return the same weights with w13's gate/up rows (and their scales and bias) reordered."""
        if target is self.gate_layout:
            return self
        if self.packing in (WeightPacking.MXFP4_MMA_WORDS, WeightPacking.MXFP4_W4A8):
            return self.unpacked().to_layout(target)
        if self.format is WeightFormat.FP8_E4M3 and self.fp8_scale is Fp8Scale.BLOCK_128:
            raise LayoutMismatchError(
                "cannot reorder gate/up rows of FP8 weights with 128x128 block scales: "
                "a block would mix rows "
                "of two scales; dequantize, reorder, and quantize again (ExpertWeights.from_float)"
            )
        perm = gate_layout_permutation(self.I, source=self.gate_layout, target=target).to(self.device)
        w13_scale = self.w13_scale
        if w13_scale is not None and w13_scale.dim() >= 2:  # per-tensor scales [E] have no rows
            w13_scale = w13_scale.index_select(1, perm)
        b13 = None if self.b13 is None else self.b13.index_select(1, perm)
        return replace(
            self, gate_layout=target, w13=self.w13.index_select(1, perm), w13_scale=w13_scale, b13=b13
        )

    def unpacked(self) -> ExpertWeights:
        """The same weights in CHECKPOINT packing (undoes MXFP4_MMA_WORDS, or MXFP4_W4A8 as the kernels
        compute with them: groups it flushed keep zero codes; scales made contiguous)."""
        if self.packing is WeightPacking.MXFP4_W4A8:
            w13, w13_scale = self._unpack_w4a8("w13")
            w2, w2_scale = self._unpack_w4a8("w2")
            return replace(
                self, packing=WeightPacking.CHECKPOINT, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale
            )
        if self.packing is not WeightPacking.MXFP4_MMA_WORDS:
            return self
        return replace(
            self,
            packing=WeightPacking.CHECKPOINT,
            w13=unpack_mma_words(self.w13, num_groups=mxfp4_groups(self.H)),
            w2=unpack_mma_words(self.w2, num_groups=mxfp4_groups(self.I)),
            w13_scale=self.w13_scale.contiguous(),
            w2_scale=self.w2_scale.contiguous(),
        )

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """All experts as float `dtype` in DEQUANTIZED packing (a load-time step; memory E*3*H*I*2 bytes)."""
        if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
            # An integer dtype would truncate every weight (most are below 1) to zero without a word.
            raise DTypeError(
                f"dequantized(dtype) must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r} "
                f"({type(dtype).__name__})"
            )
        if not self.format.is_quantized:
            return self  # already floats of the declared format
        if self.packing in (WeightPacking.MXFP4_MMA_WORDS, WeightPacking.MXFP4_W4A8):
            return self.unpacked().dequantized(dtype)
        if self.packing is WeightPacking.DEQUANTIZED:
            return replace(self, w13=self.w13.to(dtype), w2=self.w2.to(dtype))
        w13 = torch.stack([self.dequantize_w13(e).to(dtype) for e in range(self.num_experts)])
        w2 = torch.stack([self.dequantize_w2(e).to(dtype) for e in range(self.num_experts)])
        return replace(
            self,
            w13=w13,
            w2=w2,
            w13_scale=None,
            w2_scale=None,
            packing=WeightPacking.DEQUANTIZED,
            hidden_size=None,
        )

    def to(self, device: torch.device | str) -> ExpertWeights:
        moved = {n: t.to(device) for n, t in self.tensors().items()}
        return replace(self, **moved)

    # ----- dequantization (reference path) ---------------------------------------------------------
    def dequantize_w13(self, expert: int) -> torch.Tensor:
        """fp32 `[2I, H]` of one local expert."""
        return self._dequantize("w13", expert, in_dim=self.hidden_size or self.w13.shape[-1])

    def dequantize_w2(self, expert: int) -> torch.Tensor:
        """fp32 `[H, I]` of one local expert."""
        return self._dequantize("w2", expert, in_dim=self.I)

    def _dequantize(self, name: str, expert: int, *, in_dim: int) -> torch.Tensor:
        data = getattr(self, name)[expert]
        if self.stores_floats:
            return data.float()
        if self.packing is WeightPacking.MXFP4_W4A8:
            blocks, scales = self._unpack_w4a8(name, experts=slice(expert, expert + 1))
            return dequantize_mxfp4(blocks[0], scales[0], in_dim=in_dim, dtype=torch.float32)
        if self.packing is WeightPacking.MXFP4_MMA_WORDS:
            data = unpack_mma_words(data, num_groups=mxfp4_groups(in_dim))
        scale = getattr(self, f"{name}_scale")
        if self.format is WeightFormat.MXFP4:
            return dequantize_mxfp4(data, scale[expert], in_dim=in_dim, dtype=torch.float32)
        if self.format is WeightFormat.FP8_E4M3:
            return dequantize_fp8_weight(data, scale[expert], granularity=self.fp8_scale, dtype=torch.float32)
        return data.float()

    def _unpack_w4a8(self, name: str, experts: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Checkpoint (blocks, scales) of MXFP4_W4A8 `name` ("w13" or "w2") for `experts`, w13's rows back
        in `gate_layout`."""
        rows, in_dim = (2 * self.I, self.H) if name == "w13" else (self.H, self.I)
        words, drops = getattr(self, name)[experts], getattr(self, f"{name}_scale")[experts]
        blocks, scales = mxfp4_w4a8.unpack_w4a8(words, drops, rows=rows, in_dim=in_dim)
        if name == "w13" and self.gate_layout is not GateLayout.INTERLEAVED:
            perm = gate_layout_permutation(self.I, source=GateLayout.INTERLEAVED, target=self.gate_layout)
            blocks, scales = blocks[:, perm.to(blocks.device)], scales[:, perm.to(scales.device)]
        return blocks, scales

    # ----- construction from float tensors ----------------------------------------------------------
    @classmethod
    def from_float(
        cls,
        *,
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        format: WeightFormat,  # noqa: A002 - the field's name
        gate_layout: GateLayout,
        fp8_scale: Fp8Scale | None = None,
        mxfp4_rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE,
    ) -> ExpertWeights:
        """Quantize (or cast) float `w13 [E, 2I, H]` and `w2 [E, H, I]` into `format`."""
        check_enum("ExpertWeights.from_float(format=...)", format, WeightFormat, error=DTypeError)
        if format is not WeightFormat.FP8_E4M3:  # refused before quantizing, as the constructor would
            _check_fp8_scale_given(format, fp8_scale)
        for name, t in (("w13", w13), ("w2", w2)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 3:
                raise ShapeError(f"from_float needs a float 3-D {name}, got {getattr(t, 'shape', t)!r}")
        common = dict(format=format, gate_layout=gate_layout, b13=b13, b2=b2)
        if format is WeightFormat.MXFP4:
            q13 = quantize_mxfp4(w13, rule=mxfp4_rule)
            q2 = quantize_mxfp4(w2, rule=mxfp4_rule)
            return cls(
                w13=q13.blocks,
                w13_scale=q13.scales,
                w2=q2.blocks,
                w2_scale=q2.scales,
                hidden_size=w13.shape[2],
                **common,
            )
        if format is WeightFormat.FP8_E4M3:
            if fp8_scale is None:
                raise FormatError("FP8_E4M3 needs fp8_scale (an Fp8Scale)")
            q13 = quantize_fp8_weight(w13, granularity=fp8_scale)
            q2 = quantize_fp8_weight(w2, granularity=fp8_scale)
            return cls(
                w13=q13.data,
                w13_scale=q13.scale,
                w2=q2.data,
                w2_scale=q2.scale,
                fp8_scale=fp8_scale,
                **common,
            )
        dtype = format.float_dtype
        return cls(w13=w13.to(dtype), w2=w2.to(dtype), **common)
