"""Hugging Face transformers MoE blocks (float weights) -> moekit spec, `ExpertWeights` and router.

Data flow:
  HF config -> `spec_from_hf_config` -> `MoESpec` (E, K, H, I, activation, layout, biases, routing)
  HF experts module (float parameters) -> `from_hf_{gpt_oss,mixtral,qwen3_moe}_experts`: parameters
    rearranged to moekit's `[out, in]` w13 `[E, 2I, H]` / w2 `[E, H, I]`, gate/up rows reordered if a
    target layout other than the source's is asked for (on the floats, so any format works), then
    `ExpertWeights.from_float` casts or quantizes -> `ExpertWeights`
  HF MoE block (router + experts) + config -> `from_hf_moe_block` -> `HfMoeLayer`, whose
    `router_logits` -> `moekit.route` -> `fused_moe_reference` reproduces the block's output.

Parameter layouts, read from the installed transformers 5.24 source (`models/*/modeling_*.py`):
- `GptOssExperts`: `gate_up_proj [E, H, 2I]` used as `x @ W` (transposed against moekit), columns
  interleaved (gate = `[..., ::2]`, up = `[..., 1::2]`); `gate_up_proj_bias [E, 2I]`;
  `down_proj [E, I, H]` (transposed); `down_proj_bias [E, H]`; activation SWIGLU_OAI with
  `config.swiglu_alpha` and `config.swiglu_limit`. Router `mlp.router` (weight `[E, H]`, bias `[E]`):
  top-k of the logits, softmax over the K (TOPK_SOFTMAX).
- `MixtralExperts` / `Qwen3MoeExperts`: `gate_up_proj [E, 2I, H]` used with `F.linear` (`[out, in]`),
  split with `.chunk(2)` so gate rows come first (CONCAT); `down_proj [E, H, I]`; `ACT2FN[hidden_act]`;
  no biases. Router `mlp.gate` (weight `[E, H]`, no bias): softmax over E in fp32, top-k; Mixtral
  always renormalizes, Qwen3-MoE iff `config.norm_topk_prob`.
- transformers 4.x kept experts as an `nn.ModuleList` of per-expert MLPs (Mixtral `w1` gate, `w3` up,
  `w2` down; Qwen3-MoE `gate_proj`, `up_proj`, `down_proj`, all `nn.Linear` `[out, in]`); those are
  stacked into the same CONCAT layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import DTypeError, FormatError, ShapeError, SpecError
from moekit.formats.mxfp4 import DEFAULT_SCALE_RULE, Mxfp4ScaleRule
from moekit.ops import route
from moekit.reference import fused_moe_reference
from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
)
from moekit.weights import ExpertWeights, gate_layout_permutation

# HF `hidden_act` names (transformers.activations.ACT2FN) -> moekit activations with the same math.
_HF_ACTIVATIONS = {
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "gelu": Activation.GELU,  # exact erf GELU
    "gelu_pytorch_tanh": Activation.GELU_TANH,
}
_FLOAT_FORMATS = {
    torch.float32: WeightFormat.FP32,
    torch.bfloat16: WeightFormat.BF16,
    torch.float16: WeightFormat.FP16,
}
_SUPPORTED = ("gpt_oss", "mixtral", "qwen3_moe")
# transformers 4.x `GptOssExperts` hard-coded alpha = 1.702 and had no `swiglu_alpha` config field.
_GPT_OSS_ALPHA_BEFORE_V5 = 1.702


def _model_type(config: object) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        raise SpecError(f"unsupported HF model_type {model_type!r}; supported: {list(_SUPPORTED)}")
    return model_type


def spec_from_hf_config(
    config: object,
    *,
    weight_format: WeightFormat,
    act_dtype: torch.dtype,
    fp8_scale: Fp8Scale | None = None,
    gate_layout: GateLayout | None = None,
) -> MoESpec:
    """The `MoESpec` of one MoE block of an HF GptOss / Mixtral / Qwen3-MoE config.

    `gate_layout` None keeps the checkpoint's (INTERLEAVED for GPT-OSS, CONCAT otherwise).
    """
    model_type = _model_type(config)
    if model_type == "gpt_oss":
        alpha = getattr(config, "swiglu_alpha", None)
        activation = ActivationSpec(
            Activation.SWIGLU_OAI,
            alpha=_GPT_OSS_ALPHA_BEFORE_V5 if alpha is None else float(alpha),
            limit=None if _swiglu_limit(config) is None else float(_swiglu_limit(config)),
        )
        sizes = dict(num_experts=config.num_local_experts, intermediate_size=config.intermediate_size)
        routing = RoutingSpec(RoutingMethod.TOPK_SOFTMAX)
        source_layout, has_bias = GateLayout.INTERLEAVED, True
    else:
        act = _HF_ACTIVATIONS.get(config.hidden_act)
        if act is None:
            raise SpecError(
                f"hidden_act={config.hidden_act!r} has no moekit activation; known: {list(_HF_ACTIVATIONS)}"
            )
        activation = ActivationSpec(act)
        if model_type == "mixtral":
            sizes = dict(num_experts=config.num_local_experts, intermediate_size=config.intermediate_size)
            routing = RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=True)
        else:
            sizes = dict(num_experts=config.num_experts, intermediate_size=config.moe_intermediate_size)
            routing = RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=bool(config.norm_topk_prob))
        source_layout, has_bias = GateLayout.CONCAT, False
    return MoESpec(
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        **sizes,
        weight_format=weight_format,
        fp8_scale=fp8_scale,
        act_dtype=act_dtype,
        activation=activation,
        gate_layout=source_layout if gate_layout is None else gate_layout,
        has_bias=has_bias,
        routing=routing,
    )


def _float_param(module: torch.nn.Module, name: str, *, rank: int) -> torch.Tensor:
    t = getattr(module, name, None)
    if not isinstance(t, torch.Tensor):
        raise ShapeError(
            f"{type(module).__name__} has no tensor {name!r}; is this the experts module of the block?"
        )
    if not t.is_floating_point():
        raise FormatError(
            f"{type(module).__name__}.{name} is {t.dtype}, not float: the module holds quantized experts. "
            "Load MXFP4 checkpoints with moekit.checkpoint.load_gpt_oss_layer instead"
        )
    if t.dim() != rank:
        raise ShapeError(f"{type(module).__name__}.{name} must have {rank} dims, got shape {tuple(t.shape)}")
    return t.detach()


def _build(
    *,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    source: GateLayout,
    target: GateLayout,
    format: WeightFormat | None,  # noqa: A002 - matches ExpertWeights.from_float
    fp8_scale: Fp8Scale | None,
    mxfp4_rule: Mxfp4ScaleRule,
) -> ExpertWeights:
    """Reorder gate/up rows on the float tensors (valid for every format), then cast or quantize."""
    e, two_i, h = w13.shape
    if w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ShapeError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    perm = gate_layout_permutation(two_i // 2, source=source, target=target).to(w13.device)
    w13 = w13.index_select(1, perm)  # index_select copies: the result never aliases the HF parameter
    b13 = None if b13 is None else b13.detach().index_select(1, perm)
    if format is None:
        format = _FLOAT_FORMATS.get(w13.dtype)  # noqa: A001
        if format is None:
            choices = [f.name for f in WeightFormat]
            raise DTypeError(f"cannot keep dtype {w13.dtype}; pass format= (one of {choices})")
    return ExpertWeights.from_float(
        w13=w13,
        w2=w2.contiguous().clone(),
        b13=b13,
        b2=None if b2 is None else b2.detach().clone(),
        format=format,
        gate_layout=target,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
    )


def from_hf_gpt_oss_experts(
    experts: torch.nn.Module,
    *,
    format: WeightFormat | None = None,  # noqa: A002
    fp8_scale: Fp8Scale | None = None,
    mxfp4_rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE,
    gate_layout: GateLayout = GateLayout.INTERLEAVED,
) -> ExpertWeights:
    """HF `GptOssExperts` (float) -> `ExpertWeights` with biases; `format` None keeps the float dtype."""
    gate_up = _float_param(experts, "gate_up_proj", rank=3)  # [E, H, 2I]
    down = _float_param(experts, "down_proj", rank=3)  # [E, I, H]
    b13 = _float_param(experts, "gate_up_proj_bias", rank=2)  # [E, 2I]
    b2 = _float_param(experts, "down_proj_bias", rank=2)  # [E, H]
    e, h, two_i = gate_up.shape
    for name, t, shape in (
        ("down_proj", down, (e, two_i // 2, h)),
        ("gate_up_proj_bias", b13, (e, two_i)),
        ("down_proj_bias", b2, (e, h)),
    ):
        if tuple(t.shape) != shape:
            raise ShapeError(
                f"GptOssExperts.{name} has shape {tuple(t.shape)}, expected {shape} "
                f"(from gate_up_proj [E, H, 2I] = {tuple(gate_up.shape)})"
            )
    return _build(
        w13=gate_up.transpose(1, 2),
        w2=down.transpose(1, 2),
        b13=b13,
        b2=b2,
        source=GateLayout.INTERLEAVED,
        target=gate_layout,
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
    )


def _concat_experts(
    experts: torch.nn.Module, *, legacy_names: tuple[str, str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] (gate rows first) and w2 [E, H, I] of a fused (v5) or per-expert (v4) module."""
    if isinstance(experts, torch.nn.ModuleList):
        gate, up, down = legacy_names
        try:
            w13 = torch.stack([torch.cat([getattr(m, gate).weight, getattr(m, up).weight]) for m in experts])
            w2 = torch.stack([getattr(m, down).weight for m in experts])
        except AttributeError as exc:
            raise ShapeError(
                f"per-expert modules need Linear layers {legacy_names} (gate, up, down): {exc}"
            ) from exc
        return w13.detach(), w2.detach()
    return _float_param(experts, "gate_up_proj", rank=3), _float_param(experts, "down_proj", rank=3)


def _from_hf_concat_experts(
    experts: torch.nn.Module,
    *,
    legacy_names: tuple[str, str, str],
    format: WeightFormat | None,  # noqa: A002
    fp8_scale: Fp8Scale | None,
    mxfp4_rule: Mxfp4ScaleRule,
    gate_layout: GateLayout,
) -> ExpertWeights:
    w13, w2 = _concat_experts(experts, legacy_names=legacy_names)
    return _build(
        w13=w13,
        w2=w2,
        b13=None,
        b2=None,
        source=GateLayout.CONCAT,
        target=gate_layout,
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
    )


def from_hf_mixtral_experts(
    experts: torch.nn.Module,
    *,
    format: WeightFormat | None = None,  # noqa: A002
    fp8_scale: Fp8Scale | None = None,
    mxfp4_rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE,
    gate_layout: GateLayout = GateLayout.CONCAT,
) -> ExpertWeights:
    """HF `MixtralExperts` (or a 4.x ModuleList of w1/w3/w2 MLPs) -> `ExpertWeights`, no biases."""
    return _from_hf_concat_experts(
        experts,
        legacy_names=("w1", "w3", "w2"),
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
        gate_layout=gate_layout,
    )


def from_hf_qwen3_moe_experts(
    experts: torch.nn.Module,
    *,
    format: WeightFormat | None = None,  # noqa: A002
    fp8_scale: Fp8Scale | None = None,
    mxfp4_rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE,
    gate_layout: GateLayout = GateLayout.CONCAT,
) -> ExpertWeights:
    """HF `Qwen3MoeExperts` (or a 4.x ModuleList of gate/up/down_proj MLPs) -> `ExpertWeights`, no biases."""
    return _from_hf_concat_experts(
        experts,
        legacy_names=("gate_proj", "up_proj", "down_proj"),
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
        gate_layout=gate_layout,
    )


@dataclass(frozen=True)
class HfMoeLayer:
    """An HF MoE block as moekit sees it: the spec, the expert weights and the router's linear map."""

    spec: MoESpec
    weights: ExpertWeights
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None  # [E] (GPT-OSS) or None

    def __post_init__(self) -> None:
        self.weights.validate(self.spec)
        if tuple(self.router_weight.shape) != (self.spec.E, self.spec.H):
            raise ShapeError(
                f"router weight has shape {tuple(self.router_weight.shape)}, expected "
                f"({self.spec.E}, {self.spec.H})"
            )
        if self.router_bias is not None and tuple(self.router_bias.shape) != (self.spec.E,):
            raise ShapeError(
                f"router bias has shape {tuple(self.router_bias.shape)}, expected ({self.spec.E},)"
            )

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[T, E]` = x @ W^T (+ b)."""
        bias = None if self.router_bias is None else self.router_bias.float()
        return torch.nn.functional.linear(x.float(), self.router_weight.float(), bias)

    def route(self, x: torch.Tensor) -> RoutingResult:
        return route(self.router_logits(x), top_k=self.spec.K, spec=self.spec.routing)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output `[T, H]` computed by `fused_moe_reference`."""
        return fused_moe_reference(x, self.weights, self.route(x), spec=self.spec)


def from_hf_moe_block(
    block: torch.nn.Module,
    *,
    config: object,
    format: WeightFormat | None = None,  # noqa: A002
    fp8_scale: Fp8Scale | None = None,
    mxfp4_rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE,
    act_dtype: torch.dtype | None = None,
    gate_layout: GateLayout | None = None,
) -> HfMoeLayer:
    """An HF GptOss `mlp` / Mixtral or Qwen3-MoE sparse MoE block -> `HfMoeLayer`.

    `format` None keeps the experts' float dtype; `act_dtype` None uses the router weight's dtype.
    """
    model_type = _model_type(config)
    router = block.router if model_type == "gpt_oss" else block.gate
    convert = {
        "gpt_oss": from_hf_gpt_oss_experts,
        "mixtral": from_hf_mixtral_experts,
        "qwen3_moe": from_hf_qwen3_moe_experts,
    }[model_type]
    kwargs = dict(format=format, fp8_scale=fp8_scale, mxfp4_rule=mxfp4_rule)
    if gate_layout is not None:
        kwargs["gate_layout"] = gate_layout
    weights = convert(block.experts, **kwargs)
    router_weight = router.weight.detach().clone()
    bias = getattr(router, "bias", None)
    spec = spec_from_hf_config(
        config,
        weight_format=weights.format,
        fp8_scale=weights.fp8_scale,
        gate_layout=weights.gate_layout,
        act_dtype=router_weight.dtype if act_dtype is None else act_dtype,
    )
    return HfMoeLayer(
        spec=spec,
        weights=weights,
        router_weight=router_weight,
        router_bias=None if bias is None else bias.detach().clone(),
    )


def _swiglu_limit(config) -> float | None:
    """The clamp limit the HF GPT-OSS experts apply. Older transformers (5.17) configs have no
    `swiglu_limit` field and their experts then clamp at 7.0 (`getattr(config, "swiglu_limit", 7.0)`):
    mirror that, so the spec computes what the user's model computes."""
    return getattr(config, "swiglu_limit", 7.0)
