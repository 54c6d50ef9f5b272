"""Parallel MoE layers on torch.distributed: the public `Parallel` description and weight sharding.

Data flow: `Parallel.tensor(group)` / `Parallel.expert(group)` (validated: distributed initialized, a
real group this rank belongs to) -> `FusedMoE(..., parallel=...)` -> `shard_for(parallel, spec,
weights)` gives this rank's spec and weights (`plan_shard(RankShare.of(parallel), spec)`: the same cut a
checkpoint loader reads) -> the layer runs them and reduces across the group.
"""

from moekit.ep.engines import EpEngine
from moekit.parallel.shard import (
    Cut,
    RankShare,
    ShardPlan,
    expert_shard,
    plan_shard,
    shard_for,
    tensor_shard,
)
from moekit.parallel.spec import Parallel, ParallelMode, check_same_layer

__all__ = [
    "Cut",
    "EpEngine",
    "Parallel",
    "ParallelMode",
    "RankShare",
    "ShardPlan",
    "check_same_layer",
    "expert_shard",
    "plan_shard",
    "shard_for",
    "tensor_shard",
]
