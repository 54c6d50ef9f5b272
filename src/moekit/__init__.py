"""moekit: capability-checked Mixture-of-Experts layers for NVIDIA Hopper, with a PyTorch reference.

Data flow: `MoESpec` (what math) -> `ExpertWeights` (typed storage) + `route` (which experts) ->
`fused_moe_reference` (the specification, any device). Later layers (planner, kernels, module) build
on these without redefining any parameter.
"""

from moekit.errors import (
    CheckpointError,
    DeviceError,
    DTypeError,
    ExpertIdError,
    FormatError,
    LayoutMismatchError,
    MoekitError,
    PlanFallbackError,
    ShapeError,
    SpecError,
    TunedTableError,
    UnsupportedSpecError,
)
from moekit.presets import PRESETS, preset
from moekit.reference import fused_moe_reference
from moekit.routing import RoutingResult, route
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
