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
    tuning_space,
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
        """The default plus a short list per regime of tokens per expert, from H200 sweeps
        (benchmarks/sweep_configs.py): decode streams weights (16-row M tiles, deeper pipelines, both
        orientations for formats without MXFP4's register-side upcast), prefill grows the M tile.
        Configs that cannot serve the spec are dropped."""
        return tuning_space(spec, problem.num_tokens)

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
