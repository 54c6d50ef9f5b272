"""The planner: choose a capable kernel and its config, once, when a layer is built.

Data flow: (spec, num_tokens, device) -> every registered kernel's `supports` (refusals recorded with
their reasons) -> the tuned row for (device, Triton version, spec signature, E, K, H, I, token bucket),
else the nearest bucket's row if the kernel's own rule tiles both T alike (same regime) -> the row is
used only if its kernel is among the capable ones (else it is recorded as rejected) -> otherwise the
highest-priority capable kernel with its default config -> a frozen `Plan` that says what was chosen,
from where, and what was refused.

The invariant: whatever the tables say, the chosen kernel is one that `supports` the spec. A table is
advice about speed; a wrong or stale row can make a layer slower, never make it run an incapable kernel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moekit.errors import (
    ArgumentError,
    PlanFallbackError,
    ShapeError,
    SpecError,
    TunedTableError,
    UnsupportedSpecError,
    check_bool,
    check_int,
    check_type,
)
from moekit.kernels.base import DeviceInfo, Kernel, KernelConfig, Problem
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.planning.tuned import (
    RejectedRow,
    TableKey,
    TunedTables,
    env_table_paths,
    load_tables,
    shipped_table_paths,
    token_bucket,
    triton_version,
)
from moekit.spec import ActivationQuant, GateLayout, MoESpec


class ConfigSource(enum.Enum):
    TUNED_ROW = "tuned row"
    NEAREST_BUCKET = "tuned row of the nearest token bucket"
    # An expert-parallel rank's layer (an expert map) with no row of its own: the whole layer's row for
    # the same E, K, H, I and bucket. Each local expert then sees the load it sees in the whole layer at
    # that token count; only the count of experts with work (E_local of E) differs.
    WHOLE_LAYER_ROW = "tuned row of the whole layer (this rank holds E_local of its experts)"
    DEFAULT = "kernel default (no usable tuned row)"
    # The nearest bucket's row was tuned where the kernel's own rule tiles differently (another count of
    # tokens per expert: decode vs prefill tiles); a row speaks only for its regime.
    REGIME_DEFAULT = "kernel default for this T's regime (the nearest tuned bucket is in another)"


@dataclass(frozen=True)
class Refusal:
    kernel: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """What runs for one (spec, token bucket, device), and why."""

    spec: MoESpec
    num_tokens: int
    bucket: int
    device: DeviceInfo
    kernel: str
    config: KernelConfig
    source: ConfigSource
    row_origin: str | None  # "file#row N" when a tuned row supplied the config
    refused: tuple[Refusal, ...]  # kernels that cannot compute the spec here, with reasons
    rejected_rows: tuple[RejectedRow, ...]  # bad or incapable rows relevant to this plan
    table_sources: tuple[str, ...]  # tables consulted, lowest precedence first
    # Batch-invariant plans (`plan_batch_invariant`): the T every bucket's kernel and config were chosen
    # at, so that all buckets share them; None for a plan of this bucket alone.
    invariant_tokens: int | None = None

    @property
    def batch_invariant(self) -> bool:
        return self.invariant_tokens is not None

    def explain(self) -> str:
        lines = [
            f"spec:    {self.spec.describe()}",
            f"problem: T={self.num_tokens} (bucket {self.bucket}) on {self.device.describe()}, "
            f"triton {triton_version()}",
            f"chosen:  {self.kernel}  config {self.config.as_dict()}",
            f"source:  {self.source.value}" + (f" [{self.row_origin}]" if self.row_origin else ""),
        ]
        if self.batch_invariant:
            lines.append(
                f"batch-invariant: yes: this kernel and config serve every T (chosen at "
                f"T={self.invariant_tokens}), no split-K, no tail blocks: a token's output is bitwise "
                "independent of the other tokens and of T"
            )
        lines.append("refused candidates:" if self.refused else "refused candidates: none")
        lines += [f"  - {r.kernel}: {r.reason}" for r in self.refused]
        if self.rejected_rows:
            lines.append("rejected tuned rows (never used):")
            lines += [f"  - {r.origin}: {r.reason}" for r in self.rejected_rows]
        sources = ", ".join(self.table_sources) if self.table_sources else "none"
        lines.append(f"tables (lowest precedence first): {sources}")
        return "\n".join(lines)


def resolve_tables(tuned: TunedTables | str | Path | None, registry: KernelRegistry) -> TunedTables:
    """Shipped tables, then the env var's, then `tuned` (a path, or already-loaded tables)."""
    if isinstance(tuned, TunedTables):
        return tuned
    paths = shipped_table_paths() + env_table_paths()
    if tuned is not None:
        paths.append(Path(tuned))
    return load_tables(paths, registry=registry)


def plan(
    spec: MoESpec,
    *,
    num_tokens: int,
    device: torch.device | str | DeviceInfo,
    tuned: TunedTables | str | Path | None = None,
    strict: bool = False,
    registry: KernelRegistry | None = None,
    allow_reference: bool = True,
) -> Plan:
    """Resolve the kernel and config for `spec` at `num_tokens` on `device`. See the module docstring."""
    _check_plan_arguments(spec, num_tokens, tuned, strict, registry, allow_reference)
    registry = registry or default_registry()
    if not allow_reference:
        registry = registry.without("reference")
    info = device if isinstance(device, DeviceInfo) else DeviceInfo.of(device)
    problem = Problem(num_tokens=num_tokens, device=info)
    capable: list[Kernel] = []
    refused: list[Refusal] = []
    for kernel in registry:
        reason = kernel.supports(spec, problem)
        if reason is None:
            capable.append(kernel)
        else:
            refused.append(Refusal(kernel.name, reason))
    if not capable:
        raise UnsupportedSpecError(_unsupported_message(spec, problem, refused, registry))

    tables = resolve_tables(tuned, registry)
    bucket = token_bucket(num_tokens)
    key = TableKey.for_spec(spec, device=info.name, triton=triton_version(), bucket=bucket)
    rejected = list(tables.rejected_for(key))
    row, exact = tables.lookup(key)
    whole_layer = False
    if row is None and spec.uses_expert_map:
        whole = TableKey.for_spec(
            replace(spec, num_local_experts=None), device=info.name, triton=triton_version(), bucket=bucket
        )
        row, exact = tables.lookup(whole)
        whole_layer = row is not None
    chosen: Kernel = capable[0]
    config = chosen.default_config(spec, problem)
    source, origin = ConfigSource.DEFAULT, None
    if row is not None:
        by_name = {k.name: k for k in capable}
        row_kernel = by_name.get(row.kernel)
        if row_kernel is None:
            why = next((r.reason for r in refused if r.kernel == row.kernel), "not registered")
            rejected.append(RejectedRow(row.origin, f"kernel {row.kernel!r} cannot run here: {why}", row.key))
        elif (reason := row_kernel.validate_config(row.config, spec)) is not None:
            rejected.append(RejectedRow(row.origin, f"config invalid for this spec: {reason}", row.key))
        elif not exact and _other_regime(row_kernel, spec, problem, row.key.bucket):
            # As without a row (the first capable kernel's default); the explanation names the row.
            source, origin = ConfigSource.REGIME_DEFAULT, row.origin
        else:
            chosen, config, origin = row_kernel, row.config, row.origin
            source = ConfigSource.TUNED_ROW if exact else ConfigSource.NEAREST_BUCKET
            if whole_layer:
                source = ConfigSource.WHOLE_LAYER_ROW
    result = Plan(
        spec=spec,
        num_tokens=num_tokens,
        bucket=bucket,
        device=info,
        kernel=chosen.name,
        config=config,
        source=source,
        row_origin=origin,
        refused=tuple(refused),
        rejected_rows=tuple(rejected),
        table_sources=tables.sources,
    )
    if strict and (source is not ConfigSource.TUNED_ROW or rejected):
        what = "rejected tuned rows" if source is ConfigSource.TUNED_ROW else source.value
        raise PlanFallbackError(f"strict planning refused a fallback ({what}):\n{result.explain()}")
    return result


def _other_regime(kernel: Kernel, spec: MoESpec, problem: Problem, row_bucket: int) -> bool:
    """Whether `kernel`'s own rule tiles `problem` differently from the T the row was tuned at: then the
    row (the best config of another regime, e.g. decode tiles at 16 tokens an expert applied at 32) is
    no guide, and the rule's config for this T is used instead."""
    at_row = Problem(num_tokens=row_bucket, device=problem.device)
    return kernel.default_config(spec, at_row) != kernel.default_config(spec, problem)


# Tokens per expert that the one batch-invariant config is chosen at: the default tiles' middle regime
# (64-row M tiles for every format). Decode pads its few rows to 64 but is bound by weight bytes, not by
# MMA rows; prefill re-reads each weight tile twice as often as with 128-row tiles. Neither end is far
# from its own best, where a decode tile (16 rows) would cost prefill several times over.
BATCH_INVARIANT_TOKENS_PER_EXPERT = 32


def batch_invariant_tokens(spec: MoESpec) -> int:
    """The T whose bucket's plan a batch-invariant layer uses for every T."""
    return token_bucket(-(-BATCH_INVARIANT_TOKENS_PER_EXPERT * spec.E_local // spec.K))


def plan_batch_invariant(
    spec: MoESpec,
    *,
    num_tokens: int,
    device: torch.device | str | DeviceInfo,
    tuned: TunedTables | str | Path | None = None,
    strict: bool = False,
    registry: KernelRegistry | None = None,
    allow_reference: bool = True,
) -> Plan:
    """A plan whose kernel and config are the same for every `num_tokens`: those `plan` chooses at
    `batch_invariant_tokens(spec)` (a tuned row of that bucket, else the kernel's default there: a
    nearest-bucket row was tuned for another T), restricted by the kernel's `batch_invariant_config`
    (a row's reduction order fixed). When that kernel cannot promise batch invariance, the highest-priority
    capable kernel that can, with its default config there; none: `UnsupportedSpecError`."""
    registry = registry or default_registry()
    if not allow_reference:
        registry = registry.without("reference")
    anchor = batch_invariant_tokens(spec)
    base = plan(
        spec,
        num_tokens=anchor,
        device=device,
        tuned=tuned,
        strict=strict,
        registry=registry,
        allow_reference=allow_reference,
    )
    problem = Problem(num_tokens=anchor, device=base.device)
    chosen = registry.get(base.kernel)
    source, origin, config = base.source, base.row_origin, base.config
    if source in (ConfigSource.NEAREST_BUCKET, ConfigSource.REGIME_DEFAULT):
        # No row of the anchor's own bucket (a nearest-bucket row was tuned for another T): its default.
        source, origin, config = ConfigSource.DEFAULT, None, chosen.default_config(spec, problem)
    config = chosen.batch_invariant_config(config, spec)
    if config is None:
        refused = {r.kernel for r in base.refused}
        for kernel in registry:
            if kernel.name in refused:
                continue
            config = kernel.batch_invariant_config(kernel.default_config(spec, problem), spec)
            if config is not None:
                chosen, source, origin = kernel, ConfigSource.DEFAULT, None
                break
        else:
            cannot = ", ".join(k.name for k in registry if k.name not in refused)
            raise UnsupportedSpecError(
                f"batch_invariant=True: no kernel that computes {spec.describe()} on "
                f"{base.device.describe()} can make a token's output independent of the batch "
                f"({cannot} choose their GEMM algorithm by the rows each expert gets); run on a device "
                "where triton_fused supports the spec, or plan without batch_invariant"
            )
    if (reason := chosen.validate_config(config, spec)) is not None:
        raise UnsupportedSpecError(
            f"batch_invariant=True: {chosen.name}'s config {config.as_dict()} is unusable: {reason}"
        )
    return replace(
        base,
        num_tokens=num_tokens,
        bucket=token_bucket(num_tokens),
        kernel=chosen.name,
        config=config,
        source=source,
        row_origin=origin,
        invariant_tokens=anchor,
    )


def _check_plan_arguments(
    spec: object, num_tokens: object, tuned: object, strict: object, registry: object, allow_reference: object
) -> None:
    """Each of `plan`'s arguments has its type (and `num_tokens` its range) before anything reads it;
    `device` is checked where it is resolved (`DeviceInfo.of`)."""
    check_type(
        "plan(spec=...)", spec, MoESpec, fix="build a MoESpec (or moekit.preset(name))", error=SpecError
    )
    check_int("plan(num_tokens=...)", num_tokens, minimum=0, error=ShapeError)
    check_type(
        "plan(tuned=...)",
        tuned,
        (TunedTables, str, Path),
        optional=True,
        fix="pass a table path or moekit's loaded TunedTables",
        error=TunedTableError,
    )
    check_bool("plan(strict=...)", strict, error=ArgumentError)
    check_bool("plan(allow_reference=...)", allow_reference, error=ArgumentError)
    check_type("plan(registry=...)", registry, KernelRegistry, optional=True, fix="pass a KernelRegistry")


# Spec changes a user can make at load time, tried in order to suggest the nearest supported spec.
def _alternatives(spec: MoESpec) -> list[tuple[str, MoESpec]]:
    options: list[tuple[str, MoESpec]] = []
    other = GateLayout.CONCAT if spec.gate_layout is GateLayout.INTERLEAVED else GateLayout.INTERLEAVED
    options.append(
        (
            f"convert w13 to {other.name} layout (weights.to_layout(GateLayout.{other.name}))",
            replace(spec, gate_layout=other),
        )
    )
    if spec.act_quant is not ActivationQuant.NONE:
        options.append(
            (
                "run FP8 weights with unquantized activations (act_quant=NONE)",
                replace(spec, act_quant=ActivationQuant.NONE),
            )
        )
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dtype != spec.act_dtype:
            options.append((f"use act_dtype={dtype}", replace(spec, act_dtype=dtype)))
    return options


def _unsupported_message(
    spec: MoESpec, problem: Problem, refused: list[Refusal], registry: KernelRegistry
) -> str:
    lines = [
        f"no registered kernel can compute this spec on {problem.device.describe()}:",
        f"  spec: {spec.describe()}",
    ]
    lines += [f"  - {r.kernel}: {r.reason}" for r in refused]
    for advice, alternative in _alternatives(spec):
        takers = [k.name for k in registry if k.supports(alternative, problem) is None]
        if takers:
            lines.append(f"nearest supported alternative: {advice}: kernel {takers[0]} supports it")
            break
    else:
        if "reference" not in registry:
            lines.append("nearest supported alternative: allow the reference kernel (allow_reference=True)")
        else:
            lines.append("no single load-time change makes it supported; see the reasons above")
    return "\n".join(lines)
