"""The kernel interface: capabilities as data, typed configs, one typed launch description.

Data flow: the planner asks each registered `Kernel` `supports(spec, problem)` (capabilities data +
a kernel-specific check) -> picks one and a config -> `prepare_weights` once at load -> `run(Launch)`
per forward. A `Launch` is the only way arguments reach a kernel: every math parameter comes from the
spec inside it, so nothing can be passed twice or travel in an untyped dict.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from dataclasses import dataclass

import torch

from moekit.errors import DeviceError, TunedTableError, check_enum, check_int
from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationQuant,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)
from moekit.weights import ExpertWeights, WeightPacking


class DeviceKind(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class DeviceInfo:
    """What the planner needs to know of a device (read once, off the hot path)."""

    kind: DeviceKind
    name: str  # "cpu" or e.g. "NVIDIA H200"; tuned tables are keyed by it
    compute_capability: tuple[int, int] | None = None  # CUDA only
    # Streaming multiprocessors (CUDA only; None: unknown). Config heuristics size decode splits by it;
    # tuned tables are keyed by `name`, which already implies it.
    multiprocessors: int | None = None

    def __post_init__(self) -> None:
        check_enum("DeviceInfo.kind", self.kind, DeviceKind, error=DeviceError)
        if not isinstance(self.name, str) or not self.name:
            raise DeviceError(
                f"DeviceInfo.name must be a non-empty str (tuned tables are keyed by it), got {self.name!r}"
            )
        cc = self.compute_capability
        if cc is not None:
            if not isinstance(cc, tuple) or len(cc) != 2:
                raise DeviceError(
                    f"DeviceInfo.compute_capability must be None or a (major, minor) tuple, got {cc!r}; "
                    "e.g. (9, 0) for an H200"
                )
            for part in cc:
                check_int("DeviceInfo.compute_capability[i]", part, minimum=0, error=DeviceError)
        check_int(
            "DeviceInfo.multiprocessors", self.multiprocessors, minimum=1, optional=True, error=DeviceError
        )

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceInfo:
        """The device `device` names on this machine; anything else is a `DeviceError` that says why."""
        device = parse_device(device)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise DeviceError(
                    f"device {str(device)!r}: no CUDA device on this machine (torch.cuda.is_available() is "
                    "False); use device='cpu', or plan for a GPU without one: "
                    "DeviceInfo(DeviceKind.CUDA, 'NVIDIA H200', (9, 0))"
                )
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index >= count:
                raise DeviceError(
                    f"device {str(device)!r}: this machine has {count} CUDA device(s), "
                    f"cuda:0 to cuda:{count - 1}"
                )
            props = torch.cuda.get_device_properties(index)
            return cls(
                DeviceKind.CUDA,
                torch.cuda.get_device_name(index),
                torch.cuda.get_device_capability(index),
                props.multi_processor_count,
            )
        if device.type == "cpu":
            return cls(DeviceKind.CPU, "cpu")
        raise DeviceError(f"moekit runs on cpu or cuda devices, got {device}; use 'cpu' or 'cuda'")

    def describe(self) -> str:
        cc = (
            f" (sm_{self.compute_capability[0]}{self.compute_capability[1]})"
            if self.compute_capability
            else ""
        )
        return f"{self.name}{cc}"


def parse_device(device: object) -> torch.device:
    """`device` (a torch.device or a device string) as a torch.device; anything else is a DeviceError."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise DeviceError(
            f"device must be a torch.device or a string such as 'cpu', 'cuda' or 'cuda:1', "
            f"got {device!r} ({type(device).__name__})"
            + (f"; a bare index is ambiguous, pass 'cuda:{device}'" if type(device) is int else "")
        )
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise DeviceError(f"device {device!r} is not a device string; use 'cpu', 'cuda' or 'cuda:N'") from err


@dataclass(frozen=True)
class Problem:
    """The run-time side of a plan: how many tokens, on what device."""

    num_tokens: int
    device: DeviceInfo


@dataclass(frozen=True)
class Capabilities:
    """What a kernel can compute, as data. `check` gives the first reason it cannot, or None."""

    weight_formats: frozenset[WeightFormat]
    fp8_scales: frozenset[Fp8Scale]
    act_quants: frozenset[ActivationQuant]
    act_dtypes: frozenset[torch.dtype]
    activations: frozenset[Activation]
    honours_alpha: bool  # SWIGLU_OAI's alpha reaches the math (not a hard-coded 1.702)
    honours_limit: bool  # an optional clamp limit is applied
    gate_layouts: frozenset[GateLayout]
    bias: bool
    router_placements: frozenset[RouterWeightPlacement]
    expert_map: bool
    devices: frozenset[DeviceKind]
    packings: frozenset[WeightPacking]  # what `run` reads after `prepare_weights`
    min_compute_capability: tuple[int, int] | None = None  # CUDA only
    # Weight formats whose dots this kernel runs on FP8-quantized activations (when `act_quant` asks):
    # FP8_E4M3 is W8A8, MXFP4 is W4A8.
    act_quant_weight_formats: frozenset[WeightFormat] = frozenset({WeightFormat.FP8_E4M3})

    def check(self, spec: MoESpec, device: DeviceInfo | None = None) -> str | None:
        """The first reason this kernel cannot compute `spec` (on `device`, if given), or None."""
        if spec.weight_format not in self.weight_formats:
            return f"weight format {spec.weight_format.name} not in {_names(self.weight_formats)}"
        if spec.fp8_scale is not None and spec.fp8_scale not in self.fp8_scales:
            return f"FP8 scale granularity {spec.fp8_scale.name} not in {_names(self.fp8_scales)}"
        if spec.act_quant not in self.act_quants:
            return f"activation quantization {spec.act_quant.name} not in {_names(self.act_quants)}"
        if (
            spec.act_quant is not ActivationQuant.NONE
            and spec.weight_format not in self.act_quant_weight_formats
        ):
            return (
                f"FP8 activations ({spec.act_quant.name}) with {spec.weight_format.name} weights are not "
                f"implemented here (only with {_names(self.act_quant_weight_formats)} weights)"
            )
        if spec.act_dtype not in self.act_dtypes:
            return f"activation dtype {spec.act_dtype} not in {sorted(str(d) for d in self.act_dtypes)}"
        if spec.activation.kind not in self.activations:
            return f"activation {spec.activation.kind.name} not in {_names(self.activations)}"
        if spec.activation.alpha is not None and not self.honours_alpha:
            return f"cannot apply alpha={spec.activation.alpha:g}"
        if spec.activation.limit is not None and not self.honours_limit:
            return f"cannot apply clamp limit={spec.activation.limit:g}"
        if spec.gate_layout not in self.gate_layouts:
            return f"reads gate layout {_names(self.gate_layouts)}, not {spec.gate_layout.name}"
        if spec.has_bias and not self.bias:
            return "no bias support"
        if spec.router_weight_placement not in self.router_placements:
            return f"router weight on the {spec.router_weight_placement.name.lower()} not supported"
        if spec.uses_expert_map and not self.expert_map:
            return "no expert-map (expert parallel) support"
        if device is not None:
            if device.kind not in self.devices:
                return f"runs on {_names(self.devices)}, not {device.kind.name}"
            need = self.min_compute_capability
            if device.kind is DeviceKind.CUDA and need and (device.compute_capability or (0, 0)) < need:
                return (
                    f"needs compute capability >= {need[0]}.{need[1]}, device has {device.compute_capability}"
                )
        return None


def _specialization(n: int) -> tuple[bool, bool, bool]:
    """How Triton specializes an int argument: equal to 1, divisible by 16, needs 64 bits."""
    return n == 1, n % 16 == 0, n >= 2**31


def _names(values: frozenset) -> str:
    return "/".join(sorted(v.name for v in values))


@dataclass(frozen=True)
class KernelConfig:
    """Base of every kernel's config type; subclasses are frozen dataclasses validated in __post_init__."""

    def as_dict(self) -> dict:
        """The fields as JSON values: an enum field as its member's name."""
        return {
            name: value.name if isinstance(value, enum.Enum) else value
            for name, value in dataclasses.asdict(self).items()
        }


def config_from_dict(config_type: type[KernelConfig], data: object, *, kernel: str) -> KernelConfig:
    """Build `config_type` from a tuned-table dict; any problem is a `TunedTableError` naming the kernel."""
    if not isinstance(data, dict):
        raise TunedTableError(f"config for kernel {kernel!r} must be an object, got {data!r}")
    names = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise TunedTableError(
            f"config for kernel {kernel!r} has unknown fields {unknown}; known: {sorted(names)}"
        )
    for field in dataclasses.fields(config_type):
        members = type(field.default).__members__ if isinstance(field.default, enum.Enum) else None
        if members is not None and field.name in data:  # enums are stored by member name
            value = data[field.name]
            if not isinstance(value, str) or value not in members:
                raise TunedTableError(
                    f"config for kernel {kernel!r}: {field.name} must be one of {list(members)}, "
                    f"got {value!r}"
                )
            data = {**data, field.name: members[value]}
    try:
        return config_type(**data)
    except (TypeError, ValueError) as err:
        raise TunedTableError(f"invalid config for kernel {kernel!r}: {err}") from err


@dataclass(frozen=True)
class Launch:
    """Everything one forward needs, typed. Built by `moekit.fused_moe` after all checks passed."""

    spec: MoESpec
    config: KernelConfig
    x: torch.Tensor  # [T, H] spec.act_dtype
    weights: ExpertWeights  # packing the kernel reads
    routing: RoutingResult  # weights fp32 [T, K], ids int32 [T, K]
    expert_map: torch.Tensor | None  # int32 [E], -1 = another rank


class Kernel(abc.ABC):
    """A way to compute the MoE layer. Subclasses are stateless; one instance lives in the registry."""

    name: str
    priority: int  # higher wins among capable kernels when no tuned row decides
    capabilities: Capabilities
    config_type: type[KernelConfig]

    def supports(self, spec: MoESpec, problem: Problem) -> str | None:
        """None if this kernel computes `spec` for `problem`, else the reason it cannot."""
        reason = self.capabilities.check(spec, problem.device)
        return reason if reason is not None else self.extra_check(spec, problem)

    def extra_check(self, spec: MoESpec, problem: Problem) -> str | None:
        """Kernel-specific limits beyond the capability data (alignment, sizes). Default: none."""
        return None

    @abc.abstractmethod
    def default_config(self, spec: MoESpec, problem: Problem) -> KernelConfig:
        """The config used when no tuned row applies."""

    def tuning_space(self, spec: MoESpec, problem: Problem) -> tuple[KernelConfig, ...]:
        """Configs the autotuner tries for this problem (each must pass `validate_config`).
        Default: the default config alone."""
        return (self.default_config(spec, problem),)

    def validate_config(self, config: KernelConfig, spec: MoESpec) -> str | None:
        """None if `config` is usable for `spec`, else why not (beyond the dataclass's own checks)."""
        if not isinstance(config, self.config_type):
            return (
                f"config is a {type(config).__name__}, kernel {self.name} takes {self.config_type.__name__}"
            )
        return None

    def batch_invariant_config(self, config: KernelConfig, spec: MoESpec) -> KernelConfig | None:
        """`config` restricted so that, run with it at every T, a token's output is bitwise independent
        of the other tokens and of T; None if this kernel cannot promise that. Default: None (a kernel
        built on library GEMMs gets per-expert row counts that vary with the batch, and the library
        picks its algorithm, and so its reduction order, by shape)."""
        return None

    def prepare_weights(self, weights: ExpertWeights, spec: MoESpec) -> ExpertWeights:
        """One-time load-time repacking into a packing this kernel reads. Default: none needed."""
        return weights

    def weights_reason(self, weights: ExpertWeights) -> str | None:
        """None if `run` reads `weights` as they are, else why not (checked before every launch)."""
        if weights.packing not in self.capabilities.packings:
            return (
                f"kernel {self.name} reads packings {sorted(p.name for p in self.capabilities.packings)}, "
                f"weights are {weights.packing.name}"
            )
        return None

    def workspace_bytes(self, spec: MoESpec, num_tokens: int, config: KernelConfig | None = None) -> int:
        """Device memory `run` allocates for `num_tokens` beyond the weights, output excluded (with
        `config`, the planned one, where the kernel's workspace depends on it).

        Default: the fp32 intermediates of T*K (token, expert) pairs an unfused path keeps: h [2I],
        activation [I], y and its unsorted copy [2H], plus the gathered input rows [H] in act dtype."""
        pairs = num_tokens * spec.K
        act = torch.empty((), dtype=spec.act_dtype).element_size()
        return pairs * (2 * spec.I + spec.I + 2 * spec.H) * 4 + pairs * spec.H * act

    def specialization_ints(self, spec: MoESpec, num_tokens: int, config: KernelConfig) -> tuple[int, ...]:
        """The int arguments of `run`'s compiled code that change with the token count under `config`:
        a JIT compiles one variant per class of each (see `warmup_token_counts`). Default: the pair count
        T*K, the size argument of a typical JIT kernel (for a kernel that compiles nothing it only adds a
        few warmup forwards)."""
        return (num_tokens * spec.K,)

    def warmup_token_counts(self, bucket: int, spec: MoESpec, config: KernelConfig) -> tuple[int, ...]:
        """Token counts in `bucket` that reach every compiled variant of `specialization_ints`.

        Triton compiles one variant per (== 1, % 16 == 0, 64-bit) class of each int argument: warming up
        the bucket's largest T alone would leave the other variants to compile inside a later forward (or
        a CUDA-graph capture). T = 0 runs on its own path, so bucket 1 warms it up too."""
        lo, hi = (0, 1) if bucket <= 1 else (bucket // 2 + 1, bucket)
        chosen: dict[tuple, int] = {}
        for t in range(hi, lo - 1, -1):
            classes = tuple(_specialization(n) for n in self.specialization_ints(spec, t, config))
            chosen.setdefault((classes, t == 0), t)
        return tuple(sorted(chosen.values()))

    @abc.abstractmethod
    def run(self, launch: Launch) -> torch.Tensor:
        """Compute the layer; returns `[T, H]` in spec.act_dtype."""
