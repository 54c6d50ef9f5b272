"""Small parts of `FusedMoE` (`moekit.layer`): its warmup report, how it reads a device, and its switches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import ArgumentError, check_bool
from moekit.kernels.base import parse_device
from moekit.planning.plan import Plan


@dataclass(frozen=True)
class WarmupReport:
    """What `FusedMoE.warmup` prepared: one plan per bucket, and the token counts it ran."""

    plans: tuple[Plan, ...]  # bucket order
    token_counts: tuple[int, ...]  # forwards run (empty when execute=False)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(p.bucket for p in self.plans)


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` parsed as `moekit.plan` parses it (a malformed one is a DeviceError); cuda -> cuda:<current>
    where CUDA exists, so comparisons with tensors' devices (always indexed) work."""
    device = parse_device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


# A layer switch takes only a bool: "no" would read as True, and 0 hides a typo.
def bool_setting(name: str, default: bool) -> property:
    def setter(layer: torch.nn.Module, value: bool) -> None:
        check_bool(f"FusedMoE.{name}", value, error=ArgumentError)
        layer.__dict__[f"_{name}"] = value

    return property(lambda layer: layer.__dict__.get(f"_{name}", default), setter)
