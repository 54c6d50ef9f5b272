"""Run a function on N ranks spawned from a test: the one set-up of the distributed tests.

Data flow: `run_on_ranks(fn, world, tmp_path, backend)` -> torch.multiprocessing.spawn(N processes) ->
each: gloo: one torch thread (N ranks share the CI machine's cores); nccl: CUDA device = rank ->
`init_process_group(backend)` over a FileStore under tmp_path (no ports, so parallel pytest workers never
collide) -> `fn(rank, world)` -> a barrier -> the group destroyed -> `os._exit(0)`. A rank whose `fn`
raises destroys the group and re-raises: that exception fails the test (its peers, left at the barrier,
wait a grace period so that spawn reports it first). `fn` must be a module-level function.

A rank that finished `fn` leaves by `os._exit(0)` after a barrier and the group's destruction, skipping
the interpreter's finalization, which is no part of what the tests check. One rank of a checkpoint test
aborted in two CI runs on the 2-core machine (SIGABRT, "terminate called without an active exception",
the C++ runtime's message for a thread object destroyed while still running) and not in 120 local runs;
freeing gloo's worker state while the interpreter is torn down is a known way to get it
(pytorch/pytorch#179291). An exception or abort inside `fn` still fails the test.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PEER_ERROR_GRACE_S = 10.0


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
    except BaseException:
        dist.destroy_process_group()
        raise
    try:
        dist.barrier()
    except RuntimeError as peer_gone:
        # A peer failed inside `fn` and closed its connections. Waiting lets spawn report that
        # peer's error, the cause, before this rank's.
        time.sleep(_PEER_ERROR_GRACE_S)
        raise RuntimeError(f"rank {rank} finished its work but a peer did not: see that rank's error") from (
            peer_gone
        )
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, world: int, tmp_path: Path, backend: str = "gloo") -> None:  # noqa: ANN001
    mp.spawn(_rank, args=(fn, world, str(tmp_path / "store"), backend), nprocs=world, join=True)
