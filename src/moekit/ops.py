"""`fused_moe`: the one entry point that runs a plan; `route`: the one that picks a routing path.

Data flow: (x, weights, routing, plan) -> the plan itself (its kernel supports its spec on its device and
takes its config: a hand-made or edited plan has no back door; cached per (kernel, spec, device, config))
-> every input check (`moekit.checks`: types, shapes, dtypes, devices against each other and against the
plan, ids, the expert map, MXFP4 scale bytes, the weights' packing against the chosen kernel) before any
launch -> one typed `Launch` -> the kernel's `run`. Value checks (expert ids, expert map, scale bytes,
finite router logits) read device memory; they are skipped while a CUDA graph is being captured, so a
captured forward has no host synchronization. Routing: logits -> `checks.check_route` (and the finite
check) -> on CUDA with E <= 1024 the one-launch Triton route of any routing method, otherwise the torch
twin (`moekit.routing.route_torch`); both follow the non-finite-logits contract of `moekit.routing`.
"""

from __future__ import annotations

import functools

import torch

from moekit.checks import (
    capturing,
    check_arg_type,
    check_finite_logits,
    check_forward,
    check_packing,
    check_route,
    check_scale_values,
)
from moekit.errors import ArgumentError, UnsupportedSpecError, check_bool
from moekit.kernels.base import DeviceInfo, Kernel, KernelConfig, Launch, Problem
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.planning.plan import Plan
from moekit.routing import RoutingResult, route_torch
from moekit.spec import MoESpec, RoutingSpec
from moekit.weights import ExpertWeights


def kernel_of(plan: Plan, registry: KernelRegistry | None = None) -> Kernel:
    """The plan's kernel from `registry`, after checking that it can run the plan (`check_plan`)."""
    check_arg_type(plan, Plan, name="plan", fix="make it with moekit.plan(spec, num_tokens=..., device=...)")
    registry = registry or default_registry()
    kernel = registry.get(plan.kernel)
    if kernel is None:
        raise UnsupportedSpecError(
            f"plan names kernel {plan.kernel!r}, which is not in this registry ({list(registry.names)}); "
            "plan with the registry you run with"
        )
    check_plan(kernel, plan)
    return kernel


def check_plan(kernel: Kernel, plan: Plan) -> None:
    """`kernel` supports `plan.spec` on `plan.device` and takes `plan.config`, else `UnsupportedSpecError`
    with the kernel's reason. `moekit.plan` only makes such plans; this refuses one built or edited by
    hand (`dataclasses.replace(plan, kernel=...)`), which would compute another function silently."""
    if not isinstance(plan.spec, MoESpec) or not isinstance(plan.device, DeviceInfo):
        raise UnsupportedSpecError(
            f"plan.spec must be a MoESpec and plan.device a DeviceInfo, got {type(plan.spec).__name__} and "
            f"{type(plan.device).__name__}; make plans with moekit.plan(...)"
        )
    if not isinstance(plan.config, KernelConfig):
        raise UnsupportedSpecError(
            f"plan.config must be a KernelConfig of kernel {kernel.name} ({kernel.config_type.__name__}), "
            f"got {type(plan.config).__name__}; make plans with moekit.plan(...)"
        )
    reason = _plan_reason(kernel, plan.spec, plan.device, plan.config, plan.num_tokens)
    if reason is not None:
        raise UnsupportedSpecError(f"{reason}; make plans with moekit.plan(...) instead of editing them")


@functools.lru_cache(maxsize=1024)
def _plan_reason(
    kernel: Kernel, spec: MoESpec, device: DeviceInfo, config: KernelConfig, num_tokens: int
) -> str | None:
    """Why `kernel` cannot run (spec, device, config), or None; cached: a served plan costs one lookup."""
    reason = kernel.supports(spec, Problem(num_tokens=num_tokens, device=device))
    if reason is not None:
        where = device.describe()
        return f"plan names kernel {kernel.name!r}, which cannot compute this spec on {where}: {reason}"
    reason = kernel.validate_config(config, spec)
    if reason is not None:
        return f"plan's config {config.as_dict()} is not usable by kernel {kernel.name!r}: {reason}"
    return None


def prepare_weights(
    weights: ExpertWeights, plan: Plan, *, registry: KernelRegistry | None = None
) -> ExpertWeights:
    """Repack `weights` once, at load time, into the packing the plan's kernel reads.

    Load time is where values are checked: every MXFP4 scale byte (0xFF, E8M0 NaN) and FP8 scale (not finite
    or <= 0) is scanned, a bad one is a `FormatError`, and so are the prepared ones, which `fused_moe` then
    finds scanned. Syncs."""
    kernel = kernel_of(plan, registry)
    check_arg_type(weights, ExpertWeights, name="weights", fix="build them with moekit.ExpertWeights")
    weights.validate(plan.spec)
    check_scale_values(weights)
    prepared = kernel.prepare_weights(weights, plan.spec)
    check_scale_values(prepared)
    return prepared


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

    `check_values=False` skips the checks that read device memory (expert ids, expert map, MXFP4 scale
    bytes not scanned before by `prepare_weights` or an earlier call) and so synchronize: for callers
    whose routing is produced by `moekit.route` (ids valid by construction). They are skipped anyway
    while a CUDA graph is being captured."""
    check_bool("fused_moe(check_values=...)", check_values, error=ArgumentError)
    kernel = kernel_of(plan, registry)
    spec = plan.spec
    check_forward(
        x,
        weights,
        routing,
        spec=spec,
        expert_map=expert_map,
        check_values=check_values and not capturing(x),
        planned_for=(plan.device.kind.value, plan.device.describe()),
    )
    check_packing(kernel.weights_reason(weights))
    return run_checked(kernel, plan, x, weights, routing, expert_map=expert_map)


def run_checked(
    kernel: Kernel,
    plan: Plan,
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    expert_map: torch.Tensor | None,
) -> torch.Tensor:
    """`kernel.run` on inputs that passed every check of `fused_moe` (there, or where they were made:
    `FusedMoE` checks its weights, expert map and packing once when it builds and prepares them)."""
    launch = Launch(
        spec=plan.spec, config=plan.config, x=x, weights=weights, routing=routing, expert_map=expert_map
    )
    return kernel.run(launch)


def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    spec: RoutingSpec,
    correction_bias: torch.Tensor | None = None,
    check_values: bool = True,
) -> RoutingResult:
    """Select `top_k` experts per token from router logits `[T, E]` as `spec` says.

    CUDA logits and E <= 1024, any routing method: one Triton launch, one token a warp
    (`moekit.kernels.triton.route`), where the torch ops sort and mask in many launches (measured on an
    H200: DeepSeek-V3's grouped sigmoid 4.8 us at T = 1 and 64 us at T = 16384 against 85 and 1,017 us;
    gpt-oss-120b's softmax 2.0 and 11.7 us against 29.5 and 154 us). Same ids as the torch twin, weights
    within a few fp32 ulps. Anything else: the torch twin.

    Non-finite logits (NaN, +-inf, or float64 values beyond the float32 range routing computes in) and a
    non-finite correction bias raise `NonFiniteError`; the check (one for both) syncs with the device, so
    it is skipped with `check_values=False` and while a CUDA graph is being captured, where a token with
    such a logit gets NaN weights instead (the contract in `moekit.routing`)."""
    check_bool("route(check_values=...)", check_values, error=ArgumentError)
    check_route(logits, top_k=top_k, spec=spec, correction_bias=correction_bias)
    if check_values and not capturing(logits):
        check_finite_logits(logits, correction_bias=correction_bias)
    return route_checked(logits, top_k=top_k, spec=spec, correction_bias=correction_bias)


def route_checked(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec, correction_bias: torch.Tensor | None
) -> RoutingResult:
    """`route` on arguments that passed `checks.check_route` (there, or where they were made: `FusedMoE`
    checks its router logits per forward and its correction bias once, and its `MoESpec` bounds K)."""
    if logits.is_cuda:
        triton_route = _triton_route_module()
        if triton_route is not None and triton_route.fast_route_supported(spec, logits.shape[1]):
            weights, ids = triton_route.route_one_launch(
                logits, top_k=top_k, spec=spec, correction_bias=correction_bias
            )
            return RoutingResult(weights=weights, ids=ids)
    return route_torch(logits, top_k=top_k, spec=spec, correction_bias=correction_bias)


@functools.cache
def _triton_route_module():
    """`moekit.kernels.triton.route`, imported on first use (Triton is optional), or None without Triton."""
    try:
        from moekit.kernels.triton import route as triton_route
    except ImportError:
        return None
    return triton_route
