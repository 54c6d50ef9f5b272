"""`PlanOptions`: how a layer plans, the arguments of `moekit.plan` other than the spec, tokens and device.

Data flow: a user's options -> validated here when built -> `FusedMoE` passes them to `plan` (or
`plan_batch_invariant`) for every token bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moekit.errors import SpecError
from moekit.kernels.registry import KernelRegistry
from moekit.planning.tuned import TunedTables


@dataclass(frozen=True)
class PlanOptions:
    """How a layer plans: the arguments of `moekit.plan` other than the spec, tokens and device."""

    tuned: TunedTables | str | Path | None = None  # extra tuned table (path) or already-loaded tables
    strict: bool = False  # any fallback (missing, nearest or rejected tuned row) raises PlanFallbackError
    registry: KernelRegistry | None = None  # None: moekit's default registry
    allow_reference: bool = True  # False: never run the (slow) reference kernel
    # True: a token's output is bitwise independent of the other tokens and of T: one kernel, config and
    # reduction order for every bucket (`planning.plan.plan_batch_invariant`), the router's logits in
    # fixed-shape matmuls (`compute_router_logits`), per-token routing and top-k sum. Costs speed away
    # from the T the config was chosen at (benchmarks/bench_moe.py --batch-invariant measures it).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("strict", "allow_reference", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(
                    f"PlanOptions.{name} must be a bool, got {getattr(self, name)!r}; pass True or False"
                )
        if self.registry is not None and not isinstance(self.registry, KernelRegistry):
            raise SpecError(f"registry must be a KernelRegistry or None, got {type(self.registry).__name__}")
        if self.tuned is not None and not isinstance(self.tuned, TunedTables | str | Path):
            raise SpecError(f"tuned must be TunedTables, a path or None, got {type(self.tuned).__name__}")
