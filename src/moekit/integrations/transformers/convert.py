"""Hugging Face transformers MoE blocks (float weights) -> moekit spec, `ExpertWeights` and router.

Data flow (every family-specific fact comes from the family's `HfFamily` row, `families.FAMILIES`):
  HF config -> `spec_from_hf_config` -> `MoESpec` (E, K, H, I, activation, layout, biases, routing:
    DeepSeek-V3's SIGMOID_GROUPED from n_group, topk_group, routed_scaling_factor; norm_topk_prob=False
    refused, as SIGMOID_GROUPED always renormalizes)
  HF experts module (float parameters) -> `from_hf_experts` (or `from_hf_{gpt_oss,mixtral,qwen3_moe}
    _experts`): parameters rearranged to moekit's `[out, in]` w13 `[E, 2I, H]` / w2 `[E, H, I]`, gate/up
    rows reordered if a target layout other than the source's is asked for (on the floats, so any
    format works), then `ExpertWeights.from_float` casts or quantizes -> `ExpertWeights`;
    `hf_expert_tensors` is the exact inverse (moekit weights -> the HF experts' parameters).
  HF MoE block (router + experts) + config -> `from_hf_moe_block` (the config checked against every
    field the block holds itself, `held.held_config_fields`) -> `HfMoeLayer`, whose `router_logits` ->
    `moekit.route` (with DeepSeek-V3's correction bias) -> `fused_moe_reference` reproduces the block's
    routed experts (its whole output for a block without shared experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.checkpoint.hf_config import HF_ACTIVATIONS
from moekit.checkpoint.hf_rules import (
    SIGMOID_CORRECTED_ROUTING,
    HfRouting,
    greedy_softmax_routing,
    sigmoid_grouped_routing,
)
from moekit.errors import DTypeError, FormatError, ShapeError, SpecError
from moekit.formats.mxfp4 import DEFAULT_SCALE_RULE, Mxfp4ScaleRule
from moekit.integrations.transformers.families import Family, HfFamily
from moekit.integrations.transformers.held import check_config_matches_block
from moekit.ops import route
from moekit.reference import fused_moe_reference
from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RoutingSpec,
    WeightFormat,
)
from moekit.weights import ExpertWeights, gate_layout_permutation


def _activation(config: object, hf: HfFamily) -> ActivationSpec:
    if hf.swiglu is not None:
        alpha = getattr(config, hf.swiglu.config_alpha, None)
        limit = getattr(config, hf.swiglu.config_limit, hf.swiglu.limit_if_missing)
        return ActivationSpec(
            Activation.SWIGLU_OAI,
            alpha=hf.swiglu.alpha_if_missing if alpha is None else float(alpha),
            limit=None if limit is None else float(limit),
        )
    act = HF_ACTIVATIONS.get(config.hidden_act)
    if act is None:
        raise SpecError(
            f"hidden_act={config.hidden_act!r} has no moekit activation; known: {list(HF_ACTIVATIONS)}"
        )
    return ActivationSpec(act)


def _routing(config: object, hf: HfFamily) -> RoutingSpec:
    if hf.hf_routing is None or hf.hf_routing is HfRouting.SOFTMAX:
        renormalize = True if hf.renormalize_field is None else bool(getattr(config, hf.renormalize_field))
        return RoutingSpec(hf.routing_method, renormalize=renormalize)
    if hf.hf_routing is HfRouting.SIGMOID_CORRECTED:  # MiniMax-M2: the router holds no constants
        return SIGMOID_CORRECTED_ROUTING
    missing = [field for _, field in hf.router_fields if getattr(config, field, None) is None]
    if missing:
        raise SpecError(f"the {config.model_type} config has no {missing}: its routing is unknown")
    if hf.hf_routing is HfRouting.SOFTMAX_GREEDY_SCALED:  # DeepSeek-V2
        return greedy_softmax_routing(
            topk_method=config.topk_method, routed_scaling_factor=config.routed_scaling_factor
        )
    return sigmoid_grouped_routing(
        n_group=int(config.n_group),
        topk_group=int(config.topk_group),
        routed_scaling_factor=config.routed_scaling_factor,
        norm_topk_prob=config.norm_topk_prob,
        source="a block",
    )


def spec_from_hf_config(
    config: object,
    *,
    weight_format: WeightFormat,
    act_dtype: torch.dtype,
    fp8_scale: Fp8Scale | None = None,
    gate_layout: GateLayout | None = None,
) -> MoESpec:
    """The `MoESpec` of one MoE block's routed experts of an HF GptOss / Mixtral / Qwen2-MoE / Qwen3-MoE /
    DeepSeek-V3 config.

    `gate_layout` None keeps the checkpoint's (INTERLEAVED for GPT-OSS, CONCAT otherwise).
    """
    hf = Family.of_model_type(getattr(config, "model_type", None)).hf
    activation = _activation(config, hf)
    return MoESpec(
        num_experts=getattr(config, hf.num_experts_field),
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, hf.intermediate_field),
        weight_format=weight_format,
        fp8_scale=fp8_scale,
        act_dtype=act_dtype,
        activation=activation,
        gate_layout=hf.gate_layout if gate_layout is None else gate_layout,
        has_bias=hf.has_bias,
        routing=_routing(config, hf),
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


def _stacked_legacy_experts(
    experts: torch.nn.ModuleList, names: tuple[str, str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] (gate rows first) and w2 [E, H, I] of a 4.x list of per-expert MLPs."""
    gate, up, down = names
    try:
        w13 = torch.stack([torch.cat([getattr(m, gate).weight, getattr(m, up).weight]) for m in experts])
        w2 = torch.stack([getattr(m, down).weight for m in experts])
    except AttributeError as exc:
        raise ShapeError(f"per-expert modules need Linear layers {names} (gate, up, down): {exc}") from exc
    return w13.detach(), w2.detach()


def _hf_expert_params(
    experts: torch.nn.Module, hf: HfFamily
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """w13 [E, 2I, H], w2 [E, H, I] (in the family's gate layout) and the biases of an experts module."""
    if hf.legacy_expert_names is not None and isinstance(experts, torch.nn.ModuleList):
        return *_stacked_legacy_experts(experts, hf.legacy_expert_names), None, None
    params = {"gate_up_proj": _float_param(experts, "gate_up_proj", rank=3)}
    params["down_proj"] = _float_param(experts, "down_proj", rank=3)
    if hf.has_bias:
        params["gate_up_proj_bias"] = _float_param(experts, "gate_up_proj_bias", rank=2)
        params["down_proj_bias"] = _float_param(experts, "down_proj_bias", rank=2)
    if hf.gate_up_transposed:  # [E, H, 2I] and [E, I, H]: each expert's matrices used as x @ W
        e, h, two_i = params["gate_up_proj"].shape
        expected = {
            "down_proj": (e, two_i // 2, h),
            "gate_up_proj_bias": (e, two_i),
            "down_proj_bias": (e, h),
        }
        for name, t in params.items():
            if name in expected and tuple(t.shape) != expected[name]:
                raise ShapeError(
                    f"{type(experts).__name__}.{name} has shape {tuple(t.shape)}, expected {expected[name]} "
                    f"(from gate_up_proj [E, H, 2I] = {tuple(params['gate_up_proj'].shape)})"
                )
        w13, w2 = params["gate_up_proj"].transpose(1, 2), params["down_proj"].transpose(1, 2)
    else:
        w13, w2 = params["gate_up_proj"], params["down_proj"]
    return w13, w2, params.get("gate_up_proj_bias"), params.get("down_proj_bias")


def hf_expert_tensors(family: Family, weights: ExpertWeights) -> dict[str, torch.Tensor]:
    """The HF experts' parameters rebuilt from moekit weights: the exact inverse of `from_hf_experts`."""
    hf = family.hf
    w = weights.to_layout(hf.gate_layout)
    tensors = {"gate_up_proj": w.w13, "down_proj": w.w2}
    if hf.gate_up_transposed:
        tensors = {name: t.transpose(1, 2) for name, t in tensors.items()}
    if hf.has_bias:
        tensors |= {"gate_up_proj_bias": w.b13, "down_proj_bias": w.b2}
    return tensors


def from_hf_experts(
    experts: torch.nn.Module,
    family: Family,
    *,
    format: WeightFormat | None = None,  # noqa: A002 - matches ExpertWeights.from_float
    fp8_scale: Fp8Scale | None = None,
    mxfp4_rule: Mxfp4ScaleRule = DEFAULT_SCALE_RULE,
    gate_layout: GateLayout | None = None,
) -> ExpertWeights:
    """A `family` experts module (float) -> `ExpertWeights`; `format` None keeps the float dtype,
    `gate_layout` None keeps the family's (the reorder is done on the floats, so any format works)."""
    hf = family.hf
    w13, w2, b13, b2 = _hf_expert_params(experts, hf)
    e, two_i, h = w13.shape
    if w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ShapeError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    target = hf.gate_layout if gate_layout is None else gate_layout
    perm = gate_layout_permutation(two_i // 2, source=hf.gate_layout, target=target).to(w13.device)
    w13 = w13.index_select(1, perm)  # index_select copies: the result never aliases the HF parameter
    b13 = None if b13 is None else b13.index_select(1, perm)
    if format is None:
        format = WeightFormat.of_float_dtype(w13.dtype)  # noqa: A001
        if format is None:
            choices = [f.name for f in WeightFormat]
            raise DTypeError(f"cannot keep dtype {w13.dtype}; pass format= (one of {choices})")
    return ExpertWeights.from_float(
        w13=w13,
        w2=w2.contiguous().clone(),
        b13=b13,
        b2=None if b2 is None else b2.clone(),
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
    return from_hf_experts(
        experts,
        Family.GPT_OSS,
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
        gate_layout=gate_layout,
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
    return from_hf_experts(
        experts,
        Family.MIXTRAL,
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
    return from_hf_experts(
        experts,
        Family.QWEN3_MOE,
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
        gate_layout=gate_layout,
    )


@dataclass(frozen=True)
class HfMoeLayer:
    """An HF MoE block's routed experts as moekit sees them: the spec, the expert weights and the router's
    linear map (and DeepSeek-V3's correction bias). A block's shared experts are not part of it: they
    stay HF modules (`block.MoekitMoEBlock` runs them beside moekit's layer)."""

    spec: MoESpec
    weights: ExpertWeights
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None  # [E] (GPT-OSS) or None
    correction_bias: torch.Tensor | None = None  # [E] (DeepSeek-V3's `e_score_correction_bias`) or None

    def __post_init__(self) -> None:
        self.weights.validate(self.spec)
        if self.spec.routing.has_correction_bias != (self.correction_bias is not None):
            raise SpecError(
                f"spec.routing.has_correction_bias={self.spec.routing.has_correction_bias} but the "
                f"correction bias {'was' if self.correction_bias is not None else 'was not'} given"
            )
        if self.correction_bias is not None and tuple(self.correction_bias.shape) != (self.spec.E,):
            raise ShapeError(
                f"correction bias has shape {tuple(self.correction_bias.shape)}, expected ({self.spec.E},)"
            )
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
        return route(
            self.router_logits(x),
            top_k=self.spec.K,
            spec=self.spec.routing,
            correction_bias=self.correction_bias,
        )

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output `[T, H]` computed by `fused_moe_reference` (a block without shared
        experts returns exactly this)."""
        return fused_moe_reference(x, self.weights, self.route(x), spec=self.spec)


def correction_bias_of(block: torch.nn.Module, hf: HfFamily) -> torch.Tensor | None:
    """The block's `[E]` correction bias (its router's buffer, or MiniMax-M2's own), or None."""
    if hf.correction_bias is None:
        return None
    owner, _, name = hf.correction_bias.rpartition(".")
    return getattr(block.get_submodule(owner) if owner else block, name)


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
    """An HF GptOss `mlp` / Mixtral, Qwen2-MoE or Qwen3-MoE sparse MoE block / DeepseekV3MoE -> `HfMoeLayer`
    (the routed experts; DeepSeek-V3's correction bias copied from the router's buffer).

    `format` None keeps the experts' float dtype; `act_dtype` None uses the experts' float dtype (the
    router's may differ: DeepSeek-V3 models keep theirs in fp32).
    """
    family = Family.of_model_type(getattr(config, "model_type", None))
    router = getattr(block, family.router_name)
    weights = from_hf_experts(
        block.experts,
        family,
        format=format,
        fp8_scale=fp8_scale,
        mxfp4_rule=mxfp4_rule,
        gate_layout=gate_layout,
    )
    router_weight = router.weight.detach().clone()
    bias = getattr(router, "bias", None)
    experts_dtype = next(block.experts.parameters()).dtype  # float: `from_hf_experts` checked it
    spec = spec_from_hf_config(
        config,
        weight_format=weights.format,
        fp8_scale=weights.fp8_scale,
        gate_layout=weights.gate_layout,
        act_dtype=experts_dtype if act_dtype is None else act_dtype,
    )
    check_config_matches_block(config, spec, block, family, weights)
    correction = correction_bias_of(block, family.hf)
    return HfMoeLayer(
        spec=spec,
        weights=weights,
        router_weight=router_weight,
        router_bias=None if bias is None else bias.detach().clone(),
        correction_bias=None if correction is None else correction.detach().clone(),
    )
