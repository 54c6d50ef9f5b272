"""Bytes each expert-parallel engine moves per layer, and a latency + bandwidth model of its time.

Data flow: (engine, tokens per rank T, H, K, E, N, activation bytes) -> bytes one rank sends to the
others per forward (`bytes_moved`; the all-to-all figure is its expectation under uniform routing) ->
`predict_us` = collectives x latency + bytes / bandwidth. A model, never a measurement: the latency and
bandwidth are parameters, to be fitted from collectives measured on the target machine.
"""

from __future__ import annotations

import math

from moekit.ep.engines import AllGatherReduceScatter, AllToAll
from moekit.ep.ownership import expert_ownership

_ROUTING_BYTES_PER_K = 8  # fp32 weight + int32 id per (token, k)


def expected_remote_destinations(*, K: int, E: int, world: int, rank: int = 0) -> float:  # noqa: N803
    """Expected number of OTHER ranks a token of `rank` goes to under all-to-all, uniform top-K routing:
    sum over d != rank of P(d owns at least one of K distinct uniform experts)."""
    total = 0.0
    for d, owned in enumerate(expert_ownership(E, world)):
        if d != rank:
            total += 1.0 - math.comb(E - len(owned), K) / math.comb(E, K)
    return total


def collectives(engine: AllGatherReduceScatter | AllToAll, *, static: bool = True) -> int:
    """Collective calls per forward: AG/RS gathers x and routing and reduce-scatters (+1 all-reduce of
    the count without `max_tokens`); all-to-all exchanges counts, x, routing and outputs."""
    if isinstance(engine, AllGatherReduceScatter):
        return 3 if static else 4
    return 4


def bytes_moved(
    engine: AllGatherReduceScatter | AllToAll,
    *,
    tokens_per_rank: int,
    H: int,  # noqa: N803
    K: int,  # noqa: N803
    E: int,  # noqa: N803
    world: int,
    act_bytes: int,
) -> float:
    """Bytes one rank sends to other ranks per forward (dispatch + combine), every rank at T tokens."""
    row = H * act_bytes
    meta = K * _ROUTING_BYTES_PER_K
    if isinstance(engine, AllGatherReduceScatter):
        # all-gather: its T rows go to N-1 ranks; reduce-scatter: N-1 blocks of T output rows go out.
        return float((world - 1) * tokens_per_rank * (row + meta) + (world - 1) * tokens_per_rank * row)
    sends = tokens_per_rank * expected_remote_destinations(K=K, E=E, world=world)
    return sends * (row + meta) + sends * row + (world - 1) * 8  # + the int64 count to each rank


def predict_us(
    engine: AllGatherReduceScatter | AllToAll,
    *,
    tokens_per_rank: int,
    H: int,  # noqa: N803
    K: int,  # noqa: N803
    E: int,  # noqa: N803
    world: int,
    act_bytes: int,
    bandwidth_GBps: float,  # noqa: N803
    latency_us: float,
) -> float:
    """Modeled microseconds of one forward's communication: latency per collective + bytes / bandwidth."""
    moved = bytes_moved(
        engine, tokens_per_rank=tokens_per_rank, H=H, K=K, E=E, world=world, act_bytes=act_bytes
    )
    return collectives(engine) * latency_us + moved / (bandwidth_GBps * 1e3)


def describe_model(*, bandwidth_GBps: float, latency_us: float) -> str:  # noqa: N803
    """The model as text, for `explain`: its constants are inputs, not measurements."""
    return (
        f"model: time = collectives x {latency_us:g} us + bytes / {bandwidth_GBps:g} GB/s "
        "(constants are parameters of the model, not measurements)"
    )
