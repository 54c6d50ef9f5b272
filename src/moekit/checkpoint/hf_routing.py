"""How a per-expert family's config.json fields become moekit's `RoutingSpec`: one rule per router kind.

Facts, read from transformers 5.24's routers (`models/*/modeling_*.py`, the `*TopkRouter` / `*TopKRouter`
classes) and configuration classes:
- Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE: softmax over E in fp32, top-k; Mixtral always
  renormalizes the K weights, the others iff `norm_topk_prob` (OLMoE's default is False).
- DeepSeek-V2 (and V2-Lite): softmax over E in fp32; `topk_method` "greedy" takes the top K of the scores,
  "group_limited_greedy" first keeps the `topk_group` of `n_group` groups with the largest single score;
  then the K weights are multiplied by `routed_scaling_factor` and never renormalized (the router ignores
  `norm_topk_prob`).
- DeepSeek-V3, GLM-4.5: sigmoid scores, groups by the sum of each group's best two biased scores, top-k,
  unbiased scores renormalized iff `norm_topk_prob`, times `routed_scaling_factor` (moekit's
  SIGMOID_GROUPED). `scoring_func` "sigmoid" and `topk_method` "noaux_tc" in DeepSeek's own config.
- MiniMax-M2: sigmoid scores, the correction bias added for the choice only, top-k, the unbiased scores
  renormalized; no groups and no scaling factor (the router reads neither field). Its released config
  says `scoring_func` "sigmoid".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from moekit.errors import CheckpointError, SpecError
from moekit.spec import RoutingMethod, RoutingSpec

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


class RouterRule(enum.Enum):
    """Which router a family's layer has, and so which config fields make its routing."""

    SOFTMAX = "softmax"  # softmax, top-k, renormalized always or per the layout's renormalize field
    SOFTMAX_SCALED = "softmax_scaled"  # DeepSeek-V2: softmax, greedy top-k, times the scaling factor
    SIGMOID_GROUPED = "sigmoid_grouped"  # DeepSeek-V3, GLM-4.5
    SIGMOID_BIASED = "sigmoid_biased"  # MiniMax-M2: DeepSeek-V3's choice with one group, no factor

    @property
    def method(self) -> RoutingMethod:
        if self in (RouterRule.SOFTMAX, RouterRule.SOFTMAX_SCALED):
            return RoutingMethod.SOFTMAX_TOPK
        return RoutingMethod.SIGMOID_GROUPED


def sigmoid_grouped_routing(
    *, n_group: int, topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool, source: str
) -> RoutingSpec:
    """DeepSeek-V3's routing (and GLM-4.5's) as moekit's SIGMOID_GROUPED, from the fields a config or a
    router holds; one group is no grouping (the spec holds it as None). `source` names what is refused
    in messages ("a block", "a config")."""
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


def _expect(config: Mapping[str, object], name: str, want: str, default: str, router: str) -> None:
    """Refuse a config whose `name` (default `default` where absent) is not `want`."""
    got = config.get(name, default)
    if got != want:
        raise SpecError(
            f"config.json {name}={got!r}: moekit reads this family's {router} routing only ({name} "
            f"{want!r}); other routings of this family are not supported"
        )


def _sigmoid_grouped(config: Mapping[str, object]) -> RoutingSpec:
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
    return sigmoid_grouped_routing(
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=config_field(config, "routed_scaling_factor", kind=float),
        norm_topk_prob=config.get("norm_topk_prob", True) is True,
        source="a config",
    )


def _softmax_scaled(config: Mapping[str, object]) -> RoutingSpec:
    _expect(config, "scoring_func", "softmax", "softmax", "softmax")
    method = config.get("topk_method", "greedy")
    groups = (config.get("n_group"), config.get("topk_group"))
    if method == "group_limited_greedy" and groups != (1, 1):
        raise SpecError(
            f"config.json topk_method='group_limited_greedy' with n_group={groups[0]}, "
            f"topk_group={groups[1]} (DeepSeek-V2): moekit has no softmax routing limited to groups by "
            "their best score; only DeepSeek-V2-Lite's topk_method='greedy' (or one group) is supported"
        )
    if method not in ("greedy", "group_limited_greedy"):
        raise SpecError(f"config.json topk_method={method!r} is not a DeepSeek-V2 routing moekit reads")
    if config.get("norm_topk_prob", False) is not False:
        raise SpecError(
            f"config.json norm_topk_prob={config.get('norm_topk_prob')!r}: transformers' DeepSeek-V2 "
            "router never renormalizes the top-k weights while other runtimes would, so the routing is "
            "ambiguous; set norm_topk_prob to false (as DeepSeek-V2's releases do)"
        )
    factor = config.get("routed_scaling_factor", 1.0)  # the configuration class's default
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise CheckpointError(f"config.json field 'routed_scaling_factor' must be a number, got {factor!r}")
    return RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=False, routed_scaling_factor=float(factor))


def routing_of_config(
    rule: RouterRule, renormalize_field: str | None, config: Mapping[str, object]
) -> RoutingSpec:
    """The routing a layer of `config` runs, by its family's `rule` (`renormalize_field`: the flag a
    SOFTMAX router reads; None: it always renormalizes)."""
    if rule is RouterRule.SOFTMAX:
        renormalize = True
        if renormalize_field is not None:
            renormalize = bool(config_field(config, renormalize_field, kind=bool))
        return RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=renormalize)
    if rule is RouterRule.SOFTMAX_SCALED:
        return _softmax_scaled(config)
    if rule is RouterRule.SIGMOID_GROUPED:
        return _sigmoid_grouped(config)
    _expect(config, "scoring_func", "sigmoid", "sigmoid", "sigmoid")
    return RoutingSpec(RoutingMethod.SIGMOID_GROUPED, has_correction_bias=True)
