"""Command-line plumbing shared by subcommands: spec flags, device and token flags, JSON views of plans.

Data flow: argparse namespace -> preset spec with flag overrides -> `MoESpec` (validated as usual);
--device -> a device that exists here (or a simulated one, for explain); --tokens -> counts in range.
A flag value out of range is a `UsageError` naming the flag, the value and the fix.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from moekit.app.cli_errors import UsageError
from moekit.errors import DeviceError
from moekit.kernels.base import DeviceInfo, DeviceKind
from moekit.planning.plan import Plan
from moekit.presets import preset
from moekit.spec import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    RouterWeightPlacement,
    WeightFormat,
)

SIMULATED_DEVICES = {
    "h200": DeviceInfo(DeviceKind.CUDA, "NVIDIA H200", (9, 0), 132),
    "h100": DeviceInfo(DeviceKind.CUDA, "NVIDIA H100 80GB HBM3", (9, 0), 132),
    "a100": DeviceInfo(DeviceKind.CUDA, "NVIDIA A100-SXM4-80GB", (8, 0), 108),
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _choices(enum_type) -> list[str]:
    return [m.value for m in enum_type]


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("spec overrides (each replaces the preset's field)")
    g.add_argument("--experts", type=int, help="E, global expert count")
    g.add_argument("--top-k", type=int, help="K, experts per token")
    g.add_argument("--hidden", type=int, help="H, hidden size")
    g.add_argument("--intermediate", type=int, help="I, intermediate size per expert")
    g.add_argument("--weight-format", choices=_choices(WeightFormat))
    g.add_argument("--fp8-scale", choices=_choices(Fp8Scale))
    g.add_argument("--act-dtype", choices=sorted(_DTYPES))
    g.add_argument("--act-quant", choices=_choices(ActivationQuant))
    g.add_argument("--activation", choices=_choices(Activation))
    g.add_argument("--alpha", type=float, help="SWIGLU_OAI alpha")
    g.add_argument("--limit", type=float, help="clamp limit L")
    g.add_argument("--no-limit", action="store_true", help="drop the preset's clamp limit")
    g.add_argument("--layout", choices=_choices(GateLayout), help="gate/up layout of w13")
    g.add_argument("--bias", choices=["yes", "no"], help="b13 and b2 present")
    g.add_argument("--router-on", choices=_choices(RouterWeightPlacement), help="router weight placement")


def spec_from_flags(args: argparse.Namespace):
    if args.limit is not None and args.no_limit:
        raise UsageError(f"--limit {args.limit:g} and --no-limit contradict each other; give one")
    if getattr(args, "config", None) is not None:
        from moekit.checkpoint.hf_config import spec_from_config_file

        spec = spec_from_config_file(args.config)
    else:
        spec = preset(args.preset)
    fields: dict = {}
    for flag, name in (
        ("experts", "num_experts"),
        ("top_k", "top_k"),
        ("hidden", "hidden_size"),
        ("intermediate", "intermediate_size"),
    ):
        if getattr(args, flag) is not None:
            fields[name] = getattr(args, flag)
    if args.weight_format:
        fields["weight_format"] = WeightFormat(args.weight_format)
        if fields["weight_format"] is not WeightFormat.FP8_E4M3:
            fields["fp8_scale"] = None
            fields["act_quant"] = ActivationQuant.NONE
    if args.fp8_scale:
        fields["fp8_scale"] = Fp8Scale(args.fp8_scale)
    if args.act_dtype:
        fields["act_dtype"] = _DTYPES[args.act_dtype]
    if args.act_quant:
        fields["act_quant"] = ActivationQuant(args.act_quant)
    if args.layout:
        fields["gate_layout"] = GateLayout(args.layout)
    if args.bias:
        fields["has_bias"] = args.bias == "yes"
    if args.router_on:
        fields["router_weight_placement"] = RouterWeightPlacement(args.router_on)
    act = spec.activation
    if args.activation or args.alpha is not None or args.limit is not None or args.no_limit:
        kind = Activation(args.activation) if args.activation else act.kind
        alpha = (
            args.alpha if args.alpha is not None else (act.alpha if kind is Activation.SWIGLU_OAI else None)
        )
        if kind is Activation.SWIGLU_OAI and alpha is None:
            alpha = 1.702
        limit = None if args.no_limit else args.limit if args.limit is not None else act.limit
        fields["activation"] = ActivationSpec(kind, alpha=alpha, limit=limit)
    return replace(spec, **fields) if fields else spec


def resolve_device(name: str | None) -> DeviceInfo:
    """--device of `moekit explain`: a device here, or a simulated GPU to plan for."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.lower() in SIMULATED_DEVICES:
        return SIMULATED_DEVICES[name.lower()]
    simulated = f"--device {{{','.join(SIMULATED_DEVICES)}}}"
    if (
        _parsed(name, also=f", or a simulated GPU: {simulated}").type == "cuda"
        and not torch.cuda.is_available()
    ):
        raise DeviceError(
            f"--device {name}: no CUDA device here; plan for a simulated GPU with {simulated}, or use cpu"
        )
    return _device_info(name)


def real_device(name: str | None) -> torch.device:
    """--device of a command that runs kernels: a device that exists here (default: cuda if present)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.lower() in SIMULATED_DEVICES:
        raise UsageError(
            f"--device {name} is a simulated GPU, which only `moekit explain` can plan for; "
            "this command runs kernels: use --device cpu or cuda",
            kind="DeviceError",
        )
    device = _parsed(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {name}: no CUDA device here (torch sees none); use --device cpu")
    _device_info(name)
    return device


def _parsed(name: str, also: str = "") -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise DeviceError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N{also}") from err


def _device_info(name: str) -> DeviceInfo:
    try:
        return DeviceInfo.of(name)
    except DeviceError as err:
        raise DeviceError(f"--device {name}: {err}") from err


def at_least(flag: str, value: int, minimum: int, why: str = "") -> int:
    """`value` of `flag` if it is >= `minimum`, else a `UsageError` that says why the bound exists."""
    if value < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {value}" + (f": {why}" if why else ""))
    return value


def token_counts(text: str, *, minimum: int) -> tuple[int, ...]:
    """--tokens as comma-separated counts, each >= `minimum`."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < minimum:
        raise UsageError(f"--tokens must be comma-separated counts >= {minimum}, got {text!r}")
    return values


def plan_as_dict(p: Plan) -> dict:
    return {
        "spec": p.spec.describe(),
        "num_tokens": p.num_tokens,
        "bucket": p.bucket,
        "device": p.device.describe(),
        "kernel": p.kernel,
        "config": p.config.as_dict(),
        "source": p.source.name,
        "row_origin": p.row_origin,
        "refused": [{"kernel": r.kernel, "reason": r.reason} for r in p.refused],
        "rejected_rows": [{"origin": r.origin, "reason": r.reason} for r in p.rejected_rows],
        "tables": list(p.table_sources),
    }
