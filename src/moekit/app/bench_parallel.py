"""`moekit bench --parallel ep|tp` under torchrun: the parallel layer against the 1-rank layer, per T.

Data flow: torchrun's environment -> `init_process_group` (NCCL on GPUs, gloo on CPUs) -> every rank
draws the same random layer (one seed) and builds it twice: the 1-rank `FusedMoE` (all of it, no
collectives) and the parallel one (`Parallel.expert/tensor(WORLD)`) -> for each per-rank T: this rank's
tokens (EP: its own; TP: the same on every rank, as a TP group's activations are) -> median time of each
(`moekit.app.timing.median_seconds`; the slowest rank's) -> correctness: the parallel outputs of every
rank gathered against the 1-rank layer on the concatenated global batch (relative L2 vs
`moekit.reference.tolerance(spec)`) -> `ParallelBenchRecord`s, printed by rank 0 with the cost model's
communication figure beside them (a model, labelled so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.app.timing import median_seconds
from moekit.ep.constants import CollectiveTable
from moekit.ep.cost import predict_tensor_parallel_us, predict_us
from moekit.ep.engines import EpEngine
from moekit.errors import DeviceError
from moekit.layer import FusedMoE
from moekit.parallel import Parallel, ParallelMode
from moekit.reference import relative_l2_error, tolerance
from moekit.spec import MoESpec
from moekit.synthetic import random_layer, random_tokens

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch's name


@dataclass(frozen=True)
class ParallelBenchRecord:
    mode: str
    engine: str
    world_size: int
    tokens_per_rank: int
    parallel_us: float  # the slowest rank's median
    one_rank_us: float  # the 1-rank layer on the same per-rank T, each rank alone (the slowest rank's)
    per_gpu_ratio: float  # tokens/s per GPU, parallel over 1-rank (>= 0.9 is the goal at large T)
    model_comm_us: float  # the cost model's communication time: a model, not a measurement
    rel_l2: float  # parallel outputs vs the 1-rank layer on the global batch
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_l2 <= self.tolerance


TORCHRUN_NEEDED = (
    "moekit bench --parallel runs one process per rank: start it with "
    "torchrun --nproc-per-node N -m moekit.app.cli bench --parallel ep|tp ..."
)


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_from_torchrun(device_kind: str) -> torch.device:
    """Join the torchrun group (NCCL on CUDA, gloo on CPU); this rank's device."""
    if not under_torchrun():
        raise DeviceError(TORCHRUN_NEEDED)
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda: no CUDA device here; use --device cpu (gloo)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _seconds(layer: FusedMoE, x: torch.Tensor, device: torch.device) -> float:
    """The slowest rank's median seconds of `layer(x)` (every rank calls it the same number of times)."""
    repeats, batches = (20, 7) if device.type == "cuda" else (2, 3)
    return _slowest(median_seconds(lambda: layer(x), device, repeats=repeats, batches=batches), device)


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H] on every rank (the same T) -> [N*T, H] in rank order."""
    out = x.new_empty(dist.get_world_size() * x.shape[0], x.shape[1])
    _all_gather(out, x.contiguous())
    return out


def bench_parallel(
    spec: MoESpec,
    *,
    mode: ParallelMode,
    tokens: tuple[int, ...],
    device: torch.device,
    constants: CollectiveTable,
    engine: EpEngine = EpEngine.ALLGATHER_REDUCESCATTER,
    seed: int = 0,
) -> list[ParallelBenchRecord]:
    """Time and check the parallel layer against the 1-rank layer at each per-rank T (every rank calls)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = random_layer(spec, seed=seed, device=device)  # one seed: the same global layer on every rank
    common = dict(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        correction_bias=layer.correction_bias,
        device=device,
    )
    group = dist.group.WORLD
    parallel = (
        Parallel.expert(group, engine=engine) if mode is ParallelMode.EXPERT else Parallel.tensor(group)
    )
    par = FusedMoE(parallel=parallel, **common)
    one = FusedMoE(**common)
    act = torch.empty((), dtype=spec.act_dtype).element_size()
    records = []
    for t in tokens:
        # EP: each rank its own tokens; TP: the same tokens everywhere (replicated activations).
        x = random_tokens(spec, t, seed=1000 + (rank if mode is ParallelMode.EXPERT else 0), device=device)
        with torch.no_grad():
            t_par, t_one = _seconds(par, x, device), _seconds(one, x, device)
            if mode is ParallelMode.EXPERT:
                got, want = _gather_rows(par(x)), one(_gather_rows(x))
                model = predict_us(
                    engine, tokens_per_rank=t, H=spec.H, K=spec.K, E=spec.E, world=world, act_bytes=act,
                    constants=constants, static=False,
                )  # fmt: skip
                ratio = t_one / t_par  # each GPU serves its own T tokens
            else:
                got, want = par(x), one(x)
                model = predict_tensor_parallel_us(
                    tokens=t, H=spec.H, world=world, act_bytes=act, constants=constants
                )
                ratio = t_one / (world * t_par)  # N GPUs serve the same T tokens together
        records.append(
            ParallelBenchRecord(
                mode=mode.value,
                engine=engine.value if mode is ParallelMode.EXPERT else "tensor_allreduce",
                world_size=world,
                tokens_per_rank=t,
                parallel_us=t_par * 1e6,
                one_rank_us=t_one * 1e6,
                per_gpu_ratio=ratio,
                model_comm_us=model,
                rel_l2=relative_l2_error(got, want),
                tolerance=tolerance(spec),
            )
        )
    return records
