"""Tuned tables: which kernel and config to use for a (device, Triton version, spec, shape, tokens) key.

Data flow: JSON files (shipped in `moekit/planning/tables/`, then the user's: a path given to `plan`, or the
paths in the env var `MOEKIT_TUNED_TABLE`, separated by the OS path separator) -> `load_tables`
validates every row against the kernel registry -> a `TunedTables` of good rows keyed by `TableKey`
plus the rejected rows, each with its reason -> the planner looks rows up.

Precedence: later sources override earlier ones row by row (same key): shipped < env var < `tuned=`
argument. A bad row is reported once, by name (`file#row N`), and never used; the rest still loads.

Writing is atomic: rows go to a temporary file in the same folder, which is renamed over the table,
under an OS file lock (`filelock`, flock-based: the OS releases it when a process dies, so a crash
cannot leave it behind). Readers therefore see the old table or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import filelock
import torch

from moekit.errors import SpecError, TunedTableError
from moekit.kernels.base import KernelConfig, config_from_dict
from moekit.kernels.registry import KernelRegistry
from moekit.spec import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)

SCHEMA_VERSION = 1
ENV_VAR = "MOEKIT_TUNED_TABLE"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def token_bucket(num_tokens: int) -> int:
    """Tokens round up to a power of two (T=0 and 1 share bucket 1)."""
    return 1 if num_tokens <= 1 else 1 << (num_tokens - 1).bit_length()


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def spec_fields(spec: MoESpec) -> dict:
    """The kernel-relevant fields of a spec as JSON values (routing is not the kernels' business)."""
    act = spec.activation
    return {
        "weight_format": spec.weight_format.value,
        "fp8_scale": spec.fp8_scale.value if spec.fp8_scale else None,
        "act_dtype": str(spec.act_dtype).removeprefix("torch."),
        "act_quant": spec.act_quant.value,
        "activation": act.kind.value,
        "alpha": act.alpha,
        "limit": act.limit,
        "gate_layout": spec.gate_layout.value,
        "has_bias": spec.has_bias,
        "router_weight_placement": spec.router_weight_placement.value,
        "expert_map": spec.uses_expert_map,
    }


def spec_signature(spec: MoESpec) -> str:
    return json.dumps(spec_fields(spec), sort_keys=True)


def _spec_from_row(row: dict) -> MoESpec:
    """A spec with the row's kernel-relevant fields (raises SpecError/KeyError/ValueError when malformed)."""
    f = row["spec"]
    if not isinstance(f, dict):
        raise ValueError(f"'spec' must be an object, got {f!r}")
    e = row["E"]
    return MoESpec(
        num_experts=e,
        top_k=row["K"],
        hidden_size=row["H"],
        intermediate_size=row["I"],
        weight_format=WeightFormat(f["weight_format"]),
        fp8_scale=Fp8Scale(f["fp8_scale"]) if f.get("fp8_scale") else None,
        act_dtype=_DTYPES[f["act_dtype"]],
        act_quant=ActivationQuant(f["act_quant"]),
        activation=ActivationSpec(Activation(f["activation"]), alpha=f.get("alpha"), limit=f.get("limit")),
        gate_layout=GateLayout(f["gate_layout"]),
        has_bias=bool(f["has_bias"]),
        router_weight_placement=RouterWeightPlacement(f["router_weight_placement"]),
        num_local_experts=e if f.get("expert_map") else None,
    )


@dataclass(frozen=True)
class TableKey:
    device: str
    triton: str
    spec: str  # spec_signature
    E: int  # noqa: N815
    K: int  # noqa: N815
    H: int  # noqa: N815
    I: int  # noqa: N815, E741
    bucket: int

    @classmethod
    def for_spec(cls, spec: MoESpec, *, device: str, triton: str, bucket: int) -> TableKey:
        return cls(device, triton, spec_signature(spec), spec.E, spec.K, spec.H, spec.I, bucket)

    def without_bucket(self) -> tuple:
        return (self.device, self.triton, self.spec, self.E, self.K, self.H, self.I)


@dataclass(frozen=True)
class TunedRow:
    key: TableKey
    kernel: str
    config: KernelConfig
    origin: str  # "path#row N"


@dataclass(frozen=True)
class RejectedRow:
    origin: str  # "path#row N", or the path for a file-level problem
    reason: str
    key: TableKey | None = None


@dataclass(frozen=True)
class TunedTables:
    rows: dict[TableKey, TunedRow] = field(default_factory=dict)
    rejected: tuple[RejectedRow, ...] = ()
    sources: tuple[str, ...] = ()

    def lookup(self, key: TableKey) -> tuple[TunedRow | None, bool]:
        """The row for `key`, else the row of the nearest bucket (log2 distance, ties to the smaller).

        Returns (row, exact)."""
        if key in self.rows:
            return self.rows[key], True
        same = [r for k, r in self.rows.items() if k.without_bucket() == key.without_bucket()]
        if not same:
            return None, False
        target = math.log2(key.bucket)
        best = min(same, key=lambda r: (abs(math.log2(r.key.bucket) - target), r.key.bucket))
        return best, False

    def rejected_for(self, key: TableKey) -> tuple[RejectedRow, ...]:
        """Rejections that concern this key (same spec/shape/device), plus file-level problems."""
        return tuple(
            r for r in self.rejected if r.key is None or r.key.without_bucket() == key.without_bucket()
        )


def _parse_row(raw: object, *, origin: str, registry: KernelRegistry) -> TunedRow:
    if not isinstance(raw, dict):
        raise TunedTableError(f"a row must be an object, got {type(raw).__name__}")
    missing = [
        n
        for n in ("device", "triton", "spec", "E", "K", "H", "I", "tokens", "kernel", "config")
        if n not in raw
    ]
    if missing:
        raise TunedTableError(f"missing fields {missing}")
    try:
        spec = _spec_from_row(raw)
        tokens = raw["tokens"]
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    except (SpecError, KeyError, ValueError, TypeError) as err:
        raise TunedTableError(f"bad spec or shape: {err}") from err
    key = TableKey.for_spec(
        spec, device=str(raw["device"]), triton=str(raw["triton"]), bucket=token_bucket(tokens)
    )
    kernel = registry.get(raw["kernel"])
    if kernel is None:
        raise _KeyedError(key, f"unknown kernel {raw['kernel']!r}; registered: {list(registry.names)}")
    try:
        config = config_from_dict(kernel.config_type, raw["config"], kernel=kernel.name)
    except TunedTableError as err:
        raise _KeyedError(key, str(err)) from err
    reason = kernel.validate_config(config, spec) or kernel.capabilities.check(spec)
    if reason:
        raise _KeyedError(key, f"kernel {kernel.name!r} cannot serve this row: {reason}")
    return TunedRow(key=key, kernel=kernel.name, config=config, origin=origin)


class _KeyedError(TunedTableError):
    def __init__(self, key: TableKey, message: str) -> None:
        super().__init__(message)
        self.key = key


def _read_file(path: Path, registry: KernelRegistry) -> tuple[list[TunedRow], list[RejectedRow]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return [], [RejectedRow(str(path), f"unreadable table: {err}")]
    if (
        not isinstance(data, dict)
        or data.get("schema_version") != SCHEMA_VERSION
        or not isinstance(data.get("rows"), list)
    ):
        got = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
        return [], [
            RejectedRow(
                str(path),
                f"not a moekit tuned table of schema_version {SCHEMA_VERSION} "
                f"with a 'rows' list (got schema_version={got!r})",
            )
        ]
    good: list[TunedRow] = []
    bad: list[RejectedRow] = []
    for index, raw in enumerate(data["rows"]):
        origin = f"{path}#row {index}"
        try:
            good.append(_parse_row(raw, origin=origin, registry=registry))
        except TunedTableError as err:
            bad.append(RejectedRow(origin, str(err), getattr(err, "key", None)))
    counts: dict[TableKey, int] = {}
    for row in good:
        counts[row.key] = counts.get(row.key, 0) + 1
    duplicated = {k for k, n in counts.items() if n > 1}
    for row in good:
        if row.key in duplicated:
            bad.append(
                RejectedRow(
                    row.origin, "duplicate key in this file (ambiguous; none of them is used)", row.key
                )
            )
    return [r for r in good if r.key not in duplicated], bad


def shipped_table_paths() -> list[Path]:
    folder = resources.files("moekit.planning") / "tables"
    return (
        sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")) if folder.is_dir() else []
    )


def env_table_paths() -> list[Path]:
    value = os.environ.get(ENV_VAR, "")
    return [Path(p) for p in value.split(os.pathsep) if p]


def load_tables(paths: list[Path], *, registry: KernelRegistry) -> TunedTables:
    """Load and validate `paths` in order; later files override earlier ones key by key."""
    rows: dict[TableKey, TunedRow] = {}
    rejected: list[RejectedRow] = []
    for path in paths:
        good, bad = _read_file(Path(path), registry)
        rejected.extend(bad)
        rows.update({r.key: r for r in good})
    return TunedTables(rows=rows, rejected=tuple(rejected), sources=tuple(str(p) for p in paths))


def row_to_json(
    *, spec: MoESpec, device: str, triton: str, tokens: int, kernel: str, config: KernelConfig
) -> dict:
    return {
        "device": device,
        "triton": triton,
        "spec": spec_fields(spec),
        "E": spec.E,
        "K": spec.K,
        "H": spec.H,
        "I": spec.I,
        "tokens": tokens,
        "kernel": kernel,
        "config": config.as_dict(),
    }


def write_rows(path: Path, new_rows: list[dict], *, lock_timeout_s: float = 60.0) -> None:
    """Merge `new_rows` into the table at `path` (same device/spec/shape/tokens replaced), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock", timeout=lock_timeout_s):
        rows: list[dict] = []
        if path.exists():
            try:
                rows = json.loads(path.read_text())["rows"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise TunedTableError(f"cannot merge into {path}: it is not a valid table ({err})") from err

        def ident(r: dict) -> str:
            return json.dumps(
                {k: r.get(k) for k in ("device", "triton", "spec", "E", "K", "H", "I", "tokens")},
                sort_keys=True,
            )

        replaced = {ident(r) for r in new_rows}
        merged = [r for r in rows if ident(r) not in replaced] + list(new_rows)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump({"schema_version": SCHEMA_VERSION, "rows": merged}, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
