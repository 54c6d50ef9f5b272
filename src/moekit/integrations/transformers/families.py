"""The Hugging Face MoE families moekit converts and patches, each described once.

Data flow: an HF config's `model_type` -> `Family.of_model_type` -> `Family`; an HF module -> `family_of`
(by exact block class) -> `Family`; `Family.hf` -> the frozen `HfFamily` row of `FAMILIES`, which
`convert` reads to turn a config and an experts module into moekit's spec and weights (and back), and
`patch` reads to find blocks, their router and the fields of a config it rebuilds from a block.

The facts below were read from the installed transformers 5.24 source (`models/*/modeling_*.py`):
- `GptOssMLP`: router `router` (weight `[E, H]`, bias `[E]`; top-k of the logits, softmax over the K),
  experts `GptOssExperts` with `gate_up_proj [E, H, 2I]` used as `x @ W` (transposed against moekit),
  columns interleaved (gate = `[..., ::2]`, up = `[..., 1::2]`), `gate_up_proj_bias [E, 2I]`,
  `down_proj [E, I, H]`, `down_proj_bias [E, H]`; activation SWIGLU_OAI with `config.swiglu_alpha`
  and `config.swiglu_limit` (the experts hold them as `alpha` and `limit`). The block returns
  `(hidden, router_scores)`.
- `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock`: router `gate` (weight `[E, H]`, no bias; softmax
  over E in fp32, top-k; Mixtral always renormalizes, Qwen3-MoE iff `norm_topk_prob`, which the config
  and the router both hold), experts with `gate_up_proj [E, 2I, H]` used with `F.linear` (`[out, in]`),
  split with `.chunk(2)` so gate rows come first (CONCAT), `down_proj [E, H, I]`, `ACT2FN[hidden_act]`,
  no biases. The blocks return `hidden`. transformers 4.x kept these experts as an `nn.ModuleList` of
  per-expert MLPs of `nn.Linear` `[out, in]` (Mixtral `w1` gate, `w3` up, `w2` down; Qwen3-MoE
  `gate_proj`, `up_proj`, `down_proj`).
- `DeepseekV3MoE`: router `gate` (`DeepseekV3TopkRouter`: fp32 `weight [E, H]`, fp32 buffer
  `e_score_correction_bias [E]`, attributes `top_k`, `num_group` (config `n_group`), `topk_group`,
  `routed_scaling_factor`, `norm_topk_prob`; sigmoid scores, groups by their best two biased scores,
  top-k, weights the unbiased scores renormalized iff `norm_topk_prob`, times the factor: moekit's
  SIGMOID_GROUPED), experts laid out as Mixtral's, `shared_experts` (a gate/up/down MLP on the block's
  input) added to the routed output. A model keeps the router in fp32 when loaded in another dtype
  (`_keep_in_fp32_modules_strict`). The first `first_k_dense_replace` layers are dense MLPs.
- `Qwen2MoeSparseMoeBlock`: router `gate` as Qwen3-MoE's (`top_k`, `norm_topk_prob`), experts as Qwen3-MoE's,
  plus `shared_expert` (an MLP) and `shared_expert_gate` (`Linear(H, 1)`, no bias): output = routed +
  sigmoid(shared_expert_gate(x)) * shared_expert(x).
- `Glm4MoeMoE`, `Dots1MoE`, `Glm4MoeLiteMoE` (GLM-4.7-Flash): DeepSeek-V3's router and block, code for
  code; GLM-4.7-Flash's dense layers are those `mlp_layer_types` does not call "sparse".
- `DeepseekV2Moe`: router `gate` (`DeepseekV2TopkRouter`: fp32 `weight [E, H]`, attributes `top_k`,
  `topk_method`, `num_group`, `topk_group`, `routed_scaling_factor`; softmax over E, top-k, no
  renormalization, times the factor for `topk_method` "greedy"), experts and `shared_experts` as
  DeepSeek-V3's.
- `OlmoeSparseMoeBlock`: Qwen3-MoE's router (`top_k`, `norm_topk_prob`) and experts; no shared experts.
- `MiniMaxM2SparseMoeBlock`: router `gate` (`MiniMaxM2TopKRouter`: `weight [E, H]` in the model's dtype,
  attribute `top_k`), experts as Mixtral's, and the block's own buffer `e_score_correction_bias [E]`,
  which the block passes to the router's forward (sigmoid scores, choice by the biased scores, weights
  the unbiased ones renormalized: SIGMOID_GROUPED without groups).
Every family's router forward returns `(router_logits, router_scores, router_indices)`. moekit computes
the routed experts; a block's shared experts stay HF modules, run by `block.MoekitMoEBlock`.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass

import torch

from moekit.checkpoint.hf_config import LAYOUTS, HfCheckpointFamily
from moekit.checkpoint.hf_rules import HfRouting
from moekit.errors import SpecError
from moekit.spec import GateLayout, RoutingMethod


@dataclass(frozen=True)
class SwigluFields:
    """Where a family with OpenAI's clamped SwiGLU keeps alpha and the clamp limit."""

    config_alpha: str  # config field
    config_limit: str
    experts_alpha: str  # attribute of the experts module
    experts_limit: str
    alpha_if_missing: float  # the alpha of versions whose config has no alpha field
    limit_if_missing: float  # the clamp of versions whose config has no limit field


@dataclass(frozen=True)
class SharedExperts:
    """The modules a block adds beside its routed experts: `mlp(x)`, scaled by `sigmoid(gate(x))` if a
    gate is named."""

    mlp: str  # attribute of the block
    gate: str | None  # attribute of the block: a `Linear(H, 1)`; None: the MLP's output is added as is

    @classmethod
    def of_layout(cls, family: HfCheckpointFamily) -> SharedExperts | None:
        """The shared modules the checkpoint layout names (`{mlp}.` and maybe `{gate}.` key prefixes)."""
        names = [p.removesuffix(".") for p in LAYOUTS[family].shared_prefixes]
        return cls(mlp=names[0], gate=names[1] if len(names) > 1 else None) if names else None


@dataclass(frozen=True)
class HfFamily:
    """What moekit reads from (and writes back to) one family's MoE blocks, configs and experts."""

    block_module: str  # module path of the MoE block class in transformers 5.x
    block_class: str
    router_name: str  # the block's router attribute: a linear map with `weight [E, H]` and maybe `bias`
    returns_router_scores: bool  # the block returns `(hidden, router_scores)` rather than `hidden`
    num_experts_field: str  # config field holding E
    intermediate_field: str  # config field holding I
    swiglu: SwigluFields | None  # None: the activation is `ACT2FN[config.hidden_act]`
    routing_method: RoutingMethod
    renormalize_field: str | None  # config (and router) flag to renormalize the top-k; None: always
    gate_up_transposed: bool  # experts hold `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]` (x @ W)
    gate_layout: GateLayout  # order of the gate and up rows in `gate_up_proj`
    has_bias: bool  # experts hold `gate_up_proj_bias [E, 2I]` and `down_proj_bias [E, H]`
    legacy_expert_names: tuple[str, str, str] | None  # 4.x per-expert Linear names (gate, up, down)
    # (router attribute, config field) of the routing constants the router holds beyond top-k
    router_fields: tuple[tuple[str, str], ...] = ()
    # the `[E]` correction-bias buffer, relative to the block: `gate.e_score_correction_bias` (the router's,
    # DeepSeek-V3) or `e_score_correction_bias` (the block's, MiniMax-M2: its router's forward takes it)
    correction_bias: str | None = None
    shared: SharedExperts | None = None
    hf_routing: HfRouting | None = None  # how config fields give the routing (None: GPT-OSS's TOPK_SOFTMAX)

    @property
    def bias_on_block(self) -> bool:
        """The correction bias is a buffer of the block, passed to the router's forward (MiniMax-M2)."""
        return self.correction_bias is not None and "." not in self.correction_bias


class Family(enum.Enum):
    """The HF model families whose MoE blocks moekit replaces (values are HF `model_type`s).

    What moekit knows of each lives in its `HfFamily` row (`family.hf`). DeepSeek-V2/V3 and Qwen2-MoE
    blocks (and Qwen3-Next's, GLM-4.5's, GLM-4.7-Flash's, dots1's) add shared experts to the routed ones:
    moekit runs the routed experts, the blocks' own modules the shared ones."""

    GPT_OSS = "gpt_oss"
    MIXTRAL = "mixtral"
    QWEN3_MOE = "qwen3_moe"
    QWEN2_MOE = "qwen2_moe"
    QWEN3_NEXT = "qwen3_next"
    DEEPSEEK_V3 = "deepseek_v3"
    GLM4_MOE = "glm4_moe"
    DEEPSEEK_V2 = "deepseek_v2"
    OLMOE = "olmoe"
    MINIMAX_M2 = "minimax_m2"
    DOTS1 = "dots1"
    GLM4_MOE_LITE = "glm4_moe_lite"

    @property
    def hf(self) -> HfFamily:
        return FAMILIES[self]

    @property
    def router_name(self) -> str:
        return self.hf.router_name

    @classmethod
    def of_model_type(cls, model_type: object) -> Family:
        """The family of an HF config's `model_type`; `SpecError` if moekit does not convert it."""
        for family in cls:
            if family.value == model_type:
                return family
        raise SpecError(f"unsupported HF model_type {model_type!r}; supported: {[f.value for f in cls]}")


# The per-expert names, size fields, routings, renormalize flags, correction-bias places and shared-expert
# modules of every family but GPT-OSS are the checkpoint layouts' (`moekit.checkpoint.hf_config.LAYOUTS`):
# one statement of those facts for both readers.
def _from_layout(family: HfCheckpointFamily, block_module: str, block_class: str) -> HfFamily:
    """A routed-expert family laid out as Mixtral's (`[out, in]`, CONCAT, no biases, `ACT2FN`, router
    `gate`), its facts from the checkpoint layout."""
    layout = LAYOUTS[family]
    return HfFamily(
        block_module=block_module,
        block_class=block_class,
        router_name="gate",
        returns_router_scores=False,
        num_experts_field=layout.num_experts_fields[0],
        intermediate_field=layout.intermediate_field,
        swiglu=None,
        routing_method=layout.routing_method,
        renormalize_field=layout.renormalize_field,
        gate_up_transposed=False,
        gate_layout=GateLayout.CONCAT,
        has_bias=False,
        legacy_expert_names=layout.projections,
        router_fields=_ROUTER_FIELDS.get(layout.routing, ()),
        correction_bias=layout.correction_bias,
        shared=SharedExperts.of_layout(family),
        hf_routing=layout.routing,
    )


# The routers' routing attributes and the config fields they are read from: `DeepseekV3TopkRouter`'s
# (and GLM-4.5's, dots1's, GLM-4.7-Flash's), `DeepseekV2TopkRouter`'s. `MiniMaxM2TopKRouter` holds none.
_ROUTER_FIELDS = {
    HfRouting.SIGMOID_GROUPED: (
        ("num_group", "n_group"),
        ("topk_group", "topk_group"),
        ("routed_scaling_factor", "routed_scaling_factor"),
        ("norm_topk_prob", "norm_topk_prob"),
    ),
    HfRouting.SOFTMAX_GREEDY_SCALED: (
        ("topk_method", "topk_method"),
        ("routed_scaling_factor", "routed_scaling_factor"),
    ),
}

FAMILIES: dict[Family, HfFamily] = {
    Family.GPT_OSS: HfFamily(
        block_module="transformers.models.gpt_oss.modeling_gpt_oss",
        block_class="GptOssMLP",
        router_name="router",
        returns_router_scores=True,
        num_experts_field="num_local_experts",
        intermediate_field="intermediate_size",
        swiglu=SwigluFields(
            config_alpha="swiglu_alpha",
            config_limit="swiglu_limit",
            experts_alpha="alpha",
            experts_limit="limit",
            alpha_if_missing=1.702,  # transformers 4.x `GptOssExperts` hard-coded it
            limit_if_missing=7.0,  # 5.17's experts: `getattr(config, "swiglu_limit", 7.0)`
        ),
        routing_method=RoutingMethod.TOPK_SOFTMAX,
        renormalize_field=None,
        gate_up_transposed=True,
        gate_layout=GateLayout.INTERLEAVED,
        has_bias=True,
        legacy_expert_names=None,
    ),
    Family.MIXTRAL: _from_layout(
        HfCheckpointFamily.MIXTRAL, "transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"
    ),
    Family.QWEN3_MOE: _from_layout(
        HfCheckpointFamily.QWEN3_MOE,
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
    ),
    Family.QWEN2_MOE: _from_layout(
        HfCheckpointFamily.QWEN2_MOE,
        "transformers.models.qwen2_moe.modeling_qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
    ),
    Family.QWEN3_NEXT: _from_layout(
        HfCheckpointFamily.QWEN3_NEXT,
        "transformers.models.qwen3_next.modeling_qwen3_next",
        "Qwen3NextSparseMoeBlock",
    ),
    Family.DEEPSEEK_V3: _from_layout(
        HfCheckpointFamily.DEEPSEEK_V3,
        "transformers.models.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3MoE",
    ),
    Family.GLM4_MOE: _from_layout(  # DeepSeek-V3's block and router (`Glm4MoeTopkRouter`)
        HfCheckpointFamily.GLM4_MOE, "transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeMoE"
    ),
    Family.DEEPSEEK_V2: _from_layout(
        HfCheckpointFamily.DEEPSEEK_V2,
        "transformers.models.deepseek_v2.modeling_deepseek_v2",
        "DeepseekV2Moe",
    ),
    Family.OLMOE: _from_layout(
        HfCheckpointFamily.OLMOE, "transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"
    ),
    Family.MINIMAX_M2: _from_layout(
        HfCheckpointFamily.MINIMAX_M2,
        "transformers.models.minimax_m2.modeling_minimax_m2",
        "MiniMaxM2SparseMoeBlock",
    ),
    Family.DOTS1: _from_layout(  # DeepSeek-V3's block and router (`Dots1TopkRouter`)
        HfCheckpointFamily.DOTS1, "transformers.models.dots1.modeling_dots1", "Dots1MoE"
    ),
    Family.GLM4_MOE_LITE: _from_layout(  # DeepSeek-V3's block and router (`Glm4MoeLiteTopkRouter`)
        HfCheckpointFamily.GLM4_MOE_LITE,
        "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite",
        "Glm4MoeLiteMoE",
    ),
}


def block_class_names() -> list[str]:
    """The supported MoE block class names, for messages."""
    return [family.hf.block_class for family in Family]


def _block_classes() -> dict[type, Family]:
    found: dict[type, Family] = {}
    for family in Family:
        try:
            found[getattr(importlib.import_module(family.hf.block_module), family.hf.block_class)] = family
        except (ImportError, AttributeError):  # an older transformers without this model or class
            continue
    return found


def family_of(module: torch.nn.Module) -> Family | None:
    """The family of an HF MoE block (by exact class, so subclasses with other math are not taken)."""
    return _block_classes().get(type(module))
