"""The expert-parallel forward of a `FusedMoE`: this rank's tokens to their experts' ranks and back.

Data flow: x_local [T_r, H] (any T_r, zero included) and its routing on GLOBAL expert ids (each rank
routes its own tokens on the full router) -> the group's engine (`Parallel.engine`,
`moekit.ep.engines`) -> dispatch -> `local_experts(x, routing)`: the layer's own plan and kernel for
the received row count, with its expert map, so other ranks' experts add nothing -> combine -> out_local.

All-gather / reduce-scatter pads every rank to one row count that all ranks must agree on. The ranks
agree on it here by one all-reduce of T_r (MAX), read on the host: the simplest design that is correct
for uneven and empty batches without the caller passing anything, at the price of one sync per forward,
so this wiring is not captured in a CUDA graph even though the engine alone is capturable. The experts
then run on N * max T_r rows, planned in that count's token bucket. Every rank of the group must call
the layer for every forward (an empty batch included): the collectives are matched by order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ep.engines import LocalExperts, engine_for
from moekit.errors import UnsupportedSpecError
from moekit.parallel.spec import Parallel
from moekit.routing import RoutingResult


def check_engine(parallel: Parallel) -> None:
    """Refuse, when the layer is built, an engine that cannot run on the group's backend."""
    engine = engine_for(parallel.engine)
    backend = str(dist.get_backend(parallel.group))
    if (why := engine.capabilities.reason(backend)) is not None:
        raise UnsupportedSpecError(
            f"Parallel.engine={parallel.engine!r} cannot run here: {why}; pick another engine or backend"
        )


def expert_parallel_forward(
    parallel: Parallel,
    x: torch.Tensor,
    routing: RoutingResult,
    local_experts: LocalExperts,
    *,
    num_experts: int,
) -> torch.Tensor:
    """out_local [T_r, H] for this rank's tokens `x` routed to global experts (module docstring)."""
    return engine_for(parallel.engine).run(
        x, routing, group=parallel.group, local_experts=local_experts, num_experts=num_experts
    )
