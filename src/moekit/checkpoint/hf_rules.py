"""How a Hugging Face MoE family's config fields give its routing and say which decoder layers are dense.

Data flow: a family's `HfRouting` and `DenseRule` (its `hf_config.CheckpointLayout` names them) + a config
(config.json as a dict) -> `routing_of_config` -> moekit's `RoutingSpec`; `dense_reason` -> why a layer
has no experts. The live-model reader (`integrations.transformers.convert`) builds its routings with the
same `*_routing` constructors from the fields a block holds.

Facts, read from transformers 5.24's `models/*/modeling_*.py` and `configuration_*.py`:
- SOFTMAX (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE): softmax over E in fp32, top-k;
  renormalized over the K always (Mixtral) or iff `norm_topk_prob` (the others; OLMoE's and Qwen2-MoE's
  default False).
- SOFTMAX_GREEDY_SCALED (DeepSeek-V2, V2-Lite): `DeepseekV2TopkRouter` takes the softmax over E in fp32
  of an fp32 router (`_keep_in_fp32_modules_strict` "gate.weight"); with `topk_method` "greedy" (its
  default) the weights are the top-k scores, not renormalized, times `routed_scaling_factor`;
  "group_limited_greedy" (full DeepSeek-V2) masks all but the `topk_group` groups with the highest
  *maximum* score, which no moekit routing computes. Its config class keeps `norm_topk_prob` (default
  False) but the router never reads it, while DeepSeek's own modeling code renormalizes when it is set.
- SIGMOID_GROUPED (DeepSeek-V3, GLM-4.5, dots.llm1 `dots1`, GLM-4.7-Flash `glm4_moe_lite`: their routers
  and MoE blocks are the same code): sigmoid scores of an fp32 router; `topk_group` of `n_group` groups
  kept by the sum of each group's two best biased scores; top-k of the biased scores within them;
  weights the unbiased scores, renormalized iff `norm_topk_prob`, times `routed_scaling_factor`.
  `norm_topk_prob` defaults True except in Dots1Config (False).
- SIGMOID_CORRECTED (MiniMax-M2): `MiniMaxM2TopKRouter` takes the sigmoid in fp32 of the router logits,
  chooses the top-k of the scores plus the block's `e_score_correction_bias`, and weights the unbiased
  scores renormalized over the K: no groups, no scaling factor (MiniMaxM2Config has no such field).
Dense layers: DeepSeek-V2/V3, GLM-4.5 and dots1 build a dense MLP for `layer < first_k_dense_replace`;
Qwen2-MoE, Qwen3-MoE and Qwen3-Next for `layer in mlp_only_layers` or `(layer + 1) % decoder_sparse_step`;
GLM-4.7-Flash where `mlp_layer_types[layer] != "sparse"` (default: layer 0 dense); Mixtral, OLMoE and
MiniMax-M2 never.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from moekit.errors import CheckpointError, SpecError
from moekit.spec import RoutingMethod, RoutingSpec


class HfRouting(enum.Enum):
    """Which of a family's config fields give its routing, and how (see the module docstring)."""

    SOFTMAX = "softmax"
    SOFTMAX_GREEDY_SCALED = "softmax_greedy_scaled"
    SIGMOID_GROUPED = "sigmoid_grouped"
    SIGMOID_CORRECTED = "sigmoid_corrected"

    @property
    def method(self) -> RoutingMethod:
        if self in (HfRouting.SOFTMAX, HfRouting.SOFTMAX_GREEDY_SCALED):
            return RoutingMethod.SOFTMAX_TOPK
        return RoutingMethod.SIGMOID_GROUPED


class DenseRule(enum.Enum):
    """Which config fields make a decoder layer a dense MLP without experts (see the module docstring)."""

    NONE = "none"
    FIRST_K_DENSE_REPLACE = "first_k_dense_replace"
    QWEN_SPARSE_STEP = "mlp_only_layers, decoder_sparse_step"
    MLP_LAYER_TYPES = "mlp_layer_types"


_KINDS: dict[type, tuple[str, tuple[type, ...]]] = {
    int: ("an int", (int,)),
    float: ("a number", (int, float)),
    bool: ("true or false", (bool,)),
}


def config_field(config: Mapping[str, object], name: str, *, kind: type = int) -> object:
    """`config[name]`, refused unless it is of `kind` (a bool is not taken for a number)."""
    value = config.get(name)
    what, types = _KINDS[kind]
    if not isinstance(value, types) or (kind is not bool and isinstance(value, bool)):
        got = f"got {value!r}" if name in config else "but config.json has no such field"
        raise CheckpointError(f"config.json field {name!r} must be {what}, {got}")
    return value


def sigmoid_grouped_routing(
    *, n_group: int, topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool, source: str
) -> RoutingSpec:
    """DeepSeek-V3's routing (and GLM-4.5's, dots1's, GLM-4.7-Flash's) as moekit's SIGMOID_GROUPED, from
    the fields a config or a router holds; one group is no grouping (the spec holds it as None). `source`
    names what is refused in messages ("a block", "a config")."""
    if not norm_topk_prob:
        raise SpecError(
            f"norm_topk_prob={norm_topk_prob!r}: moekit's SIGMOID_GROUPED routing always renormalizes the "
            f"top-k weights (DeepSeek-V3's norm_topk_prob=True); {source} that does not is not supported"
        )
    return RoutingSpec(
        RoutingMethod.SIGMOID_GROUPED,
        n_group=None if n_group == 1 else n_group,
        topk_group=None if n_group == 1 else topk_group,
        has_correction_bias=True,
        routed_scaling_factor=float(routed_scaling_factor),
    )


def greedy_softmax_routing(*, topk_method: object, routed_scaling_factor: float) -> RoutingSpec:
    """DeepSeek-V2's "greedy" routing: softmax over E, top-k, not renormalized, times the factor."""
    if topk_method != "greedy":
        raise SpecError(
            f"topk_method={topk_method!r}: moekit routes DeepSeek-V2 models whose topk_method is 'greedy' "
            "(DeepSeek-V2-Lite); 'group_limited_greedy' (full DeepSeek-V2) keeps the groups with the "
            "highest maximum softmax score, which no moekit routing computes"
        )
    return RoutingSpec(
        RoutingMethod.SOFTMAX_TOPK, renormalize=False, routed_scaling_factor=float(routed_scaling_factor)
    )


# MiniMax-M2: corrected sigmoid choice, renormalized unbiased scores, no groups and no scaling factor.
SIGMOID_CORRECTED_ROUTING = RoutingSpec(RoutingMethod.SIGMOID_GROUPED, has_correction_bias=True)


def _refuse_other(config: Mapping[str, object], name: str, allowed: object, *, family: str) -> None:
    """Refuse a present field whose value is not the one this family's routing computes."""
    if name in config and config[name] != allowed:
        raise SpecError(
            f"config.json {name}={config[name]!r}: moekit computes {family} routing with {name}="
            f"{allowed!r} (transformers' model); this checkpoint asks for another routing"
        )


def routing_of_config(
    routing: HfRouting,
    config: Mapping[str, object],
    *,
    renormalize_field: str | None,
    norm_topk_prob_if_missing: bool,
) -> RoutingSpec:
    """The `RoutingSpec` config.json gives a family routed as `routing`; unsupported values are refused
    (SpecError naming the field and value) before any tensor is read."""
    if routing is HfRouting.SOFTMAX:
        field = renormalize_field
        renormalize = True if field is None else bool(config_field(config, field, kind=bool))
        return RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=renormalize)
    if routing is HfRouting.SOFTMAX_GREEDY_SCALED:
        _refuse_other(config, "scoring_func", "softmax", family="DeepSeek-V2")
        if config.get("norm_topk_prob") is True:
            raise SpecError(
                "config.json norm_topk_prob=True: transformers' DeepSeek-V2 router ignores it (no "
                "renormalization) while DeepSeek's own code renormalizes, so the weights are ambiguous; "
                "set it to false (DeepSeek-V2-Lite's value) for transformers' routing"
            )
        factor = (
            config_field(config, "routed_scaling_factor", kind=float)
            if "routed_scaling_factor" in config
            else 1.0
        )
        return greedy_softmax_routing(
            topk_method=config.get("topk_method", "greedy"), routed_scaling_factor=factor
        )
    if routing is HfRouting.SIGMOID_CORRECTED:
        _refuse_other(config, "scoring_func", "sigmoid", family="MiniMax-M2")
        if "routed_scaling_factor" in config:
            _refuse_other(config, "routed_scaling_factor", 1.0, family="MiniMax-M2")
        return SIGMOID_CORRECTED_ROUTING
    scoring, method = config.get("scoring_func", "sigmoid"), config.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise SpecError(
            f"config.json scoring_func={scoring!r}, topk_method={method!r}: moekit's SIGMOID_GROUPED "
            "routing is DeepSeek-V3's (sigmoid, noaux_tc, renormalized top-k); other routings of this "
            "family are not supported"
        )
    n_group, topk_group = config_field(config, "n_group"), config_field(config, "topk_group")
    if n_group == 1 and topk_group != 1:  # RoutingSpec checks 1 <= topk_group <= n_group for n_group > 1
        raise SpecError(
            f"topk_group={topk_group} with n_group=1: the model keeps topk_group of its one group, so "
            "only topk_group=1 is a routing (transformers fails or masks every expert otherwise); set "
            "topk_group to 1"
        )
    norm = config.get("norm_topk_prob", norm_topk_prob_if_missing)
    return sigmoid_grouped_routing(
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=config_field(config, "routed_scaling_factor", kind=float),
        norm_topk_prob=norm is True,
        source="a config",
    )


def _qwen_dense_reason(config: Mapping[str, object], layer: int) -> str | None:
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in only):
        raise CheckpointError(
            f"config.json field 'mlp_only_layers' must be a list of layer ints, not {only!r}"
        )
    if layer in only:
        return f"mlp_only_layers={only} lists it"
    if config.get("decoder_sparse_step") is None:
        return None
    step = config_field(config, "decoder_sparse_step")
    if step < 1:
        raise CheckpointError(
            f"config.json decoder_sparse_step={step} must be >= 1 (1: every layer has experts)"
        )
    if (layer + 1) % step:
        return f"decoder_sparse_step={step}: only layers l with (l + 1) % {step} == 0 have experts"
    return None


def _layer_types_dense_reason(config: Mapping[str, object], layer: int) -> str | None:
    types = config.get("mlp_layer_types")
    if types is None:  # the config class's default: the first layer dense, every other sparse
        return "mlp_layer_types is absent: the model's default makes layer 0 dense" if layer == 0 else None
    if not isinstance(types, list) or not all(t in ("dense", "sparse") for t in types):
        raise CheckpointError(
            f"config.json field 'mlp_layer_types' must be a list of 'dense' / 'sparse', not {types!r}"
        )
    if layer >= len(types):
        raise CheckpointError(f"config.json mlp_layer_types has {len(types)} entries, none for layer {layer}")
    return f"mlp_layer_types[{layer}] is {types[layer]!r}" if types[layer] != "sparse" else None


def dense_reason(rule: DenseRule, config: Mapping[str, object], layer: int) -> str | None:
    """Why config.json makes decoder layer `layer` a dense MLP under `rule`, or None. A field config.json
    lacks is not checked (the checkpoint's keys then decide), except `mlp_layer_types`, whose absence
    the model reads as its default."""
    if rule is DenseRule.FIRST_K_DENSE_REPLACE:
        if config.get("first_k_dense_replace") is None:
            return None
        first = config_field(config, "first_k_dense_replace")
        return f"first_k_dense_replace={first}: layers 0..{first - 1} are dense" if layer < first else None
    if rule is DenseRule.QWEN_SPARSE_STEP:
        return _qwen_dense_reason(config, layer)
    if rule is DenseRule.MLP_LAYER_TYPES:
        return _layer_types_dense_reason(config, layer)
    return None
