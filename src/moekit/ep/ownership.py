"""Contiguous expert ownership for expert parallelism: rank r holds a contiguous block of global experts.

Data flow: (E, world size) -> per-rank ranges (the first E % N ranks hold one expert more, so E need not
be divisible by N; E < N is refused: a rank without experts has no `MoESpec.num_local_experts`) ->
the rank's expert map (global id -> local index, -1 for experts other ranks own, the map
`moekit.checks.check_expert_map` accepts) and the owner rank of any global id, computed on the device.
"""

from __future__ import annotations

import torch

from moekit.errors import SpecError, check_int


def expert_ownership(num_experts: int, world_size: int) -> tuple[range, ...]:
    """The global experts each rank owns, in rank order: contiguous, sizes differing by at most one."""
    check_int("num_experts", num_experts, minimum=1)
    check_int("world_size", world_size, minimum=1)
    if num_experts < world_size:
        raise SpecError(
            f"expert parallelism needs at least one expert per rank: num_experts E={num_experts} < "
            f"world_size N={world_size}; use at most {num_experts} ranks, or tensor parallelism"
        )
    base, extra = divmod(num_experts, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return tuple(ranges)


def num_local_experts(num_experts: int, rank: int, world_size: int) -> int:
    """How many experts `rank` owns: the `MoESpec.num_local_experts` of its layer."""
    return len(_range_of(num_experts, rank, world_size))


def local_expert_map(
    num_experts: int, rank: int, world_size: int, *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """int32 `[E]`: global expert id -> index among `rank`'s experts, -1 where another rank owns it."""
    owned = _range_of(num_experts, rank, world_size)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[owned.start : owned.stop] = torch.arange(len(owned), dtype=torch.int32, device=device)
    return expert_map


def owner_of(ids: torch.Tensor, *, num_experts: int, world_size: int) -> torch.Tensor:
    """The rank owning each global expert id (same shape as `ids`, int64), on the device, no host sync."""
    expert_ownership(num_experts, world_size)  # refuses E < N
    base, extra = divmod(num_experts, world_size)
    ids = ids.long()
    split = extra * (base + 1)  # ids below this sit in the larger blocks of the first `extra` ranks
    return torch.where(ids < split, ids // (base + 1), extra + (ids - split) // base)


def _range_of(num_experts: int, rank: int, world_size: int) -> range:
    ranges = expert_ownership(num_experts, world_size)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise SpecError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return ranges[rank]
