"""moekit: capability-checked Mixture-of-Experts layers for NVIDIA Hopper, with a PyTorch reference.

Data flow: `MoESpec` (what math) -> `plan` (which capable kernel and config, resolved once, with the
reasons for every refusal) -> `prepare_weights` (load-time repacking) -> `fused_moe` (runs the plan;
`route` gives it the experts) -> checked against `fused_moe_reference` (the specification, any device).
"""

from moekit.errors import (
    CheckpointError,
    DeviceError,
    DTypeError,
    ExpertIdError,
    FormatError,
    LayoutMismatchError,
    MoekitError,
    NonFiniteError,
    PlanFallbackError,
    ShapeError,
    SpecError,
    TunedTableError,
    UnsupportedSpecError,
)
from moekit.layer import FusedMoE, PlanOptions, WarmupReport
from moekit.ops import fused_moe, prepare_weights, route
from moekit.parallel import EpEngine, Parallel, ParallelMode
from moekit.planning.plan import ConfigSource, Plan, plan
from moekit.presets import PRESETS, preset
from moekit.reference import fused_moe_reference
from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
)
from moekit.weights import ExpertWeights, WeightPacking

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ConfigSource",
    "FusedMoE",
    "EpEngine",
    "Parallel",
    "ParallelMode",
    "PlanOptions",
    "WarmupReport",
    "Plan",
    "fused_moe",
    "plan",
    "prepare_weights",
    "Activation",
    "ActivationQuant",
    "ActivationSpec",
    "CheckpointError",
    "DTypeError",
    "DeviceError",
    "ExpertIdError",
    "ExpertWeights",
    "Fp8Scale",
    "FormatError",
    "GateLayout",
    "LayoutMismatchError",
    "MoESpec",
    "MoekitError",
    "NonFiniteError",
    "PlanFallbackError",
    "RouterWeightPlacement",
    "RoutingMethod",
    "RoutingResult",
    "RoutingSpec",
    "ShapeError",
    "SpecError",
    "TunedTableError",
    "UnsupportedSpecError",
    "WeightFormat",
    "WeightPacking",
    "fused_moe_reference",
    "preset",
    "route",
]
