"""The reference as a registered kernel: every spec, every device, slow. The planner's last resort.

Data flow: `Launch` (inputs checked by `moekit.fused_moe`) -> `moekit.reference.reference_forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.kernels.base import Capabilities, DeviceKind, Kernel, KernelConfig, Launch, Problem
from moekit.reference import reference_forward
from moekit.spec import (
    Activation,
    ActivationQuant,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)
from moekit.weights import WeightPacking

EVERY_ACT_DTYPE = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class ReferenceConfig(KernelConfig):
    """The reference has nothing to tune."""


class ReferenceKernel(Kernel):
    name = "reference"
    priority = 0
    config_type = ReferenceConfig
    capabilities = Capabilities(
        weight_formats=frozenset(WeightFormat),
        fp8_scales=frozenset(Fp8Scale),
        act_quants=frozenset(ActivationQuant),
        act_dtypes=EVERY_ACT_DTYPE,
        activations=frozenset(Activation),
        honours_alpha=True,
        honours_limit=True,
        gate_layouts=frozenset(GateLayout),
        bias=True,
        router_placements=frozenset(RouterWeightPlacement),
        expert_map=True,
        devices=frozenset(DeviceKind),
        packings=frozenset(WeightPacking),
        act_quant_weight_formats=frozenset({WeightFormat.FP8_E4M3, WeightFormat.MXFP4}),
    )

    def default_config(self, spec: MoESpec, problem: Problem) -> ReferenceConfig:
        return ReferenceConfig()

    def run(self, launch: Launch) -> torch.Tensor:  # `moekit.fused_moe` checked the launch's inputs
        return reference_forward(
            launch.x, launch.weights, launch.routing, spec=launch.spec, expert_map=launch.expert_map
        )
