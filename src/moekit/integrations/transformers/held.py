"""The config fields a Hugging Face MoE block holds itself, and the check that a given config agrees.

Data flow: a block -> `held_config_fields` (the router's top-k, renormalize flag and grouped-routing
constants, the experts' SwiGLU alpha and clamp, the activation they compute, found by evaluation) ->
`patch._config_of_module` builds a config from them, and `check_config_matches_block` refuses a config
whose fields (or sizes, against the converted experts) differ: that config would describe another model.
"""

from __future__ import annotations

import torch

from moekit.checkpoint.hf_config import HF_ACTIVATIONS
from moekit.errors import SpecError
from moekit.integrations.transformers.families import Family
from moekit.spec import Activation, MoESpec
from moekit.weights import ExpertWeights

# HF activations by the moekit activation they compute, to recognize an experts module's `act_fn`.
_TORCH_ACTIVATIONS = {
    Activation.SILU: torch.nn.functional.silu,
    Activation.GELU: lambda z: torch.nn.functional.gelu(z, approximate="none"),
    Activation.GELU_TANH: lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
}


def hidden_act_of(act_fn: object) -> str:
    """The `hidden_act` name of an experts module's activation, found by evaluating it: class names of
    HF activations change between versions, the function they compute does not."""
    z = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
    with torch.no_grad():
        got = act_fn(z)
    for name, activation in HF_ACTIVATIONS.items():
        if torch.allclose(got, _TORCH_ACTIVATIONS[activation](z), rtol=1e-9, atol=1e-12):
            return name
    raise SpecError(
        f"the experts' activation {type(act_fn).__name__} is none of {list(HF_ACTIVATIONS)}; "
        "pass the model's config"
    )


def _router_field(value: object) -> object:
    """A router attribute as the config holds it (a flag stays a bool, a count an int, a name a str)."""
    if isinstance(value, bool | int | str):
        return value
    return float(value)


def held_config_fields(block: torch.nn.Module, family: Family) -> dict[str, object]:
    """The config fields (under the config's names) whose values `block` holds itself: the router's top-k
    (and renormalize flag, and DeepSeek-V3's grouped-routing constants), the experts' SwiGLU alpha and
    clamp, the activation the experts compute (by evaluation). A field the block does not hold is left
    out: the config is its only source. Sizes are not here: they are the experts' parameter shapes."""
    hf = family.hf
    router, experts = getattr(block, hf.router_name), block.experts
    fields: dict[str, object] = {}
    top_k = getattr(router, "top_k", getattr(block, "top_k", None))  # 4.x blocks held it, not the gate
    if top_k is not None:
        fields["num_experts_per_tok"] = int(top_k)
    if hf.swiglu is not None:
        if getattr(experts, hf.swiglu.experts_alpha, None) is not None:
            fields[hf.swiglu.config_alpha] = float(getattr(experts, hf.swiglu.experts_alpha))
        if hasattr(experts, hf.swiglu.experts_limit):  # None: no clamp
            limit = getattr(experts, hf.swiglu.experts_limit)
            fields[hf.swiglu.config_limit] = None if limit is None else float(limit)
    elif getattr(experts, "act_fn", None) is not None:
        try:
            fields["hidden_act"] = hidden_act_of(experts.act_fn)
        except SpecError:
            pass  # an activation the probe does not know: the config names it
    if hf.renormalize_field is not None:
        flag = getattr(router, hf.renormalize_field, getattr(block, hf.renormalize_field, None))
        if flag is not None:
            fields[hf.renormalize_field] = bool(flag)
    for attribute, field in hf.router_fields:
        if getattr(router, attribute, None) is not None:
            fields[field] = _router_field(getattr(router, attribute))
    return fields


def check_config_matches_block(
    config: object, spec: MoESpec, block: torch.nn.Module, family: Family, weights: ExpertWeights
) -> None:
    """Each field the block holds (`held_config_fields`, and E, H, I from its experts' shapes) is the
    value `spec` (built from `config`) uses: a config of another model would compute another function."""
    hf = family.hf
    held = held_config_fields(block, family)
    # config field -> (the spec's value, the block's value, what the block holds, in words)
    pairs: dict[str, tuple[object, object, str]] = {
        hf.num_experts_field: (spec.E, weights.num_experts, f"experts hold E={weights.num_experts}"),
        "hidden_size": (spec.H, weights.H, f"experts have H={weights.H}"),
        hf.intermediate_field: (spec.I, weights.I, f"experts have I={weights.I}"),
    }
    if "num_experts_per_tok" in held:
        k = held["num_experts_per_tok"]
        pairs["num_experts_per_tok"] = (spec.K, k, f"router selects top_k={k}")
    if hf.swiglu is not None:
        alpha, limit = hf.swiglu.config_alpha, hf.swiglu.config_limit
        if alpha in held:
            pairs[alpha] = (spec.activation.alpha, held[alpha], f"experts use alpha={held[alpha]}")
        if limit in held:
            pairs[limit] = (spec.activation.limit, held[limit], f"experts clamp at limit={held[limit]}")
    elif "hidden_act" in held:
        act = held["hidden_act"]
        pairs["hidden_act"] = (spec.activation.kind, HF_ACTIVATIONS[act], f"experts compute {act!r}")
    flag = hf.renormalize_field
    if flag is not None and flag in held:
        pairs[flag] = (spec.routing.renormalize, held[flag], f"router has {flag}={held[flag]}")
    # Grouped-routing constants: the spec folds n_group=1 into "no groups", so the config's own values
    # (the ones the spec was built from) are compared.
    for _, field in hf.router_fields:
        if field in held:
            ours = _router_field(getattr(config, field)) if hasattr(config, field) else None
            pairs[field] = (ours, held[field], f"router has {field}={held[field]}")
    for field, (ours, theirs, holds) in pairs.items():
        if ours != theirs:
            given = (
                f"={getattr(config, field)!r}" if hasattr(config, field) else f" is absent (read as {ours})"
            )
            raise SpecError(
                f"config.{field}{given} but the block's {holds}; pass the config of the model this "
                "block belongs to, or none (hf_layer_of(block) and fused_moe_from_hf(block) read every "
                "field off the block)"
            )
