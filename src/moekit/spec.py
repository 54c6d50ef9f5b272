"""The MoE specification: what math a layer computes.

Data flow: a user (or a preset, or a checkpoint loader) builds a `MoESpec`; `__post_init__` validates
every field; the spec then travels unchanged to the weights' validation, the router, the planner and
the kernels. It is the single source of truth for every parameter of the math: nothing downstream
re-derives or overrides a field.

Letters: T tokens, K experts per token, E experts (global), H hidden, I intermediate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from moekit.errors import SpecError, check_bool, check_enum, check_int, check_real


class WeightFormat(enum.Enum):
    """How expert weights are stored."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"  # exact-comparison tests and CPU reference runs
    FP8_E4M3 = "fp8_e4m3"
    MXFP4 = "mxfp4"

    @property
    def is_quantized(self) -> bool:
        return self in (WeightFormat.FP8_E4M3, WeightFormat.MXFP4)

    @property
    def float_dtype(self) -> torch.dtype | None:
        """The storage dtype of an unquantized format, else None."""
        return _UNQUANTIZED_DTYPES.get(self)

    @classmethod
    def of_float_dtype(cls, dtype: torch.dtype) -> WeightFormat | None:
        """The unquantized format that stores `dtype`, else None (the inverse of `float_dtype`)."""
        return next((f for f, d in _UNQUANTIZED_DTYPES.items() if d == dtype), None)


_UNQUANTIZED_DTYPES = {
    WeightFormat.BF16: torch.bfloat16,
    WeightFormat.FP16: torch.float16,
    WeightFormat.FP32: torch.float32,
}


class Fp8Scale(enum.Enum):
    """Granularity of FP8 weight scales (multiply to dequantize)."""

    PER_TENSOR = "per_tensor"  # one scale per expert matrix: shape [E]
    PER_CHANNEL = "per_channel"  # one per output row: [E, N]
    BLOCK_128 = "block_128x128"  # DeepSeek-V3: [E, ceil(N/128), ceil(K/128)]


class ActivationQuant(enum.Enum):
    """Dynamic quantization of activations before a GEMM (W8A8 paths)."""

    NONE = "none"
    FP8_PER_TOKEN = "fp8_per_token"
    FP8_PER_GROUP_128 = "fp8_per_1x128_group"


class Activation(enum.Enum):
    """Gated activations; `g` is the gate half and `u` the up half of the w13 output (after b13)."""

    SILU = "silu"  # silu(g) * u
    GELU = "gelu"  # gelu_erf(g) * u
    GELU_TANH = "gelu_tanh"  # gelu_tanh(g) * u
    SWIGLU_OAI = "swiglu_oai"  # GPT-OSS: g'=min(g,L); u'=clamp(u,-L,L); g'*sigmoid(alpha*g')*(u'+1)


class GateLayout(enum.Enum):
    """Where the gate and up rows sit in w13 `[E, 2I, H]`."""

    CONCAT = "concat"  # rows [0, I) gate, rows [I, 2I) up (Mixtral, Qwen, DeepSeek)
    INTERLEAVED = "interleaved"  # row 2j gate j, row 2j+1 up j (GPT-OSS checkpoints)


class RouterWeightPlacement(enum.Enum):
    """Where the router weight multiplies."""

    OUTPUT = "output"  # out = sum_k w_k * expert_k(x)
    INPUT = "input"  # out = expert(w * x); valid for K = 1 only


class RoutingMethod(enum.Enum):
    TOPK_SOFTMAX = "topk_softmax"  # GPT-OSS: top-k on logits, softmax over the K selected
    SOFTMAX_TOPK = "softmax_topk"  # Mixtral/Qwen: softmax over E, top-k, optional renormalize
    SIGMOID_GROUPED = "sigmoid_grouped"  # DeepSeek-V3: sigmoid, group-limited, correction bias


_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Weight formats whose layers may quantize their activations to FP8 E4M3 (`act_quant`): W8A8, and W4A8
# (MXFP4 weights with FP8 activations, for prefill on FP8 tensor cores).
_QUANTIZED_ACT_WEIGHTS = (WeightFormat.FP8_E4M3, WeightFormat.MXFP4)
_ENUM_FIELDS = (
    ("weight_format", WeightFormat),
    ("act_quant", ActivationQuant),
    ("gate_layout", GateLayout),
    ("router_weight_placement", RouterWeightPlacement),
)


@dataclass(frozen=True)
class ActivationSpec:
    """A gated activation with its parameters.

    `alpha` is used by SWIGLU_OAI only (and must be None otherwise); `limit` is an optional clamp
    limit L for any activation: None means no clamp, never a default value. With a limit, every
    activation clamps as GPT-OSS does: the gate from above (g' = min(g, L)) and the up half on both
    sides (u' = clamp(u, -L, L)), before the nonlinearity.
    """

    kind: Activation
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        check_enum("ActivationSpec.kind", self.kind, Activation)
        check_real("ActivationSpec.alpha", self.alpha, positive=True, optional=True)
        check_real(
            "ActivationSpec.limit (the clamp limit; None: no clamp)", self.limit, positive=True, optional=True
        )
        if self.kind is Activation.SWIGLU_OAI and self.alpha is None:
            raise SpecError("SWIGLU_OAI needs a finite alpha > 0 (GPT-OSS uses 1.702), got alpha=None")
        if self.kind is not Activation.SWIGLU_OAI and self.alpha is not None:
            raise SpecError(
                f"alpha={self.alpha!r} is only meaningful for SWIGLU_OAI, not {self.kind.name}; pass None"
            )

    @classmethod
    def gpt_oss(cls) -> ActivationSpec:
        return cls(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0)

    def describe(self) -> str:
        parts = [self.kind.name]
        if self.alpha is not None:
            parts.append(f"alpha={self.alpha:g}")
        parts.append(f"limit={self.limit:g}" if self.limit is not None else "no clamp")
        return " ".join(parts)


@dataclass(frozen=True)
class RoutingSpec:
    """How router logits `[T, E]` become weights `[T, K]` (fp32) and ids `[T, K]` (int32).

    `routed_scaling_factor` multiplies the final weights of every method; it lives here, once, and
    the router applies it, so kernels never apply it a second time.
    """

    method: RoutingMethod = RoutingMethod.TOPK_SOFTMAX
    renormalize: bool = True  # SOFTMAX_TOPK only (SIGMOID_GROUPED always renormalizes)
    n_group: int | None = None  # SIGMOID_GROUPED only
    topk_group: int | None = None  # SIGMOID_GROUPED only
    has_correction_bias: bool = False  # SIGMOID_GROUPED only (e_score_correction_bias [E])
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        check_enum("RoutingSpec.method", self.method, RoutingMethod)
        check_bool("RoutingSpec.renormalize", self.renormalize)
        check_int("RoutingSpec.n_group", self.n_group, minimum=1, optional=True)
        check_int("RoutingSpec.topk_group", self.topk_group, minimum=1, optional=True)
        check_bool("RoutingSpec.has_correction_bias", self.has_correction_bias)
        check_real("RoutingSpec.routed_scaling_factor", self.routed_scaling_factor, positive=True)
        grouped = self.method is RoutingMethod.SIGMOID_GROUPED
        if not grouped and (
            self.n_group is not None or self.topk_group is not None or self.has_correction_bias
        ):
            raise SpecError(
                f"n_group={self.n_group}, topk_group={self.topk_group}, "
                f"has_correction_bias={self.has_correction_bias} only apply to SIGMOID_GROUPED, "
                f"not {self.method.name}"
            )
        if self.method is RoutingMethod.TOPK_SOFTMAX and not self.renormalize:
            raise SpecError(
                "TOPK_SOFTMAX always normalizes over the K selected; renormalize=False is not defined"
            )
        if grouped:
            if (self.n_group is None) != (self.topk_group is None):
                raise SpecError(
                    f"give both n_group and topk_group or neither, got n_group={self.n_group}, "
                    f"topk_group={self.topk_group}"
                )
            if self.n_group is not None and not (1 <= self.topk_group <= self.n_group):
                raise SpecError(f"need 1 <= topk_group <= n_group, got {self.topk_group} and {self.n_group}")

    def check_experts(self, num_experts: int, top_k: int) -> None:
        """The grouping fits E experts and K picks: E divisible by n_group, and K no more than the experts of
        the topk_group groups kept (one rule for `MoESpec` and `moekit.route`)."""
        if self.method is not RoutingMethod.SIGMOID_GROUPED or self.n_group is None:
            return
        if num_experts % self.n_group:
            raise SpecError(f"E={num_experts} is not divisible by n_group={self.n_group}")
        kept = self.topk_group * (num_experts // self.n_group)
        if top_k > kept:
            raise SpecError(
                f"K={top_k} exceeds the experts in the {self.topk_group} groups kept "
                f"({self.topk_group} x {num_experts // self.n_group})"
            )


@dataclass(frozen=True)
class MoESpec:
    """Everything that defines an MoE layer's math. Immutable and validated at construction."""

    num_experts: int  # E (global)
    top_k: int  # K
    hidden_size: int  # H
    intermediate_size: int  # I
    weight_format: WeightFormat = WeightFormat.BF16
    fp8_scale: Fp8Scale | None = None  # required iff weight_format is FP8_E4M3
    act_dtype: torch.dtype = torch.bfloat16
    act_quant: ActivationQuant = ActivationQuant.NONE
    activation: ActivationSpec = field(default_factory=lambda: ActivationSpec(Activation.SILU))
    gate_layout: GateLayout = GateLayout.CONCAT
    has_bias: bool = False  # b13 [E, 2I] and b2 [E, H] both present
    router_weight_placement: RouterWeightPlacement = RouterWeightPlacement.OUTPUT
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    num_local_experts: int | None = None  # E_local with expert parallelism; None means E

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            check_int(f"MoESpec.{name}", getattr(self, name), minimum=1)
        if self.top_k > self.num_experts:
            raise SpecError(f"top_k K={self.top_k} cannot exceed num_experts E={self.num_experts}")
        for name, enum_type in _ENUM_FIELDS:
            check_enum(f"MoESpec.{name}", getattr(self, name), enum_type)
        check_enum("MoESpec.fp8_scale", self.fp8_scale, Fp8Scale, optional=True)
        check_bool("MoESpec.has_bias", self.has_bias)
        check_int("MoESpec.num_local_experts", self.num_local_experts, minimum=1, optional=True)
        for name, part in (("activation", ActivationSpec), ("routing", RoutingSpec)):
            if not isinstance(getattr(self, name), part):
                raise SpecError(
                    f"MoESpec.{name} must be a {part.__name__}, got {getattr(self, name)!r}; "
                    f"build one, e.g. {part.__name__}(...)"
                )
        if not isinstance(self.act_dtype, torch.dtype) or self.act_dtype not in _ACT_DTYPES:
            raise SpecError(
                f"act_dtype must be one of {_ACT_DTYPES}, got {self.act_dtype!r}; pass a torch dtype"
            )
        is_fp8 = self.weight_format is WeightFormat.FP8_E4M3
        if is_fp8 and self.fp8_scale is None:
            raise SpecError(
                f"FP8_E4M3 weights need fp8_scale (one of {[s.name for s in Fp8Scale]}), got None"
            )
        if not is_fp8 and self.fp8_scale is not None:
            raise SpecError(
                f"fp8_scale={self.fp8_scale.name} only applies to FP8_E4M3, not {self.weight_format.name}"
            )
        if self.act_quant is not ActivationQuant.NONE and self.weight_format not in _QUANTIZED_ACT_WEIGHTS:
            raise SpecError(
                f"act_quant={self.act_quant.name} needs FP8_E4M3 (W8A8) or MXFP4 (W4A8) weights, "
                f"got {self.weight_format.name}; "
                "use act_quant=NONE"
            )
        if (
            is_fp8
            and self.act_quant is ActivationQuant.FP8_PER_GROUP_128
            and self.fp8_scale is not Fp8Scale.BLOCK_128
        ):
            raise SpecError(
                f"per-1x128-group activation quantization pairs with BLOCK_128 weight scales, "
                f"got {self.fp8_scale}"
            )
        if self.router_weight_placement is RouterWeightPlacement.INPUT and self.top_k != 1:
            raise SpecError(
                f"router weights on the input are only defined for K=1, got K={self.top_k}; "
                "use OUTPUT placement"
            )
        e_local = self.num_local_experts
        if e_local is not None and e_local > self.num_experts:
            raise SpecError(
                f"num_local_experts must be None or in [1, E={self.num_experts}], got {e_local!r}"
            )
        self.routing.check_experts(self.num_experts, self.top_k)

    def tokens_per_expert(self, num_tokens: int) -> float:
        """(token, expert) pairs each expert sees at `num_tokens` (at least one token): T * K / E, the regime
        the kernels' tiles follow. An expert-parallel rank's T counts every token it runs (gathered from, or
        sent by, all ranks), whose K picks spread over all E experts: each of its experts sees T * K / E
        pairs, as in the whole layer at that T (not T * K / E_local)."""
        return max(num_tokens, 1) * self.top_k / self.num_experts

    # Short names used throughout the code base.
    @property
    def E(self) -> int:  # noqa: N802
        return self.num_experts

    @property
    def E_local(self) -> int:  # noqa: N802
        return self.num_experts if self.num_local_experts is None else self.num_local_experts

    @property
    def K(self) -> int:  # noqa: N802
        return self.top_k

    @property
    def H(self) -> int:  # noqa: N802
        return self.hidden_size

    @property
    def I(self) -> int:  # noqa: N802, E743
        return self.intermediate_size

    @property
    def uses_expert_map(self) -> bool:
        return self.num_local_experts is not None

    @property
    def scales_per_128_of_k(self) -> bool:
        """Whether weight or activation scales change every 128 elements along a GEMM's K (DeepSeek-V3's
        block scales, per-1x128 activation groups): each 128-wide K-step's product is scaled on its own."""
        return self.fp8_scale is Fp8Scale.BLOCK_128 or self.act_quant is ActivationQuant.FP8_PER_GROUP_128

    @property
    def expert_weight_bytes(self) -> int:
        """Bytes of one expert's w13 and w2 as stored (MXFP4: 4-bit codes and a scale byte per 32; FP8:
        the codes, its 128x128 block scales under 0.01 %), biases included: what a GEMM streams per hit
        expert."""
        elements = 3 * self.H * self.I
        fmt = self.weight_format
        if fmt is WeightFormat.MXFP4:
            matrix = elements // 2 + elements // 32
        elif fmt is WeightFormat.FP8_E4M3:
            matrix = elements
        else:
            matrix = elements * fmt.float_dtype.itemsize  # no allocation: the launch asks per call
        bias = (2 * self.I + self.H) * 2 if self.has_bias else 0  # b13 [2I] and b2 [H], bf16
        return matrix + bias

    def describe(self) -> str:
        fmt = self.weight_format.name + (f"/{self.fp8_scale.name}" if self.fp8_scale else "")
        return (
            f"E={self.E} K={self.K} H={self.H} I={self.I} {fmt} "
            f"act={str(self.act_dtype).removeprefix('torch.')}"
            f" act_quant={self.act_quant.name} {self.activation.describe()} {self.gate_layout.name}"
            f" bias={'yes' if self.has_bias else 'no'} router_on={self.router_weight_placement.name}"
            f" routing={self.routing.method.name}"
            + (f" E_local={self.E_local}" if self.uses_expert_map else "")
        )
