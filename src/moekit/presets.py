"""Model presets: the MoE specs of real models (global shapes, from each model's published config).

Data flow: a name -> a `MoESpec`. The CLI, benchmarks and tests take presets from here only.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit.errors import SpecError, check_int, check_type
from moekit.spec import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
)

_GPT_OSS = dict(
    top_k=4,
    hidden_size=2880,
    intermediate_size=2880,
    weight_format=WeightFormat.MXFP4,
    activation=ActivationSpec.gpt_oss(),
    gate_layout=GateLayout.INTERLEAVED,
    has_bias=True,
    routing=RoutingSpec(RoutingMethod.TOPK_SOFTMAX),
)
_SOFTMAX_TOPK_RENORM = RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=True)  # Qwen3, Mixtral
_SILU = ActivationSpec(Activation.SILU)

PRESETS: dict[str, MoESpec] = {
    "gpt-oss-120b": MoESpec(num_experts=128, **_GPT_OSS),
    "gpt-oss-20b": MoESpec(num_experts=32, **_GPT_OSS),
    "qwen3-30b-a3b": MoESpec(
        num_experts=128,
        top_k=8,
        hidden_size=2048,
        intermediate_size=768,
        activation=_SILU,
        routing=_SOFTMAX_TOPK_RENORM,
    ),
    "qwen3-235b-a22b": MoESpec(
        num_experts=128,
        top_k=8,
        hidden_size=4096,
        intermediate_size=1536,
        activation=_SILU,
        routing=_SOFTMAX_TOPK_RENORM,
    ),
    "mixtral-8x7b": MoESpec(
        num_experts=8,
        top_k=2,
        hidden_size=4096,
        intermediate_size=14336,
        activation=_SILU,
        routing=_SOFTMAX_TOPK_RENORM,
    ),
    "deepseek-v3": MoESpec(
        num_experts=256,
        top_k=8,
        hidden_size=7168,
        intermediate_size=2048,
        weight_format=WeightFormat.FP8_E4M3,
        fp8_scale=Fp8Scale.BLOCK_128,
        act_quant=ActivationQuant.FP8_PER_GROUP_128,
        activation=_SILU,
        routing=RoutingSpec(
            RoutingMethod.SIGMOID_GROUPED,
            n_group=8,
            topk_group=4,
            has_correction_bias=True,
            routed_scaling_factor=2.5,
        ),
    ),
}
DEFAULT_PRESET = "gpt-oss-20b"


def _routing_at(routing: RoutingSpec, experts: int, top_k: int) -> RoutingSpec:
    """`routing` for E = `experts`: grouped routing keeps its groups only if E still divides into them
    and the kept groups still hold K experts."""
    if routing.n_group is not None and (
        experts % routing.n_group or top_k > routing.topk_group * (experts // routing.n_group)
    ):
        return replace(routing, n_group=None, topk_group=None)
    return routing


def preset(name: str, *, act_dtype: torch.dtype = torch.bfloat16) -> MoESpec:
    """The spec of a named model (case-insensitive)."""
    check_type("preset(name)", name, str, fix=f"pass one of {sorted(PRESETS)}", error=SpecError)
    key = name.lower()
    if key not in PRESETS:
        raise SpecError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[key]
    if act_dtype != spec.act_dtype:
        spec = replace(spec, act_dtype=act_dtype)
    return spec


def cap_experts(spec: MoESpec, max_experts: int | None) -> MoESpec:
    """The same layer with E (and K, if needed) capped, for machines that cannot hold every expert.

    Grouped routing keeps its groups only if the capped E still divides into them."""
    check_int("cap_experts(max_experts)", max_experts, minimum=1, optional=True)
    if max_experts is None or spec.E <= max_experts:
        return spec
    routing = _routing_at(spec.routing, max_experts, min(spec.K, max_experts))
    return replace(spec, num_experts=max_experts, top_k=min(spec.K, max_experts), routing=routing)


def reshaped(spec: MoESpec, shape: str) -> MoESpec:
    """The same math at another size: `shape` is "ExKxHxI" (experts, top-k, hidden, intermediate; commas
    also separate). Benchmarks use it to run shapes that no preset, and no tuned row, covers."""
    check_type("reshaped(shape)", shape, str, fix='pass "ExKxHxI", e.g. "256x8x7168x2048"', error=SpecError)
    parts = shape.replace(",", "x").split("x")
    if len(parts) != 4 or not all(p.isdecimal() and int(p) > 0 for p in parts):
        raise SpecError(f'shape must be four positive ints "ExKxHxI", e.g. "256x8x7168x2048", got {shape!r}')
    experts, top_k, hidden, inter = (int(p) for p in parts)
    routing = _routing_at(spec.routing, experts, top_k)
    return replace(
        spec, num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter, routing=routing
    )


# The suffix that serves a preset as llm-compressor's "FP8-dynamic" checkpoints are served: FP8 weights
# scaled per output row, FP8 activations scaled per token (vLLM's per-channel W8A8 path).
FP8_CHANNEL_SUFFIX = "fp8-channel"


def fp8_channel(spec: MoESpec) -> MoESpec:
    """`spec` with per-channel FP8 weights and per-token FP8 activations (the "+fp8-channel" suffix)."""
    if spec.has_bias:
        raise SpecError(
            "the +fp8-channel suffix serves presets without expert biases (FP8-dynamic checkpoints have "
            "none); pick a preset whose has_bias is False"
        )
    return replace(
        spec,
        weight_format=WeightFormat.FP8_E4M3,
        fp8_scale=Fp8Scale.PER_CHANNEL,
        act_quant=ActivationQuant.FP8_PER_TOKEN,
    )


def preset_at(label: str) -> MoESpec:
    """A preset by name, "name@ExKxHxI" (that preset's math at another shape, `reshaped`), and either with
    "+QUANT" (an `ActivationQuant` value, e.g. "gpt-oss-120b+fp8_per_1x128_group" for W4A8) or
    "+fp8-channel" (`fp8_channel`: per-channel FP8 weights and per-token FP8 activations)."""
    check_type(
        "preset_at(label)",
        label,
        str,
        fix='pass a preset name, "name@ExKxHxI" or "name+QUANT"',
        error=SpecError,
    )
    label, plus, quant = label.partition("+")
    name, at, shape = label.partition("@")
    spec = reshaped(preset(name), shape) if at else preset(name)
    if plus and quant == FP8_CHANNEL_SUFFIX:
        return fp8_channel(spec)
    if plus:
        known = [q.value for q in ActivationQuant] + [FP8_CHANNEL_SUFFIX]
        if quant not in known:
            raise SpecError(f"unknown activation quantization {quant!r} after '+'; choose one of {known}")
        spec = replace(spec, act_quant=ActivationQuant(quant))
    return spec
