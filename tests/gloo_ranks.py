"""Run a function on N gloo ranks spawned from a test: the one set-up of the distributed CPU tests.

Data flow: `run_on_ranks(fn, world, tmp_path)` -> torch.multiprocessing.spawn(N processes) -> each: one
torch thread (N ranks share the CI machine's cores), `init_process_group("gloo")` over a FileStore under
tmp_path (no ports, so parallel pytest workers never collide) -> `fn(rank, world)` -> the group destroyed
whatever happened. A failing rank's exception fails the test. `fn` must be a module-level function.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, fn, world: int, store_path: str) -> None:  # noqa: ANN001 - any module-level callable
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        fn(rank, world)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, tmp_path: Path) -> None:  # noqa: ANN001 - any module-level callable
    mp.spawn(_rank, args=(fn, world, str(tmp_path / "store")), nprocs=world, join=True)
