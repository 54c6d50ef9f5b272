"""The Triton fused-MoE path as a registered kernel (CUDA; Hopper for FP8 and MXFP4).

Data flow: planner -> `supports` (capability data + per-format compute capability) -> config
(`TritonMoEConfig`, default heuristic or tuned row, checked by `reason_unusable`) -> `run` hands the
typed launch to `triton_fused_moe`. Importing this module needs Triton; the registry skips it without.
"""

from __future__ import annotations

import dataclasses

import torch

from moekit.kernels.base import Kernel, KernelConfig, Launch, Problem
from moekit.kernels.triton.launch import (
    TRITON_CAPABILITIES,
    TritonMoEConfig,
    default_config,
    triton_fused_moe,
    triton_supports,
    workspace_bytes,
)
from moekit.spec import MoESpec, WeightFormat
from moekit.weights import ExpertWeights


def n_major(scales: torch.Tensor) -> torch.Tensor:
    """`scales` [..., N, G] with the same values, laid out so that N is the fastest-moving index."""
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


class TritonFusedKernel(Kernel):
    name = "triton_fused"
    priority = 100
    config_type = TritonMoEConfig
    capabilities = TRITON_CAPABILITIES

    def extra_check(self, spec: MoESpec, problem: Problem) -> str | None:
        return triton_supports(spec, device=problem.device)

    def default_config(self, spec: MoESpec, problem: Problem) -> TritonMoEConfig:
        return default_config(spec, problem.num_tokens)

    def tuning_space(self, spec: MoESpec, problem: Problem) -> tuple[TritonMoEConfig, ...]:
        """The default plus a grid around the shapes the H200 sweep favoured (tiles grow with the tokens
        each expert sees); configs that cannot serve the spec are dropped."""
        per_expert = max(problem.num_tokens, 1) * spec.K / spec.E_local
        block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)]
        grid = [
            TritonMoEConfig(
                block_m=m, block_n=n, block_k=k, group_m=1 if m == 16 else 8, num_warps=w, num_stages=st
            )
            for m in block_ms
            for n in (32, 64, 128)
            for k in (64, 128)
            for w in (4, 8)
            for st in (3, 4)
            if not (w == 8 and m * n < 64 * 64)  # 8 warps on a small tile leave warps idle
        ]
        configs = [default_config(spec, problem.num_tokens), *grid]
        unique = list(dict.fromkeys(configs))
        return tuple(c for c in unique if c.reason_unusable(spec) is None)

    def prepare_weights(self, weights: ExpertWeights, spec: MoESpec) -> ExpertWeights:
        """MXFP4: the same scale values [E, N, G], stored N-major (strides (G*N, 1, N)), so a K-step
        reads its BLOCK_N scale bytes as one contiguous run instead of BLOCK_N bytes 90 apart. The
        kernel reads either layout through strides; this one is the fast one. Other formats: as is."""
        if weights.format is not WeightFormat.MXFP4 or weights.stores_floats:
            return weights
        return dataclasses.replace(
            weights, w13_scale=n_major(weights.w13_scale), w2_scale=n_major(weights.w2_scale)
        )

    def validate_config(self, config: KernelConfig, spec: MoESpec) -> str | None:
        return super().validate_config(config, spec) or config.reason_unusable(spec)

    def workspace_bytes(self, spec: MoESpec, num_tokens: int) -> int:
        return workspace_bytes(spec=spec, num_tokens=num_tokens)

    def run(self, launch: Launch) -> torch.Tensor:
        return triton_fused_moe(
            launch.x,
            launch.weights,
            launch.routing,
            spec=launch.spec,
            config=launch.config,
            expert_map=launch.expert_map,
        )
