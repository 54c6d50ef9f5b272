"""Tuned tables: which kernel and config to use for a (device, Triton version, spec, shape, tokens) key.

Data flow: JSON files (shipped in `moekit/planning/tables/`, then the user's: a path given to `plan`, or the
paths in the env var `MOEKIT_TUNED_TABLE`, separated by the OS path separator) -> `load_tables`
validates the file (`_read_table`) and every row (`parse_row`: JSON types, spec, kernel, config)
against the kernel registry -> a `TunedTables` of good rows keyed by `TableKey`
plus the rejected rows, each with its reason -> the planner looks rows up.

Precedence: later sources override earlier ones row by row (same key): shipped < env var < `tuned=`
argument. A bad row is reported once, by name (`file#row N`), and never used; the rest still loads.
A bad file (unreadable, nested too deeply, another schema_version, unknown top-level keys) is reported
by its path, and the other tables still load.

`write_rows` applies the same two checks: it refuses (TunedTableError) a new row that the loader would
reject, and a file that the loader would not read, leaving that file untouched rather than converting
it and losing what it held.

Writing is atomic: rows go to a temporary file in the same folder, which is renamed over the table,
under an OS file lock (`filelock`, flock-based: the OS releases it when a process dies, so a crash
cannot leave it behind). Readers therefore see the old table or the new one, never half of one.
"""

from __future__ import annotations

import enum
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
from moekit.kernels.registry import KernelRegistry, default_registry
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
        # floats, so that alpha=2 and alpha=2.0 are one key
        "alpha": None if act.alpha is None else float(act.alpha),
        "limit": None if act.limit is None else float(act.limit),
        "gate_layout": spec.gate_layout.value,
        "has_bias": spec.has_bias,
        "router_weight_placement": spec.router_weight_placement.value,
        "expert_map": spec.uses_expert_map,
    }


def spec_signature(spec: MoESpec) -> str:
    return json.dumps(spec_fields(spec), sort_keys=True)


ROW_FIELDS = ("device", "triton", "spec", "E", "K", "H", "I", "tokens", "kernel", "config")
# Spec fields a row may leave out (older tables): their value when absent.
_SPEC_OPTIONAL = {"fp8_scale": None, "alpha": None, "limit": None, "expert_map": False}
_SPEC_ENUMS = {
    "weight_format": WeightFormat,
    "fp8_scale": Fp8Scale,
    "act_quant": ActivationQuant,
    "activation": Activation,
    "gate_layout": GateLayout,
    "router_weight_placement": RouterWeightPlacement,
}


def _short(value: object) -> str:
    """A bounded repr for messages: a row may hold an arbitrarily large JSON value."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_error(name: str, want: str, value: object) -> TunedTableError:
    return TunedTableError(f"{name} must be {want}, got {_short(value)} ({type(value).__name__})")


def _int(obj: dict, name: str, *, where: str = "") -> int:
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool):  # JSON true is not a count
        raise _field_error(where + name, "an int", value)
    return value


def _str(obj: dict, name: str) -> str:
    value = obj[name]
    if not isinstance(value, str) or not value:
        raise _field_error(name, "a non-empty string", value)
    return value


def _enum(f: dict, name: str, enum_type: type[enum.Enum]) -> enum.Enum:
    value = f[name]
    allowed = sorted(m.value for m in enum_type)
    if not isinstance(value, str) or value not in allowed:
        raise _field_error(f"spec.{name}", f"one of {allowed}", value)
    return enum_type(value)


def _number(f: dict, name: str) -> float | None:
    value = f[name]
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _field_error(f"spec.{name}", "null or a finite number", value)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise _field_error(f"spec.{name}", "null or a finite number", value)
    return number


def _spec_from_row(row: dict) -> MoESpec:
    """The spec of a row's kernel-relevant fields; every JSON type checked (raises TunedTableError,
    or SpecError for values of the right type that no spec may have)."""
    f = row["spec"]
    if not isinstance(f, dict):
        raise _field_error("spec", "an object", f)
    known = {*_SPEC_ENUMS, "act_dtype", "has_bias", "alpha", "limit", "expert_map"}
    unknown = sorted(set(f) - known)
    missing = sorted(known - set(f) - set(_SPEC_OPTIONAL))
    if unknown or missing:
        raise TunedTableError(
            f"spec has unknown fields {unknown} / lacks fields {missing}; known: {sorted(known)}"
        )
    f = {**_SPEC_OPTIONAL, **f}
    for name in ("has_bias", "expert_map"):
        if not isinstance(f[name], bool):
            raise _field_error(f"spec.{name}", "true or false", f[name])
    if not isinstance(f["act_dtype"], str) or f["act_dtype"] not in _DTYPES:
        raise _field_error("spec.act_dtype", f"one of {sorted(_DTYPES)}", f["act_dtype"])
    e = _int(row, "E")
    return MoESpec(
        num_experts=e,
        top_k=_int(row, "K"),
        hidden_size=_int(row, "H"),
        intermediate_size=_int(row, "I"),
        weight_format=_enum(f, "weight_format", WeightFormat),
        fp8_scale=None if f["fp8_scale"] is None else _enum(f, "fp8_scale", Fp8Scale),
        act_dtype=_DTYPES[f["act_dtype"]],
        act_quant=_enum(f, "act_quant", ActivationQuant),
        activation=ActivationSpec(
            _enum(f, "activation", Activation), alpha=_number(f, "alpha"), limit=_number(f, "limit")
        ),
        gate_layout=_enum(f, "gate_layout", GateLayout),
        has_bias=f["has_bias"],
        router_weight_placement=_enum(f, "router_weight_placement", RouterWeightPlacement),
        num_local_experts=e if f["expert_map"] else None,
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


def parse_row(raw: object, *, origin: str, registry: KernelRegistry) -> TunedRow:
    """Validate one table row (every field's JSON type, the spec, the kernel, its config, and that the
    kernel can serve the spec). The loader and the writer both call this: what one accepts, the other
    does. Raises TunedTableError (with `.key` once the row's key is known)."""
    if not isinstance(raw, dict):
        raise TunedTableError(f"a row must be an object, got {type(raw).__name__}")
    missing = [n for n in ROW_FIELDS if n not in raw]
    if missing:
        raise TunedTableError(f"missing fields {missing}")
    unknown = sorted(set(raw) - set(ROW_FIELDS))
    if unknown:
        raise TunedTableError(f"unknown fields {unknown}; a row has exactly {list(ROW_FIELDS)}")
    device, triton, kernel_name = _str(raw, "device"), _str(raw, "triton"), _str(raw, "kernel")
    tokens = _int(raw, "tokens")
    if tokens < 1:
        raise _field_error("tokens", "a positive int", tokens)
    try:
        spec = _spec_from_row(raw)
    except SpecError as err:  # well-typed values that no spec may have
        raise TunedTableError(f"bad spec or shape: {err}") from err
    key = TableKey.for_spec(spec, device=device, triton=triton, bucket=token_bucket(tokens))
    kernel = registry.get(kernel_name)
    if kernel is None:
        raise _KeyedError(key, f"unknown kernel {kernel_name!r}; registered: {list(registry.names)}")
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


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a repeated key (json keeps the last one silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        raise ValueError(f"repeated key(s) {repeated} in one JSON object")
    return obj


def _read_table(path: Path) -> list:
    """The rows list of the table at `path`, or TunedTableError saying what is wrong with the file.

    A file is understood only if it is a JSON object with exactly `schema_version` (this version) and
    `rows` (a list); anything else might be a newer or foreign format that neither reading nor merging
    may guess at."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_object)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise TunedTableError(f"unreadable table: {err}") from err
    except RecursionError as err:  # nesting deeper than the parser's stack
        raise TunedTableError("unreadable table: JSON nested too deeply to parse") from err
    if not isinstance(data, dict):
        raise TunedTableError(
            f"not a moekit tuned table: the top level is a {type(data).__name__}, not an object "
            f"with 'schema_version' and 'rows'"
        )
    unknown = sorted(set(data) - {"schema_version", "rows"})
    version = data.get("schema_version")
    if unknown or isinstance(version, bool) or version != SCHEMA_VERSION:
        raise TunedTableError(
            f"not a moekit tuned table of schema_version {SCHEMA_VERSION} "
            f"(got schema_version={_short(version)}"
            + (f", unknown top-level keys {unknown})" if unknown else ")")
        )
    if not isinstance(data.get("rows"), list):
        raise _field_error("the top-level 'rows'", "a list of rows", data.get("rows"))
    return data["rows"]


def _read_file(path: Path, registry: KernelRegistry) -> tuple[list[TunedRow], list[RejectedRow]]:
    try:
        raw_rows = _read_table(path)
    except TunedTableError as err:
        return [], [RejectedRow(str(path), str(err))]
    good: list[TunedRow] = []
    bad: list[RejectedRow] = []
    for index, raw in enumerate(raw_rows):
        origin = f"{path}#row {index}"
        try:
            good.append(parse_row(raw, origin=origin, registry=registry))
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


def write_rows(
    path: Path,
    new_rows: list[dict],
    *,
    registry: KernelRegistry | None = None,
    lock_timeout_s: float = 60.0,
) -> None:
    """Merge `new_rows` into the table at `path`, atomically; a new row replaces the rows of its key.

    Every new row must pass `parse_row` against `registry` (default: the default registry), and an
    existing file must be a table of this schema (`_read_table`); otherwise TunedTableError, and the
    file is left byte for byte as it was. Existing rows this registry cannot validate are kept as
    they are (the loader reports them); only rows with a new row's key are replaced."""
    path = Path(path)
    registry = registry or default_registry()
    keys: list[TableKey] = []
    for index, raw in enumerate(new_rows):
        try:
            keys.append(parse_row(raw, origin=f"new row {index}", registry=registry).key)
        except TunedTableError as err:
            raise TunedTableError(
                f"refusing to write to {path}: new row {index} is not a valid tuned row: {err}. "
                "Build rows with moekit.planning.tuned.row_to_json from a spec the row's kernel supports"
            ) from err
    if len(set(keys)) != len(keys):
        raise TunedTableError(
            f"refusing to write to {path}: two new rows share a key (device, triton, spec, shape and "
            "token bucket); the loader would use neither. Pass one row per token bucket"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock", timeout=lock_timeout_s):
        rows: list = []
        if path.exists():
            try:
                rows = _read_table(path)
            except TunedTableError as err:
                raise TunedTableError(
                    f"refusing to merge into {path}: {err}; the file was left unchanged. Write to another "
                    "path, or move this file aside: the writer never converts a table it does not understand"
                ) from err
        replaced = set(keys)
        merged = [r for r in rows if _key_of(r, registry) not in replaced] + list(new_rows)
        text = json.dumps({"schema_version": SCHEMA_VERSION, "rows": merged}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _key_of(raw: object, registry: KernelRegistry) -> TableKey | None:
    """The key of an existing row, if it has one (rows with a bad kernel or config still do)."""
    try:
        return parse_row(raw, origin="", registry=registry).key
    except TunedTableError as err:
        return getattr(err, "key", None)
