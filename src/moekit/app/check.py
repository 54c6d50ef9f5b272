"""`moekit check`: numerics of every capable kernel on this device against the reference, per preset.

Data flow: preset(s) -> (E capped where asked, so a CPU can hold the weights) -> random layer on the
device -> for each registered kernel that `supports` the spec here and each T: prepare weights, poison
the allocator's next blocks with NaN, run `fused_moe`, relative L2 error against the fp32
reference -> `CheckRecord`s.
Kernels that refuse the spec are listed with their reason, not silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.ops import fused_moe, prepare_weights
from moekit.planning.plan import plan
from moekit.presets import cap_experts, preset
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
from moekit.synthetic import random_batch, random_layer


@dataclass(frozen=True)
class CheckRecord:
    preset: str
    spec: str
    kernel: str
    tokens: int
    rel_l2: float | None  # None when the kernel refused the spec
    tolerance: float
    refused: str | None = None

    @property
    def passed(self) -> bool:
        return self.refused is not None or (self.rel_l2 is not None and self.rel_l2 <= self.tolerance)


def check_preset(
    name: str,
    *,
    tokens: tuple[int, ...],
    device: torch.device,
    max_experts: int | None = None,
    progress=None,
) -> list[CheckRecord]:
    spec = cap_experts(preset(name), max_experts)
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    records: list[CheckRecord] = []
    allowed = tolerance(spec)
    for kernel in default_registry():
        reason = kernel.supports(spec, Problem(num_tokens=max(tokens), device=info))
        if reason is not None:
            records.append(CheckRecord(name, spec.describe(), kernel.name, 0, None, allowed, refused=reason))
            if progress:
                progress(len(tokens))
            continue
        base = plan(spec, num_tokens=max(tokens), device=info)
        chosen = replace(
            base, kernel=kernel.name, config=kernel.default_config(spec, Problem(max(tokens), info))
        )
        weights = prepare_weights(layer.weights, chosen)
        for t in tokens:
            x, _, routing = random_batch(
                spec, t, correction_bias=layer.correction_bias, seed=t, device=device
            )
            expected = fused_moe_reference(x, layer.weights, routing, spec=spec)
            per_t = replace(chosen, num_tokens=t, config=kernel.default_config(spec, Problem(t, info)))
            poison_allocator(device, num_bytes=4 * t * spec.K * (2 * spec.I + spec.H) + (1 << 20))
            out = fused_moe(x, weights, routing, plan=per_t)
            records.append(
                CheckRecord(name, spec.describe(), kernel.name, t, relative_l2_error(out, expected), allowed)
            )
            if progress:
                progress(1)
        del weights
    return records


def poison_allocator(device: torch.device, *, num_bytes: int) -> None:
    """Fill memory the CUDA caching allocator will hand out next with NaN, so a kernel's output or
    workspace that is read before it is written shows as NaN rather than as stale, plausible data."""
    if device.type != "cuda":
        return  # CPU allocations come from the OS; the reference comparison still sees unwritten garbage
    block = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    block.fill_(float("nan"))
    del block
