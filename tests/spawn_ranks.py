"""Run a function on N ranks spawned from a test: the one set-up of the distributed tests.

Data flow: `run_on_ranks(fn, world, tmp_path, backend)` -> torch.multiprocessing.spawn(N processes) ->
each: gloo: one torch thread (N ranks share the CI machine's cores); nccl: CUDA device = rank ->
`init_process_group(backend)` over a FileStore under tmp_path (no ports, so parallel pytest workers never
collide) -> `fn(rank, world)` -> the group destroyed whatever happened. A failing rank's exception fails
the test. `fn` must be a module-level function.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, fn, world: int, store_path: str, backend: str) -> None:  # noqa: ANN001 - any callable
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
    try:
        fn(rank, world)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, tmp_path: Path, backend: str = "gloo") -> None:  # noqa: ANN001
    mp.spawn(_rank, args=(fn, world, str(tmp_path / "store"), backend), nprocs=world, join=True)
