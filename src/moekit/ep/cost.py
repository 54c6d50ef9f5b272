"""Bytes each parallel engine moves per layer, and a latency + bandwidth model of its time.

Data flow: (engine, tokens per rank T, H, K, E, N, activation bytes) -> the collective calls of one
forward (`engine_calls`; `tensor_parallel_calls` for tensor parallelism), each with the bytes this rank
sends to the others (the all-to-all figure is its expectation under uniform routing) -> `bytes_moved`
(their sum) -> `predict_us` = sum over calls of that collective's latency + bytes / bus bandwidth, the
constants from a `moekit.ep.constants.CollectiveTable` (or one latency and bandwidth for all). A model,
never a measurement: the constants are fitted from collectives measured on the target machine
(`benchmarks/fit_collectives.py`), and N past the measured group is an extrapolation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.ep.constants import Collective, CollectiveTable
from moekit.ep.engines import (
    AllGatherReduceScatter,
    AllToAll,
    EpEngine,
    engine_for,
    moves_packed,
    packed_row_bytes,
)
from moekit.ep.ownership import expert_ownership
from moekit.errors import ArgumentError

_ROUTING_BYTES_PER_K = 8  # fp32 weight + int32 id per (token, k)
_COUNT_BYTES = 8  # one int64 count

Engine = AllGatherReduceScatter | AllToAll | EpEngine


@dataclass(frozen=True)
class CollectiveCall:
    """One collective of a forward: its kind, the bytes this rank sends to the others, what it carries."""

    kind: Collective
    bytes_sent: float
    what: str


def expected_remote_destinations(*, K: int, E: int, world: int, rank: int = 0) -> float:  # noqa: N803
    """Expected number of OTHER ranks a token of `rank` goes to under all-to-all, uniform top-K routing:
    sum over d != rank of P(d owns at least one of K distinct uniform experts)."""
    return sum(_p_owns_one(K=K, E=E, world=world, rank=d) for d in range(world) if d != rank)


def _p_owns_one(*, K: int, E: int, world: int, rank: int) -> float:  # noqa: N803
    """P(`rank` owns at least one of a token's K distinct uniform experts)."""
    owned = len(expert_ownership(E, world)[rank])
    return 1.0 - math.comb(E - owned, K) / math.comb(E, K)


def _engine(engine: Engine) -> AllGatherReduceScatter | AllToAll:
    return engine_for(engine) if isinstance(engine, EpEngine) else engine


def engine_calls(
    engine: Engine,
    *,
    tokens_per_rank: int,
    H: int,  # noqa: N803
    K: int,  # noqa: N803
    E: int,  # noqa: N803
    world: int,
    act_bytes: int,
    static: bool = True,
) -> tuple[CollectiveCall, ...]:
    """The collectives of one expert-parallel forward, every rank at T tokens. All-gather/reduce-scatter
    gathers x with its routing (one call while the rows are small enough to move packed, else two) and
    reduce-scatters the outputs, plus (not `static`: no `max_tokens` bound) one all-reduce of T;
    all-to-all exchanges counts, then x with its routing (one or two calls), then the outputs."""
    engine = _engine(engine)
    t, others = tokens_per_rank, world - 1
    row = H * act_bytes
    meta = K * _ROUTING_BYTES_PER_K
    packed = packed_row_bytes(H, act_bytes, K)
    if isinstance(engine, AllGatherReduceScatter):
        if moves_packed(t, packed):
            gather = (CollectiveCall(Collective.ALL_GATHER, others * t * packed, "x + routing"),)
        else:
            gather = (
                CollectiveCall(Collective.ALL_GATHER, others * t * row, "x"),
                CollectiveCall(Collective.ALL_GATHER, others * t * meta, "routing"),
            )
        calls = (*gather, CollectiveCall(Collective.REDUCE_SCATTER, others * t * row, "outputs"))
        if static:
            return calls
        count = CollectiveCall(Collective.ALL_REDUCE, 2 * others / world * _COUNT_BYTES, "max T (host sync)")
        return (count, *calls)
    remote = expected_remote_destinations(K=K, E=E, world=world)
    sends = t * remote
    rows_sent = t * (remote + _p_owns_one(K=K, E=E, world=world, rank=0))  # its own rows included
    if moves_packed(math.ceil(rows_sent), packed):
        dispatch = (CollectiveCall(Collective.ALL_TO_ALL, sends * packed, "x + routing"),)
    else:
        dispatch = (
            CollectiveCall(Collective.ALL_TO_ALL, sends * row, "x"),
            CollectiveCall(Collective.ALL_TO_ALL, sends * meta, "routing"),
        )
    return (
        CollectiveCall(Collective.ALL_TO_ALL, others * 2 * _COUNT_BYTES, "counts (host sync)"),
        *dispatch,
        CollectiveCall(Collective.ALL_TO_ALL, sends * row, "outputs"),
    )


def tensor_parallel_calls(*, tokens: int, H: int, world: int, act_bytes: int) -> tuple[CollectiveCall, ...]:  # noqa: N803
    """Tensor parallelism's one all-reduce of the [T, H] output (ring: 2 (N-1)/N of it sent per rank)."""
    return (CollectiveCall(Collective.ALL_REDUCE, 2 * (world - 1) / world * tokens * H * act_bytes, "out"),)


def bytes_moved(
    engine: Engine,
    *,
    tokens_per_rank: int,
    H: int,  # noqa: N803
    K: int,  # noqa: N803
    E: int,  # noqa: N803
    world: int,
    act_bytes: int,
    static: bool = True,
) -> float:
    """Bytes one rank sends to other ranks per forward (dispatch + combine), every rank at T tokens."""
    shape = dict(tokens_per_rank=tokens_per_rank, H=H, K=K, E=E, world=world, act_bytes=act_bytes)
    return float(sum(c.bytes_sent for c in engine_calls(engine, static=static, **shape)))


def _table(
    constants: CollectiveTable | None,
    bandwidth_GBps: float | None,
    latency_us: float | None,  # noqa: N803
) -> CollectiveTable:
    given = (bandwidth_GBps is not None, latency_us is not None)
    if constants is not None and not any(given):
        if not isinstance(constants, CollectiveTable):
            raise ArgumentError(
                f"constants must be a moekit.ep.constants.CollectiveTable, got {type(constants).__name__}; "
                "load one with moekit.ep.constants.load_collectives(path)"
            )
        return constants
    if constants is None and all(given):
        return CollectiveTable.uniform(latency_us=latency_us, bandwidth_GBps=bandwidth_GBps)
    raise ArgumentError(
        "predict_us needs either constants=CollectiveTable (load_collectives()) or both bandwidth_GBps= "
        f"and latency_us=, not a mix; got constants={'set' if constants is not None else None}, "
        f"bandwidth_GBps={bandwidth_GBps}, latency_us={latency_us}"
    )


def calls_us(calls: tuple[CollectiveCall, ...], constants: CollectiveTable) -> float:
    """Modeled µs of `calls` run one after another, each kind with its own latency and bandwidth."""
    return sum(constants.of(c.kind).predict_us(c.bytes_sent) for c in calls)


def predict_us(
    engine: Engine,
    *,
    tokens_per_rank: int,
    H: int,  # noqa: N803
    K: int,  # noqa: N803
    E: int,  # noqa: N803
    world: int,
    act_bytes: int,
    bandwidth_GBps: float | None = None,  # noqa: N803
    latency_us: float | None = None,
    constants: CollectiveTable | None = None,
    static: bool = True,
) -> float:
    """Modeled µs of one forward's communication: per call, its collective's latency + bytes / bus
    bandwidth, from `constants` (a measured table) or one `latency_us` and `bandwidth_GBps` for all,
    plus the engine's own device copies (`local_copy_bytes`) at `LOCAL_COPY_GBPS`."""
    table = _table(constants, bandwidth_GBps, latency_us)
    shape = dict(tokens_per_rank=tokens_per_rank, H=H, K=K, E=E, world=world, act_bytes=act_bytes)
    calls = engine_calls(engine, static=static, **shape)
    return calls_us(calls, table) + local_copy_bytes(engine, **shape) / (LOCAL_COPY_GBPS * 1e3)


# Device-to-device copy rate of an H200 (measured by `moekit bench`'s ceilings: 4.1 TB/s): what the
# engines' own gathers, sums and casts run at.
LOCAL_COPY_GBPS = 4100.0


def local_copy_bytes(
    engine: Engine,
    *,
    tokens_per_rank: int,
    H: int,  # noqa: N803
    K: int,  # noqa: N803
    E: int,  # noqa: N803
    world: int,
    act_bytes: int,
) -> float:
    """Device memory one rank's engine reads and writes besides the collectives, every rank at T tokens.
    All-gather/reduce-scatter: none beyond its collectives' buffers (padding only with uneven T).
    All-to-all: gathering the rows it sends, an fp32 output zeroed, one fp32 add of every returned row
    (read the row, read and write the sum) and the cast back to the activation dtype."""
    if isinstance(_engine(engine), AllGatherReduceScatter):
        return 0.0
    t, row = tokens_per_rank, H * act_bytes
    rows_sent = t * (
        expected_remote_destinations(K=K, E=E, world=world) + _p_owns_one(K=K, E=E, world=world, rank=0)
    )
    return rows_sent * 2 * row + t * H * 4 + rows_sent * (row + 8 * H) + t * H * (4 + act_bytes)


def predict_tensor_parallel_us(
    *,
    tokens: int,
    H: int,
    world: int,
    act_bytes: int,
    constants: CollectiveTable,  # noqa: N803
) -> float:
    """Modeled µs of tensor parallelism's all-reduce of the [T, H] output."""
    return calls_us(tensor_parallel_calls(tokens=tokens, H=H, world=world, act_bytes=act_bytes), constants)


def describe_model(
    *,
    bandwidth_GBps: float | None = None,
    latency_us: float | None = None,
    constants: CollectiveTable | None = None,  # noqa: N803
) -> str:
    """The model as text, for `explain`: its constants are inputs, not measurements."""
    table = _table(constants, bandwidth_GBps, latency_us)
    terms = ", ".join(
        f"{k.value} {c.latency_us:g} us + bytes / {c.bus_bandwidth_GBps:g} GB/s"
        for k, c in table.constants.items()
    )
    return (
        f"model, not a measurement: time = sum over collectives of latency + bytes sent / bus bandwidth "
        f"({terms}), + the engine's own device copies / {LOCAL_COPY_GBPS:g} GB/s (all-to-all's gather, "
        f"sum and cast); constants from {table.describe()}"
    )
