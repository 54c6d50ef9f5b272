"""`fused_moe`: the one entry point that runs a plan.

Data flow: (x, weights, routing, plan) -> every input check (shapes, dtypes, devices, ids, layout and
packing against the chosen kernel) before any launch -> one typed `Launch` -> the kernel's `run`.
Value checks (expert ids, expert map) read device memory; they are skipped while a CUDA graph is being
captured, so a captured forward has no host synchronization.
"""

from __future__ import annotations

import torch

from moekit.errors import LayoutMismatchError, UnsupportedSpecError
from moekit.kernels.base import Kernel, Launch
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.planning.plan import Plan
from moekit.reference import check_inputs
from moekit.routing import RoutingResult
from moekit.weights import ExpertWeights


def kernel_of(plan: Plan, registry: KernelRegistry | None = None) -> Kernel:
    registry = registry or default_registry()
    kernel = registry.get(plan.kernel)
    if kernel is None:
        raise UnsupportedSpecError(
            f"plan names kernel {plan.kernel!r}, which is not in this registry ({list(registry.names)}); "
            "plan with the registry you run with"
        )
    return kernel


def prepare_weights(
    weights: ExpertWeights, plan: Plan, *, registry: KernelRegistry | None = None
) -> ExpertWeights:
    """Repack `weights` once, at load time, into the packing the plan's kernel reads."""
    weights.validate(plan.spec)
    return kernel_of(plan, registry).prepare_weights(weights, plan.spec)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def fused_moe(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    plan: Plan,
    expert_map: torch.Tensor | None = None,
    registry: KernelRegistry | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Run the MoE layer as `plan` says; returns `[T, H]` in `plan.spec.act_dtype`.

    `check_values=False` skips the checks that read device memory (expert ids, expert map) and so
    synchronize: for callers whose routing is produced by `moekit.route` (ids valid by construction),
    such as `FusedMoE`. They are skipped anyway while a CUDA graph is being captured."""
    spec = plan.spec
    kernel = kernel_of(plan, registry)
    check_inputs(
        x, weights, routing, spec=spec, expert_map=expert_map, check_values=check_values and not _capturing(x)
    )
    if (reason := kernel.weights_reason(weights)) is not None:
        raise LayoutMismatchError(f"{reason}; call moekit.prepare_weights(weights, plan) once at load time")
    launch = Launch(
        spec=spec, config=plan.config, x=x, weights=weights, routing=routing, expert_map=expert_map
    )
    return kernel.run(launch)
