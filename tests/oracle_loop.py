"""A second, independent spelling of the MoE layer, for tests: one token and one k at a time, in float64.

Data flow per (token t, slot k): e = ids[t, k] (through the expert map; -1 contributes nothing) ->
x[t] (times the router weight first when it goes on the input) -> FP8 round trip (W8A8 specs) ->
h = w13[e] x + b13[e] -> gate and up halves by the gate layout -> the activation (limit, alpha) ->
FP8 round trip -> y = w2[e] a + b2[e] -> times the router weight (on the output) -> added into out[t].

Tests cross-check `moekit.fused_moe_reference` against it. Nothing here comes from `moekit.reference` or
from `moekit.formats`' activation quantizers: the gate/up split, every activation and the FP8 E4M3
round trip are written out below from their definitions, so a mistake in the oracle's helpers shows as
a mismatch rather than being shared. Only the weights' own dequantization (`ExpertWeights`) is shared.
Far too slow for anything but small tests.
"""

from __future__ import annotations

import math

import torch

from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
)
from moekit.weights import ExpertWeights

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 128  # FP8_PER_GROUP_128: one scale per 128 consecutive activations


def fp8_round_trip(v: torch.Tensor, quant: ActivationQuant) -> torch.Tensor:
    """fp32 activations `[n]` -> E4M3 codes -> fp32 values, as a W8A8 kernel sees them.

    Per group (the whole row for FP8_PER_TOKEN, 128 values for FP8_PER_GROUP_128): scale = amax / 448
    by true fp32 division (floored at the smallest normal fp32; 1 for an all-zero group), codes =
    v / scale clamped to +-448 and rounded to nearest E4M3 (ties to even), values = codes * scale.
    fp32 on purpose: the kernels quantize fp32 values, and float64 would round some to other codes."""
    if quant is ActivationQuant.NONE:
        return v
    v = v.to(torch.float32)
    width = v.shape[0] if quant is ActivationQuant.FP8_PER_TOKEN else GROUP
    out = torch.empty_like(v)
    for start in range(0, v.shape[0], width):
        group = v[start : start + width]
        amax = group.abs().max()
        scale = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)
        scale = torch.clamp(scale, min=torch.finfo(torch.float32).tiny) if amax > 0 else torch.ones_like(amax)
        codes = (group / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out[start : start + width] = codes.to(torch.float32) * scale
    return out


def gate_and_up(h: torch.Tensor, layout: GateLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """w13's output `[2I]`: CONCAT puts gate in rows [0, I) and up in [I, 2I); INTERLEAVED alternates."""
    intermediate = h.shape[0] // 2
    if layout is GateLayout.CONCAT:
        return h[:intermediate], h[intermediate:]
    return h[0::2], h[1::2]


def _sigmoid(z: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-z))


def activation(gate: torch.Tensor, up: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """The gated activations from their definitions (float64 in, float64 out).

    A limit L clamps the gate from above and the up half to [-L, L], whatever the activation.
    SILU: gate * sigmoid(gate) * up. GELU: gate * (1 + erf(gate / sqrt 2)) / 2 * up. GELU_TANH:
    gate * (1 + tanh(sqrt(2 / pi) * (gate + 0.044715 gate^3))) / 2 * up. SWIGLU_OAI (GPT-OSS):
    gate * sigmoid(alpha * gate) * (up + 1)."""
    if act.limit is not None:
        gate = torch.minimum(gate, torch.full_like(gate, act.limit))
        up = torch.maximum(torch.minimum(up, torch.full_like(up, act.limit)), torch.full_like(up, -act.limit))
    if act.kind is Activation.SWIGLU_OAI:
        return gate * _sigmoid(act.alpha * gate) * (up + 1.0)
    if act.kind is Activation.SILU:
        return gate * _sigmoid(gate) * up
    if act.kind is Activation.GELU:
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if act.kind is Activation.GELU_TANH:
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1.0 + torch.tanh(inner)) * up
    raise AssertionError(f"no spelling of {act.kind} here: add it")


def fused_moe_per_token_loop(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * (act(w13[e] x[t] + b13[e]) w2[e]^T + b2[e]), e = ids[t,k]; float64 `[T, H]`.

    With act quantization the FP8 round trips see fp32 values (as the kernels do); everything else is
    float64. The inputs are assumed valid (tests check the checks elsewhere)."""
    quant = spec.act_quant
    on_input = spec.router_weight_placement is RouterWeightPlacement.INPUT
    out = torch.zeros(x.shape[0], spec.H, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(spec.K):
            expert = int(routing.ids[t, k])
            if expert_map is not None:
                expert = int(expert_map[expert])
                if expert < 0:
                    continue  # owned by another rank
            w = routing.weights[t, k]  # fp32
            if quant is ActivationQuant.NONE:
                xt = x[t].double() * float(w) if on_input else x[t].double()
            else:  # the kernels scale in fp32, then quantize
                xt = fp8_round_trip(x[t].to(torch.float32) * w if on_input else x[t], quant).double()
            h = torch.mv(weights.dequantize_w13(expert).double(), xt)
            if weights.b13 is not None:
                h = h + weights.b13[expert].double()
            gate, up = gate_and_up(h, spec.gate_layout)
            a = activation(gate, up, spec.activation)
            if quant is not ActivationQuant.NONE:
                a = fp8_round_trip(a.to(torch.float32), quant).double()
            y = torch.mv(weights.dequantize_w2(expert).double(), a)
            if weights.b2 is not None:
                y = y + weights.b2[expert].double()
            out[t] += y if on_input else float(w) * y
    return out
