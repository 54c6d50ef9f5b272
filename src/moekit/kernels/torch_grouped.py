"""The unfused PyTorch path: sort by expert, two grouped GEMMs, activation in between, deterministic sum.

Data flow: ids [T, K] -> (expert map) -> local expert per (token, k) pair -> stable sort by expert ->
offsets (cumulative counts, on the device) -> gather x rows -> `torch._grouped_mm` with w13 (or a
per-expert loop where grouped_mm cannot run) -> + b13 -> activation in fp32 -> grouped GEMM with w2 ->
+ b2 -> times router weight -> unsort into [T, K, H] -> sum over K in fixed order (no atomics).

Quantized formats run on weights dequantized once at load (`prepare_weights`), so this is the
"dequantize, then BF16" baseline the fused kernels are measured against. The grouped-GEMM variant
keeps counts on the device (no host sync); the loop variant syncs and serves CPUs and odd shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.kernels.base import DeviceKind, Kernel, KernelConfig, Launch, Problem
from moekit.kernels.reference import ReferenceKernel
from moekit.reference import apply_activation, fake_quant_activation, split_gate_up
from moekit.spec import (
    ActivationQuant,
    MoESpec,
    RouterWeightPlacement,
)
from moekit.weights import ExpertWeights, WeightPacking


@dataclass(frozen=True)
class TorchGroupedConfig(KernelConfig):
    use_grouped_mm: bool = False  # torch._grouped_mm (CUDA sm_90+, bf16, 16-byte aligned rows) or a loop

    def __post_init__(self) -> None:
        if not isinstance(self.use_grouped_mm, bool):
            raise ValueError(f"use_grouped_mm must be a bool, got {self.use_grouped_mm!r}")


def compute_dtype(spec: MoESpec) -> torch.dtype:
    """The dtype of both GEMMs. W8A8 computes in fp32: a W8A8 kernel multiplies FP8 codes exactly and
    accumulates in fp32, and the intermediate is quantized to FP8 again, so rounding the GEMM inputs
    to bf16 moves values across FP8 rounding boundaries (one E4M3 step is 6-12 %): measured 1.7e-2
    relative L2 error on DeepSeek-V3 shapes in bf16, 2.6e-3 for the fused kernel, <1e-5 in fp32."""
    return torch.float32 if spec.act_quant is not ActivationQuant.NONE else spec.act_dtype


def grouped_mm_usable(spec: MoESpec, problem: Problem) -> str | None:
    """Why torch._grouped_mm cannot serve this spec/problem, or None."""
    if problem.device.kind is not DeviceKind.CUDA:
        return "torch._grouped_mm runs on CUDA here"
    if (problem.device.compute_capability or (0, 0)) < (9, 0):
        return "torch._grouped_mm needs sm_90+"
    if compute_dtype(spec) != torch.bfloat16:
        return f"torch._grouped_mm takes bf16, this spec computes in {compute_dtype(spec)}"
    if spec.H % 8 or spec.I % 8:  # rows must be 16-byte aligned in bf16
        return f"H={spec.H} and I={spec.I} must be multiples of 8 for torch._grouped_mm"
    return None


class TorchGroupedKernel(Kernel):
    name = "torch_grouped"
    priority = 10
    config_type = TorchGroupedConfig
    # Everything the reference computes, on any device; it reads float weights (dequantized at load).
    capabilities = replace(
        ReferenceKernel.capabilities,
        packings=frozenset({WeightPacking.CHECKPOINT, WeightPacking.DEQUANTIZED}),
    )

    def default_config(self, spec: MoESpec, problem: Problem) -> TorchGroupedConfig:
        return TorchGroupedConfig(use_grouped_mm=grouped_mm_usable(spec, problem) is None)

    def tuning_space(self, spec: MoESpec, problem: Problem) -> tuple[TorchGroupedConfig, ...]:
        if grouped_mm_usable(spec, problem) is None:
            return (TorchGroupedConfig(use_grouped_mm=True), TorchGroupedConfig(use_grouped_mm=False))
        return (TorchGroupedConfig(use_grouped_mm=False),)

    def prepare_weights(self, weights: ExpertWeights, spec: MoESpec) -> ExpertWeights:
        return weights.dequantized(compute_dtype(spec))

    def weights_reason(self, weights: ExpertWeights) -> str | None:
        if not weights.stores_floats:
            return f"kernel {self.name} reads float weights, got {weights.format.name} codes"
        return super().weights_reason(weights)

    def run(self, launch: Launch) -> torch.Tensor:
        spec, x, routing = launch.spec, launch.x, launch.routing
        weights = launch.weights
        num_tokens, k = routing.ids.shape
        if num_tokens == 0:
            return torch.zeros(0, spec.H, dtype=spec.act_dtype, device=x.device)
        local = routing.ids.reshape(-1).long()
        if launch.expert_map is not None:
            local = launch.expert_map.long()[local]
        valid = local >= 0  # pairs owned by another rank contribute zero
        local = torch.where(valid, local, torch.zeros_like(local))
        order = torch.sort(local, stable=True).indices
        sorted_expert = local[order]
        token = order // k
        route_w = routing.weights.reshape(-1)[order].unsqueeze(1)
        dtype = compute_dtype(spec)
        xs = x[token].float()
        if spec.router_weight_placement is RouterWeightPlacement.INPUT:
            xs = xs * route_w  # fp32, as the reference scales before any quantization
        xs = fake_quant_activation(xs, spec.act_quant).to(dtype)
        w13 = weights.w13.to(dtype)
        w2 = weights.w2.to(dtype)
        # scatter_add keeps the count on the device (bincount reads its max on the host: a sync).
        counts = torch.zeros(weights.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, sorted_expert, torch.ones_like(sorted_expert)
        )
        gemm = _grouped_gemm if launch.config.use_grouped_mm else _looped_gemm
        h = gemm(xs, w13, counts).float()
        if weights.b13 is not None:
            h = h + weights.b13.float()[sorted_expert]
        gate, up = split_gate_up(h, spec.gate_layout)
        a = fake_quant_activation(apply_activation(gate, up, spec.activation), spec.act_quant)
        y = gemm(a.to(dtype), w2, counts).float()
        if weights.b2 is not None:
            y = y + weights.b2.float()[sorted_expert]
        if spec.router_weight_placement is RouterWeightPlacement.OUTPUT:
            y = y * route_w
        # Pairs of other ranks ran on local expert 0 (a placeholder): drop them by selection, not by a
        # multiplication by 0, which turns an inf of that stand-in expert (fp16) into a NaN row.
        y = y.masked_fill(~valid[order].unsqueeze(1), 0.0)
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(num_tokens, k, spec.H).sum(dim=1).to(spec.act_dtype)


def _grouped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [N, in] sorted by expert @ weight[e]^T ([E, out, in]) with device-side offsets."""
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)


def _looped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Same as `_grouped_gemm`, one matmul per expert hit (reads counts on the host)."""
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start : start + count] = rows[start : start + count] @ weight[expert].T
            start += count
    return out
