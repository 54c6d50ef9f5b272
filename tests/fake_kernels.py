"""Deliberately incapable kernels, modelled on real dispatch failures, for planner tests.

Each would compute the wrong function if the planner ever chose it for a spec it cannot serve:
`silu_gelu_only` ignores SWIGLU_OAI (runs SILU instead), `concat_only` reads every w13 as CONCAT.
They carry a high priority, so a planner that skipped the capability check would pick them first.
"""

from dataclasses import dataclass, replace

from moekit.kernels.base import DeviceKind, Kernel, KernelConfig, Launch, Problem
from moekit.kernels.reference import ReferenceKernel
from moekit.kernels.torch_grouped import TorchGroupedKernel
from moekit.reference import fused_moe_reference
from moekit.spec import Activation, ActivationSpec, GateLayout, MoESpec


@dataclass(frozen=True)
class TileConfig(KernelConfig):
    block_m: int = 16

    def __post_init__(self):
        if not isinstance(self.block_m, int) or self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m!r}")


_EVERYTHING = ReferenceKernel.capabilities


class SiluGeluOnlyKernel(Kernel):
    name = "silu_gelu_only"
    priority = 100
    config_type = TileConfig
    capabilities = replace(
        _EVERYTHING,
        activations=frozenset({Activation.SILU, Activation.GELU}),
        honours_alpha=False,
        devices=frozenset(DeviceKind),
    )

    def default_config(self, spec: MoESpec, problem: Problem) -> TileConfig:
        return TileConfig()

    def run(self, launch: Launch):
        wrong = replace(
            launch.spec, activation=ActivationSpec(Activation.SILU, limit=launch.spec.activation.limit)
        )
        return fused_moe_reference(
            launch.x, launch.weights, launch.routing, spec=wrong, expert_map=launch.expert_map
        )


class ConcatOnlyKernel(Kernel):
    name = "concat_only"
    priority = 100
    config_type = TileConfig
    capabilities = replace(_EVERYTHING, gate_layouts=frozenset({GateLayout.CONCAT}))

    def default_config(self, spec: MoESpec, problem: Problem) -> TileConfig:
        return TileConfig()

    def run(self, launch: Launch):
        weights = replace(launch.weights, gate_layout=GateLayout.CONCAT)
        spec = replace(launch.spec, gate_layout=GateLayout.CONCAT)
        return fused_moe_reference(launch.x, weights, launch.routing, spec=spec, expert_map=launch.expert_map)


class CudaOnlyGroupedKernel(TorchGroupedKernel):
    """The unfused path restricted to CUDA: a capable kernel that a CPU must refuse."""

    capabilities = replace(TorchGroupedKernel.capabilities, devices=frozenset({DeviceKind.CUDA}))


class CudaGroupedKernel(CudaOnlyGroupedKernel):
    """The same under its own name and a high priority, to sit beside the real one in a registry."""

    name = "cuda_grouped"
    priority = 50
