"""Every input rule of a forward, written once: what `moekit.fused_moe`, `fused_moe_reference`,
`moekit.route` and `FusedMoE` check before anything runs.

Data flow: a call's arguments -> the checks below, type before shape before dtype before device before
values (the order a reader looks for the mistake in) -> nothing, or the first moekit error, naming the
argument and what to do. Checks that read tensor values (expert ids, the expert map's entries, router
logits being finite, MXFP4 scale bytes) synchronize with the device: callers skip them while a CUDA
graph is being captured, and where the values are valid by construction (ids from `moekit.route`, an
expert map checked when the layer was built). Scale bytes are scanned once per scale tensor (again
only after it is modified in place), so a forward that repeats its weights pays a dictionary lookup.
Kernels keep asserts only for their own invariants; they rely on these checks having run.
"""

from __future__ import annotations

import math
import weakref

import torch

from moekit.errors import (
    DeviceError,
    DTypeError,
    ExpertIdError,
    LayoutMismatchError,
    NonFiniteError,
    ShapeError,
    SpecError,
    check_int,
    check_type,
)
from moekit.formats import check_fp8_scales, check_mxfp4_scales
from moekit.routing import RoutingResult
from moekit.spec import MoESpec, RoutingSpec, WeightFormat
from moekit.weights import ExpertWeights, WeightPacking


def described(value: object) -> str:
    """What a caller passed, for an error message: a tensor's dtype and shape, else its type (and a short
    repr), so that a list of a million floats does not become the message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"a {type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"


def check_tensor_arg(value: object, *, name: str, need: str) -> None:
    """`value` is a torch.Tensor; anything else (a list, a NumPy array) is refused by name."""
    if not isinstance(value, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor {need}, got {described(value)}; convert it first")


def check_arg_type(value: object, cls: type, *, name: str, fix: str) -> None:
    """`value` is a `cls` (the containers of the public API: ExpertWeights, RoutingResult, Plan)."""
    if not isinstance(value, cls):
        raise DTypeError(f"{name} must be a moekit {cls.__name__}, got {described(value)}; {fix}")


# ----- moekit.fused_moe and fused_moe_reference -----------------------------------------------------------
def check_forward(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    expert_map: torch.Tensor | None,
    check_values: bool = True,
    planned_for: tuple[str, str] | None = None,
) -> None:
    """Every check a forward needs before launching anything (types, shapes, dtypes, devices, ids, scale
    bytes).

    `check_values=False` skips the checks that read tensor values (expert ids, expert map entries, MXFP4
    scale bytes not scanned before), which synchronize with the device. `planned_for` is the plan's
    (device type, description): x and the weights must be on that kind of device."""
    check_tensor_arg(x, name="x", need=f"[T, H={spec.H}]")
    check_arg_type(weights, ExpertWeights, name="weights", fix="build them with moekit.ExpertWeights")
    check_arg_type(routing, RoutingResult, name="routing", fix="get it from moekit.route")
    if planned_for is not None:
        check_plan_device({"x": x, "weights": weights.w13}, *planned_for)
    if x.dim() != 2 or x.shape[1] != spec.H:
        raise ShapeError(f"x must be [T, H={spec.H}], got shape {tuple(x.shape)}")
    if x.dtype != spec.act_dtype:
        raise DTypeError(f"x has dtype {x.dtype} but spec.act_dtype is {spec.act_dtype}")
    weights.validate(spec)
    if routing.num_tokens != x.shape[0] or routing.top_k != spec.K:
        raise ShapeError(
            f"routing is [T={routing.num_tokens}, K={routing.top_k}] but x has T={x.shape[0]} "
            f"and spec K={spec.K}"
        )
    for name, t in (("weights", weights.w13), ("routing", routing.ids)):
        if t.device != x.device:
            raise DeviceError(f"x is on {x.device} but {name} is on {t.device}; move them to one device")
    if check_values:
        routing.check_ids(spec.E)
        check_scale_values(weights)
    check_expert_map_given(spec, expert_map)
    if expert_map is not None:
        if expert_map.device != x.device:
            raise DeviceError(f"expert_map is on {expert_map.device} but x is on {x.device}")
        check_expert_map_structure(expert_map, num_experts=spec.E)
        if check_values:
            check_expert_map_entries(expert_map, num_local_experts=spec.E_local)


def check_plan_device(tensors: dict[str, torch.Tensor], plan_device: str, plan_describe: str) -> None:
    """Each tensor on the kind of device the plan was made for (`plan_device`: "cpu" or "cuda"): a kernel
    planned for one never launches on the other."""
    for name, t in tensors.items():
        if t.device.type != plan_device:
            raise DeviceError(
                f"the plan was made for {plan_describe} ({plan_device}) but {name} is on {t.device}; move "
                f"x and the weights to {plan_device}, or plan for {t.device} "
                f"(moekit.plan(spec, num_tokens=..., device={str(t.device)!r}))"
            )


def check_packing(reason: str | None) -> None:
    """`reason` is the chosen kernel's `weights_reason`: weights it cannot read were not prepared for it."""
    if reason is not None:
        raise LayoutMismatchError(f"{reason}; call moekit.prepare_weights(weights, plan) once at load time")


# ----- the expert map (expert parallelism) ----------------------------------------------------------------
def check_expert_map_given(spec: MoESpec, expert_map: torch.Tensor | None) -> None:
    """A spec with local experts (`num_local_experts`) needs an expert map; any other spec forbids one."""
    if spec.uses_expert_map != (expert_map is not None):
        raise SpecError(
            f"spec.num_local_experts={spec.num_local_experts} "
            f"{'needs' if spec.uses_expert_map else 'forbids'} an expert_map"
        )
    if expert_map is not None:
        check_expert_map_structure(expert_map, num_experts=spec.E)


def check_expert_map_structure(expert_map: torch.Tensor, *, num_experts: int) -> None:
    """An expert map is an int32 tensor `[E]` (read from its metadata alone: no sync)."""
    if not isinstance(expert_map, torch.Tensor):
        raise ExpertIdError(
            f"expert_map must be an int32 torch.Tensor [E={num_experts}], got {described(expert_map)}; "
            "build it with torch.tensor(..., dtype=torch.int32)"
        )
    if expert_map.shape != (num_experts,) or expert_map.dtype != torch.int32:
        raise ExpertIdError(
            f"expert_map must be int32 [E={num_experts}], got {expert_map.dtype} {tuple(expert_map.shape)}"
        )


def check_expert_map(expert_map: torch.Tensor, *, num_experts: int, num_local_experts: int) -> None:
    """An expert map is int32 `[E]`, each entry -1 (another rank) or a distinct local id in `[0, E_local)`.

    Reads the entries: syncs with the device."""
    check_expert_map_structure(expert_map, num_experts=num_experts)
    check_expert_map_entries(expert_map, num_local_experts=num_local_experts)


def check_expert_map_entries(expert_map: torch.Tensor, *, num_local_experts: int) -> None:
    """Each entry is -1 or a local id in `[0, E_local)`, each local id exactly once (a local expert no
    global id reaches would hold weights that never run). Syncs with the device."""
    local = expert_map[expert_map >= 0]
    if bool((expert_map < -1).any()) or (local.numel() and int(local.max()) >= num_local_experts):
        raise ExpertIdError(
            f"expert_map entries must be -1 or in [0, E_local={num_local_experts}); got min "
            f"{int(expert_map.min())}, max {int(expert_map.max())}"
        )
    counts = torch.bincount(local.long(), minlength=num_local_experts)
    if bool((counts != 1).any()):
        per_id = counts.tolist()
        repeated = [i for i, c in enumerate(per_id) if c > 1]
        missing = [i for i, c in enumerate(per_id) if c == 0]
        faults = []
        if repeated:
            faults.append(f"maps two global experts to the same local expert (local ids {repeated})")
        if missing:
            faults.append(f"leaves local experts {missing} unmapped, so they would never run")
        raise ExpertIdError(
            f"expert_map {' and '.join(faults)} (num_local_experts={num_local_experts}); map each local id "
            f"0..{num_local_experts - 1} from exactly one global expert"
        )


def capturing(t: object) -> bool:
    """True while `t`'s CUDA stream is being captured into a graph: no check may sync then."""
    return isinstance(t, torch.Tensor) and t.is_cuda and torch.cuda.is_current_stream_capturing()


# ----- values: MXFP4 scale bytes, router logits (each read syncs with the device) -------------------------
# id(scale tensor) -> (a weak reference to it, its version counter when it was scanned)
_SCANNED: dict[int, tuple[weakref.ref, int]] = {}


def check_scale_values(weights: ExpertWeights) -> None:
    """No MXFP4 scale byte is 0xFF (E8M0 NaN), no FP8 scale is non-finite or <= 0. Each scale tensor is
    scanned once (a sync) and again only after an in-place change (its version counter moves); later
    calls cost a dictionary lookup."""
    if not weights.format.is_quantized or weights.stores_floats:
        return
    if weights.packing is WeightPacking.MXFP4_W4A8:  # no E8M0 bytes left: checked when packed
        return
    check = check_mxfp4_scales if weights.format is WeightFormat.MXFP4 else check_fp8_scales
    for name in ("w13_scale", "w2_scale"):
        t = getattr(weights, name)
        seen = _SCANNED.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            continue
        check(t, name=name)
        key = id(t)
        _SCANNED[key] = (weakref.ref(t, lambda _ref, key=key: _SCANNED.pop(key, None)), t._version)


def finite_as_routed(t: torch.Tensor) -> torch.Tensor:
    """Which entries of router logits (or a correction bias) are finite in float32, what routing computes
    in: a float64 value beyond the float32 range becomes +-inf there. Other dtypes convert exactly, so
    only float64 pays a cast (the size of the bool mask `isfinite` writes anyway)."""
    return torch.isfinite(t.float() if t.dtype == torch.float64 else t)


def check_finite_logits(logits: torch.Tensor, *, correction_bias: torch.Tensor | None = None) -> None:
    """Router logits (and the correction bias, if given) are finite in float32 (the routing contract,
    `moekit.routing`). One sync with the device, for both."""
    finite = finite_as_routed(logits)
    ok = finite.all()
    if correction_bias is not None:
        ok = ok & finite_as_routed(correction_bias).all()
    if bool(ok):
        return
    if correction_bias is not None:
        check_correction_bias_values(correction_bias)
    bad = (~finite).nonzero()
    token, expert = (int(i) for i in bad[0])
    first = logits[token, expert].item()
    if math.isfinite(first):
        raise NonFiniteError(
            f"router logits hold {bad.shape[0]} of {logits.numel()} values that are not finite in float32, "
            f"first {first} (beyond the float32 range) at [token {token}, expert {expert}]; moekit routes "
            "in float32: scale the logits into its range (|x| <= 3.4e38), or cast them yourself"
        )
    raise NonFiniteError(
        f"router logits hold {bad.shape[0]} non-finite values (NaN or +-inf) of {logits.numel()}, first "
        f"{first} at [token {token}, expert {expert}]; moekit routes finite logits "
        "only: find where the NaN/inf comes from (the hidden states feeding the router), and mask an "
        "expert with a large finite negative logit (torch.finfo(torch.float32).min), not -inf"
    )


def check_correction_bias_values(correction_bias: torch.Tensor) -> None:
    """The correction bias `[E]` is finite in float32: a NaN would send every token to the same experts
    with finite weights. Syncs with the device (`FusedMoE`: once, when it is built)."""
    finite = finite_as_routed(correction_bias)
    if bool(finite.all()):
        return
    bad = (~finite).nonzero().flatten()
    expert = int(bad[0])
    raise NonFiniteError(
        f"correction_bias holds {bad.numel()} of {correction_bias.numel()} values that are not finite in "
        f"float32 (first {correction_bias[expert].item()} at expert {expert}); the bias must be finite: "
        "check the checkpoint's e_score_correction_bias"
    )


# The float dtypes routing reads (it computes in float32); FP8 has no isfinite, softmax or sort in torch.
ROUTING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_routing_dtype(t: torch.Tensor, *, name: str) -> None:
    """Router logits or a correction bias in one of `ROUTING_DTYPES`."""
    if t.dtype not in ROUTING_DTYPES:
        raise DTypeError(
            f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}; cast it with .float()"
        )


# ----- moekit.route -------------------------------------------------------------------------------------
def check_route(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec, correction_bias: torch.Tensor | None
) -> None:
    """Router logits are a float `[T, E]`; `top_k` in `[1, E]`; the correction bias as `spec` says."""
    check_tensor_arg(logits, name="router logits", need="(float, [T, E])")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ShapeError(f"router logits must be a float [T, E] tensor, got {described(logits)}")
    check_routing_dtype(logits, name="router logits")
    num_experts = logits.shape[1]
    check_int("route(top_k=...)", top_k, minimum=1)
    if not 1 <= top_k <= num_experts:
        raise SpecError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    fix = "pass spec.routing" if isinstance(spec, MoESpec) else "pass a moekit.RoutingSpec(...)"
    check_type("route(spec=...)", spec, RoutingSpec, fix=fix)
    check_correction_bias_given(spec, correction_bias)
    if correction_bias is not None:
        check_tensor_arg(correction_bias, name="correction_bias", need=f"[E={num_experts}]")
        if correction_bias.shape != (num_experts,):
            raise ShapeError(f"correction_bias must be [E={num_experts}], got {tuple(correction_bias.shape)}")
        check_routing_dtype(correction_bias, name="correction_bias")
        if correction_bias.device != logits.device:
            raise DeviceError(f"correction_bias on {correction_bias.device} but logits on {logits.device}")
    spec.check_experts(num_experts, top_k)


def check_correction_bias_given(spec: RoutingSpec, correction_bias: torch.Tensor | None) -> None:
    """A routing with `has_correction_bias` needs the bias; any other routing forbids one."""
    if spec.has_correction_bias != (correction_bias is not None):
        raise SpecError(
            f"spec.has_correction_bias={spec.has_correction_bias} but correction_bias "
            f"{'was' if correction_bias is not None else 'was not'} given"
        )


# ----- FusedMoE -----------------------------------------------------------------------------------------
def check_router_tensor(t: torch.Tensor, *, name: str, shape: tuple[int, ...], spec: MoESpec) -> None:
    """A layer's router weight `[E, H]`, router bias `[E]` or correction bias `[E]`: float, that shape."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise DTypeError(f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ShapeError(f"{name} has shape {tuple(t.shape)}, expected {shape} for spec ({spec.describe()})")


def check_layer_tensors(
    spec: MoESpec,
    weights: ExpertWeights,
    router_weight: torch.Tensor | None,
    router_bias: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
) -> None:
    """A layer's tensors against its (local) spec, where they are, before any is moved: the weights
    (shapes, dtypes, NaN scales), the router weight `[E, H]`, router bias and correction bias `[E]`
    (the bias given iff the routing needs one, finite)."""
    weights.validate(spec, check_nan_scales=True)
    for name, t, shape in (
        ("router_weight", router_weight, (spec.E, spec.H)),
        ("router_bias", router_bias, (spec.E,)),
        ("correction_bias", correction_bias, (spec.E,)),
    ):
        if t is not None:
            check_router_tensor(t, name=name, shape=shape, spec=spec)
    check_correction_bias_given(spec.routing, correction_bias)
    if correction_bias is not None:
        check_routing_dtype(correction_bias, name="correction_bias")
        check_correction_bias_values(correction_bias)


def check_hidden_states(x: torch.Tensor, *, spec: MoESpec, device: torch.device) -> None:
    """A layer's input: `[..., H]` in the spec's act dtype, on the layer's device."""
    check_tensor_arg(x, name="hidden_states", need=f"[..., H={spec.H}]")
    if x.dim() < 1 or x.shape[-1] != spec.H:
        raise ShapeError(f"hidden_states must be [..., H={spec.H}], got shape {tuple(x.shape)}")
    if x.dtype != spec.act_dtype:
        raise DTypeError(f"hidden_states have dtype {x.dtype} but the layer's act_dtype is {spec.act_dtype}")
    if x.device != device:
        raise DeviceError(f"hidden_states are on {x.device} but the layer is on {device}")


def check_router_logits(
    logits: torch.Tensor | None,
    *,
    hidden_states: torch.Tensor,
    spec: MoESpec,
    device: torch.device,
    has_router: bool,
) -> None:
    """Logits given to a layer: float, `[..., E]` matching `hidden_states` (or flat `[T, E]`), on the
    layer's device; a layer without a router weight needs them."""
    if logits is None:
        if not has_router:
            raise SpecError("this layer has no router weight: pass router_logits")
        return
    e = spec.E
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = getattr(logits, "dtype", type(logits).__name__)
        raise DTypeError(f"router_logits must be a float tensor, got {got}")
    check_routing_dtype(logits, name="router_logits")
    lead = tuple(hidden_states.shape[:-1])
    if tuple(logits.shape) not in ((*lead, e), (hidden_states.numel() // spec.H, e)):
        raise ShapeError(
            f"router_logits must be [..., E={e}] matching hidden_states {tuple(hidden_states.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    if logits.device != device:
        raise DeviceError(f"router_logits are on {logits.device} but the layer is on {device}")
