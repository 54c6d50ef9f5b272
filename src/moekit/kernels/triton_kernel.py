"""The Triton fused-MoE path as a registered kernel (CUDA; Hopper for FP8 and MXFP4).

Data flow: planner -> `supports` (capability data + per-format compute capability) -> config
(`TritonMoEConfig`, default heuristic or tuned row, checked by `reason_unusable`) -> `run` hands the
typed launch to `triton_fused_moe`. Importing this module needs Triton; the registry skips it without.
"""

from __future__ import annotations

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
from moekit.spec import MoESpec


class TritonFusedKernel(Kernel):
    name = "triton_fused"
    priority = 100
    config_type = TritonMoEConfig
    capabilities = TRITON_CAPABILITIES

    def extra_check(self, spec: MoESpec, problem: Problem) -> str | None:
        return triton_supports(spec, device=problem.device)

    def default_config(self, spec: MoESpec, problem: Problem) -> TritonMoEConfig:
        return default_config(spec, problem.num_tokens)

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
