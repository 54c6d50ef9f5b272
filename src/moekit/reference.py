"""The PyTorch reference: the specification of the MoE layer as code, and the oracle of every fast path.

Data flow, one step per line, fp32 throughout:
  x [T, H] -> (FP8 act quant round trip, if the spec says so) -> for each local expert hit:
  gather its tokens -> (router weight on the input, K = 1) -> `expert_hidden`: h = x @ w13^T + b13, split
  gate/up by layout, activation (alpha, clamp) -> (FP8 act quant of h) -> `expert_output`: y = h @ w2^T
  + b2 -> times router weight -> added into out[token]. Experts mapped to -1 by the expert map contribute
  nothing. The two per-expert steps stand alone for checking a single GEMM of a fast path.

Weights are dequantized one expert at a time, and only for experts that some token hits, so the
reference stays usable at real sizes on a CPU for small T.
"""

from __future__ import annotations

import math

import torch

from moekit.checks import check_forward
from moekit.formats import dequantize_fp8_activation, quantize_fp8_activation
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

# Relative L2 error a fast path may show against this reference, by activation dtype; `tolerance(spec)`
# is what `run`, `check`, `bench`, `tune` and the fuzz harness compare with. bf16 rounds x, the
# intermediate and the output to 8 bits; fp32 paths differ by summation order.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# Activations quantized to FP8 (W8A8): the intermediate h is re-quantized to E4M3 before GEMM2, so the
# error is set by E4M3's step (1/16 - 1/8 relative), not by the output dtype. Hopper's wgmma (MMA tiles of
# 64+ rows) accumulates FP8 products with fewer bits than fp32, whatever the promotion interval, and an h
# near an E4M3 rounding boundary then lands on the neighbouring code: rel L2 1.6e-3 - 2.9e-3 against this
# reference on an H200 for fp16 activations, where 16- and 32-row tiles (mma.sync, fp32 sums) give 3.5e-4.
FP8_ACTIVATION_TOLERANCE = 1e-2


def tolerance(spec: MoESpec) -> float:
    """The relative L2 error a fast path of `spec` may show against `fused_moe_reference`."""
    base = TOLERANCE[spec.act_dtype]
    if spec.act_quant is not ActivationQuant.NONE:
        return max(base, FP8_ACTIVATION_TOLERANCE)
    return base


def split_gate_up(h: torch.Tensor, layout: GateLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the w13 output `[n, 2I]` into gate and up halves `[n, I]` per the layout."""
    if layout is GateLayout.INTERLEAVED:
        return h[:, 0::2], h[:, 1::2]
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]


def apply_activation(gate: torch.Tensor, up: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """The gated activation, in fp32: act(gate) * up, or GPT-OSS's gate * sigmoid(alpha * gate) * (up + 1)."""
    limit = act.limit
    if limit is not None:  # same rule for every activation: gate clamped from above, up on both sides
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if act.kind is Activation.SWIGLU_OAI:
        return gate * torch.sigmoid(act.alpha * gate) * (up + 1.0)
    if act.kind is Activation.SILU:
        return torch.nn.functional.silu(gate) * up
    if act.kind is Activation.GELU:
        return torch.nn.functional.gelu(gate, approximate="none") * up
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def fake_quant_activation(a: torch.Tensor, quant: ActivationQuant) -> torch.Tensor:
    """Round-trip activations through FP8 exactly as a W8A8 kernel sees them."""
    if quant is ActivationQuant.NONE:
        return a
    return dequantize_fp8_activation(quantize_fp8_activation(a, quant=quant), dtype=torch.float32)


def fused_moe_reference(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * (act(x[t] @ w13[e]^T + b13[e]) @ w2[e]^T + b2[e]), e = ids[t,k].

    fp32 inside; the result is cast to spec.act_dtype. The inputs are checked first
    (`moekit.checks.check_forward`, the checks of `moekit.fused_moe`)."""
    check_forward(x, weights, routing, spec=spec, expert_map=expert_map)
    return reference_forward(x, weights, routing, spec=spec, expert_map=expert_map)


def reference_forward(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_moe_reference` on inputs already checked (the reference kernel's `run`)."""
    num_tokens = x.shape[0]
    out = torch.zeros(num_tokens, spec.H, dtype=torch.float32, device=x.device)
    x32 = fake_quant_activation(x.float(), spec.act_quant)
    local_ids = routing.ids.long()
    if expert_map is not None:
        local_ids = expert_map.long()[local_ids]  # -1 where another rank owns the expert
    for expert in local_ids.unique().tolist():
        if expert < 0:
            continue  # owned by another rank: contributes zero here
        token_idx, k_idx = (local_ids == expert).nonzero(as_tuple=True)
        route_w = routing.weights[token_idx, k_idx].unsqueeze(1)
        xe = x32[token_idx]
        if spec.router_weight_placement is RouterWeightPlacement.INPUT:
            xe = fake_quant_activation(x.float()[token_idx] * route_w, spec.act_quant)
        a = fake_quant_activation(expert_hidden(xe, weights, expert, spec=spec), spec.act_quant)
        y = expert_output(a, weights, expert)
        if spec.router_weight_placement is RouterWeightPlacement.OUTPUT:
            y = y * route_w
        out.index_add_(0, token_idx, y)
    return out.to(spec.act_dtype)


def expert_hidden(xe: torch.Tensor, weights: ExpertWeights, expert: int, *, spec: MoESpec) -> torch.Tensor:
    """fp32 act(xe @ w13[expert]^T + b13[expert]) of fp32 rows `xe` [n, H]: GEMM1 and the activation of
    one local expert, before h's activation quantization."""
    h = xe @ weights.dequantize_w13(expert).T
    if weights.b13 is not None:
        h = h + weights.b13[expert].float()
    return apply_activation(*split_gate_up(h, spec.gate_layout), spec.activation)


def expert_output(a: torch.Tensor, weights: ExpertWeights, expert: int) -> torch.Tensor:
    """fp32 a @ w2[expert]^T + b2[expert] of fp32 rows `a` [n, I]: GEMM2 of one local expert, before the
    router weight."""
    y = a @ weights.dequantize_w2(expert).T
    if weights.b2 is not None:
        y = y + weights.b2[expert].float()
    return y


def relative_l2_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere gives inf."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return math.inf
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff
