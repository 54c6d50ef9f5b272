"""Measured constants of the communication cost model: per-collective latency and bus bandwidth, as data.

Data flow: a JSON table (`tables/*.json`, shipped; or one `benchmarks/fit_collectives.py --out` wrote)
-> `parse_collectives` checks every field (a malformed file is a `CollectiveTableError` naming the
field, the value and the fix) -> a frozen `CollectiveTable`: for each `Collective` kind a latency in µs
and a bus bandwidth in GB/s, plus where they came from (device, backend, torch/NCCL versions, date,
command) -> `moekit.ep.cost.predict_us(..., constants=table)`.

Bus bandwidth is nccl-tests' definition: bytes one rank sends to the others divided by the time
(all-gather, reduce-scatter, all-to-all: S (N-1)/N for a buffer of S bytes; all-reduce: 2 S (N-1)/N), so
the model's time of one call is latency + bytes sent / bus bandwidth for every kind.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from moekit.errors import MoekitError

FORMAT = "moekit-collectives/1"
TABLES = Path(__file__).parent / "tables"
DEFAULT_TABLE = TABLES / "h200_nvlink.json"


class CollectiveTableError(MoekitError, ValueError):
    """A table of collective constants is malformed: the message names the field and the fix."""


class Collective(enum.Enum):
    """The torch.distributed collectives the parallel layers call (values: their names in a table)."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class Sample:
    """One measured size: bytes of the per-rank buffer (nccl-tests' size), µs per call, bus GB/s."""

    bytes: int
    us: float | None
    bus_bandwidth_GBps: float | None  # noqa: N815


@dataclass(frozen=True)
class CollectiveConstants:
    """The model of one collective: time = latency_us + bytes sent / bus_bandwidth_GBps."""

    latency_us: float
    bus_bandwidth_GBps: float  # noqa: N815
    note: str = ""
    samples: tuple[Sample, ...] = ()

    def predict_us(self, bytes_sent: float) -> float:
        """Modeled µs of one call in which this rank sends `bytes_sent` bytes to the others."""
        return self.latency_us + bytes_sent / (self.bus_bandwidth_GBps * 1e3)


@dataclass(frozen=True)
class Source:
    """Where the constants came from."""

    description: str
    device: str | None = None
    backend: str | None = None
    torch: str | None = None
    nccl: str | None = None
    date: str | None = None
    command: str | None = None


@dataclass(frozen=True)
class CollectiveTable:
    """Constants of every `Collective` on one machine, measured with `world_size` ranks."""

    machine: str
    world_size: int
    source: Source
    constants: dict[Collective, CollectiveConstants]

    def of(self, kind: Collective) -> CollectiveConstants:
        return self.constants[kind]

    def describe(self) -> str:
        return f"{self.source.description} ({self.machine}, measured with {self.world_size} ranks)"

    @classmethod
    def uniform(cls, *, latency_us: float, bandwidth_GBps: float) -> CollectiveTable:  # noqa: N803
        """One latency and one bandwidth for every kind: the model's keyword form, as a table."""
        one = CollectiveConstants(latency_us=latency_us, bus_bandwidth_GBps=bandwidth_GBps)
        return cls(
            machine="given",
            world_size=0,
            source=Source(
                description=f"given: {latency_us:g} us, {bandwidth_GBps:g} GB/s for every collective"
            ),
            constants=dict.fromkeys(Collective, one),
        )


def _fail(origin: str, field: str, value: object, need: str) -> CollectiveTableError:
    return CollectiveTableError(
        f"{origin}: {field} must be {need}, got {value!r}; fix the file, or write it again with "
        "benchmarks/fit_collectives.py --out"
    )


def _number(origin: str, field: str, value: object, *, optional: bool = False) -> float | None:
    if optional and value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _fail(origin, field, value, ("null or " if optional else "") + "a finite number > 0")
    return float(value)


def _text(origin: str, field: str, value: object, *, optional: bool = True) -> str | None:
    if (optional and value is None) or isinstance(value, str):
        return value
    raise _fail(origin, field, value, "a string" + (" or null" if optional else ""))


def _object(origin: str, field: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise _fail(origin, field, value, "a JSON object")
    return value


def _samples(origin: str, field: str, value: object) -> tuple[Sample, ...]:
    if not isinstance(value, list):
        raise _fail(origin, field, value, "a list of {bytes, us, bus_bandwidth_GBps} objects")
    out = []
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        item = _object(origin, where, item)
        size = item.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise _fail(origin, f"{where}.bytes", size, "an int > 0")
        us = _number(origin, f"{where}.us", item.get("us"), optional=True)
        bus = _number(origin, f"{where}.bus_bandwidth_GBps", item.get("bus_bandwidth_GBps"), optional=True)
        out.append(Sample(bytes=size, us=us, bus_bandwidth_GBps=bus))
    return tuple(out)


def _constants(origin: str, field: str, value: object) -> CollectiveConstants:
    entry = _object(origin, field, value)
    return CollectiveConstants(
        latency_us=_number(origin, f"{field}.latency_us", entry.get("latency_us")),
        bus_bandwidth_GBps=_number(origin, f"{field}.bus_bandwidth_GBps", entry.get("bus_bandwidth_GBps")),
        note=_text(origin, f"{field}.note", entry.get("note", "")) or "",
        samples=_samples(origin, f"{field}.samples", entry.get("samples", [])),
    )


def parse_collectives(data: object, *, origin: str = "collective table") -> CollectiveTable:
    """A `CollectiveTable` from the decoded JSON `data`, every field checked (`origin` names the file)."""
    data = _object(origin, "the table", data)
    if data.get("format") != FORMAT:
        raise _fail(origin, "format", data.get("format"), repr(FORMAT))
    machine = _text(origin, "machine", data.get("machine"), optional=False)
    world = data.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise _fail(origin, "world_size", world, "an int >= 2 (the ranks the constants were measured with)")
    src = _object(origin, "source", data.get("source"))
    source = Source(
        description=_text(origin, "source.description", src.get("description"), optional=False),
        **{
            k: _text(origin, f"source.{k}", src.get(k))
            for k in ("device", "backend", "torch", "nccl", "date")
        },
        command=_text(origin, "source.command", src.get("command")),
    )
    entries = _object(origin, "collectives", data.get("collectives"))
    names = {c.value for c in Collective}
    if unknown := sorted(set(entries) - names):
        raise _fail(origin, "collectives", unknown, f"keys among {sorted(names)}")
    if missing := sorted(names - set(entries)):
        raise _fail(
            origin,
            "collectives",
            sorted(entries),
            f"an object with every key of {sorted(names)} (missing {missing})",
        )
    constants = {c: _constants(origin, f"collectives.{c.value}", entries[c.value]) for c in Collective}
    return CollectiveTable(machine=machine, world_size=world, source=source, constants=constants)


def load_collectives(path: str | Path | None = None) -> CollectiveTable:
    """The table at `path` (default: the shipped 2x H200 NVLink table), checked."""
    path = DEFAULT_TABLE if path is None else Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise CollectiveTableError(f"{path}: cannot read it ({err}); give an existing table file") from err
    except json.JSONDecodeError as err:
        raise CollectiveTableError(
            f"{path}: not JSON ({err}); write it with benchmarks/fit_collectives.py --out"
        ) from err
    return parse_collectives(data, origin=str(path))


@functools.cache
def shipped_collectives() -> CollectiveTable:
    """The shipped table, read and checked once per process (every expert-parallel layer consults it)."""
    return load_collectives()


def collectives_as_dict(table: CollectiveTable) -> dict:
    """`table` in the file format `parse_collectives` reads (what `fit_collectives.py --out` writes)."""

    def entry(c: CollectiveConstants) -> dict:
        out: dict = {"latency_us": c.latency_us, "bus_bandwidth_GBps": c.bus_bandwidth_GBps}
        if c.note:
            out["note"] = c.note
        if c.samples:
            out["samples"] = [vars(s).copy() for s in c.samples]
        return out

    return {
        "format": FORMAT,
        "machine": table.machine,
        "world_size": table.world_size,
        "source": vars(table.source).copy(),
        "collectives": {k.value: entry(table.constants[k]) for k in Collective},
    }
