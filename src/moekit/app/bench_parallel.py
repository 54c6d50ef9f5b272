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

import functools
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from moekit.app.timing import median_seconds
from moekit.ep.constants import CollectiveTable
from moekit.ep.cost import predict_tensor_parallel_us, predict_us
from moekit.ep.engines import EpEngine, engine_for
from moekit.errors import DeviceError
from moekit.layer import FusedMoE
from moekit.ops import route
from moekit.parallel import Parallel, ParallelMode
from moekit.reference import relative_l2_error, tolerance
from moekit.router import compute_router_logits
from moekit.routing import RoutingResult
from moekit.spec import MoESpec
from moekit.synthetic import random_layer, random_tokens

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch's name


@dataclass(frozen=True)
class ParallelBenchRecord:
    mode: str
    engine: str  # the engine an eager forward used at this T (EP), or tensor_allreduce
    world_size: int
    tokens_per_rank: int
    parallel_us: float  # the slowest rank's median, eager forward
    one_rank_us: float  # the 1-rank layer on the same per-rank T, each rank alone (the slowest rank's)
    per_gpu_ratio: float  # tokens/s per GPU, parallel over 1-rank, best of eager and graph each
    model_comm_us: float  # the cost model's communication time: a model, not a measurement
    rel_l2: float  # parallel outputs vs the 1-rank layer on the global batch
    tolerance: float
    # CUDA only (None on CPU): CUDA-graph replays of the parallel and the 1-rank forward, and the
    # breakdown of the parallel forward, measured: the collectives alone (the engine with no expert
    # compute; TP: the all-reduce) and this rank's experts alone on the rows it computes.
    parallel_graph_us: float | None = None
    one_rank_graph_us: float | None = None
    comm_us: float | None = None
    experts_us: float | None = None

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


def exit_torchrun_group(code: int) -> NoReturn:
    """Every rank waits for the others, destroys the group and exits with `code`, skipping the
    interpreter's finalization: gloo's worker threads freed during that teardown abort the process
    (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291), which turned a
    finished, correct run into a failed one on a 2-core CI machine. Output is flushed first."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _seconds(fn, device: torch.device) -> float:  # noqa: ANN001 - a zero-argument callable
    """The slowest rank's median seconds of `fn()` (every rank calls it the same number of times)."""
    repeats, batches = (20, 7) if device.type == "cuda" else (2, 3)
    return _slowest(median_seconds(fn, device, repeats=repeats, batches=batches), device)


def _graphed(fn):  # noqa: ANN001, ANN202 - a zero-argument callable, and its graph's replay
    """`fn` captured in a CUDA graph (after one forward on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _breakdown(par: FusedMoE, x: torch.Tensor, engine: EpEngine | None, device: torch.device):  # noqa: ANN202
    """(collectives alone, experts alone) seconds of `par`'s forward on this rank's tokens `x`, each
    replayed from a CUDA graph where it can be captured (all but all-to-all), as a served forward is."""
    spec = par.spec
    routing = _routing(par, x)
    if par.parallel.mode is ParallelMode.TENSOR:
        out = x.clone()
        comm = _seconds(_graphed(functools.partial(dist.all_reduce, out)), device)
        rows = x
    else:
        kind = engine  # the engine the eager forward used (None only for tensor parallelism)
        collectives_only = functools.partial(
            engine_for(kind).run,
            x,
            routing,
            group=dist.group.WORLD,
            local_experts=lambda rows, _: rows,
            num_experts=spec.E,
            max_tokens=None if kind is EpEngine.ALL_TO_ALL else x.shape[0],
        )
        capturable = engine_for(kind).capabilities.graph_capturable
        comm = _seconds(_graphed(collectives_only) if capturable else collectives_only, device)
        rows = _gather_rows(x)  # what all-gather hands this rank's experts
        routing = RoutingResult(weights=_gather_rows(routing.weights), ids=_gather_rows(routing.ids))
    experts = _seconds(_graphed(functools.partial(par.run_local_experts, rows, routing)), device)
    return comm, experts


def _routing(layer: FusedMoE, x: torch.Tensor) -> RoutingResult:
    logits = compute_router_logits(x, layer.router_weight, layer.router_bias, batch_invariant=False)
    return route(logits, top_k=layer.spec.K, spec=layer.spec.routing, correction_bias=layer.correction_bias)


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
    engine: EpEngine | None = None,
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
    expert = mode is ParallelMode.EXPERT
    parallel = Parallel.expert(group, engine=engine) if expert else Parallel.tensor(group)
    par = FusedMoE(parallel=parallel, **common)
    one = FusedMoE(**common)
    cuda = device.type == "cuda"
    act = torch.empty((), dtype=spec.act_dtype).element_size()
    records = []
    for t in tokens:
        # EP: each rank its own tokens; TP: the same tokens everywhere (replicated activations).
        x = random_tokens(spec, t, seed=1000 + (rank if expert else 0), device=device)
        with torch.no_grad():
            t_par, t_one = (
                _seconds(functools.partial(par, x), device),
                _seconds(functools.partial(one, x), device),
            )
            # The engine this T's eager forward used (its bucket's choice unless one was named).
            used = (engine or par.ep_choice(t).engine) if expert else None
            g_par = g_one = comm = experts = None
            if cuda:
                g_par = _seconds(_graphed(functools.partial(par, x)), device)
                g_one = _seconds(_graphed(functools.partial(one, x)), device)
                comm, experts = _breakdown(par, x, used, device)
            best_par, best_one = min(t_par, g_par or t_par), min(t_one, g_one or t_one)
            if expert:
                got, want = _gather_rows(par(x)), one(_gather_rows(x))
                model = predict_us(
                    used, tokens_per_rank=t, H=spec.H, K=spec.K, E=spec.E, world=world, act_bytes=act,
                    constants=constants, static=False,
                )  # fmt: skip
                ratio = best_one / best_par  # each GPU serves its own T tokens
            else:
                got, want = par(x), one(x)
                model = predict_tensor_parallel_us(
                    tokens=t, H=spec.H, world=world, act_bytes=act, constants=constants
                )
                ratio = best_one / (world * best_par)  # N GPUs serve the same T tokens together
        records.append(
            ParallelBenchRecord(
                mode=mode.value,
                engine=used.value if expert else "tensor_allreduce",
                world_size=world,
                tokens_per_rank=t,
                parallel_us=t_par * 1e6,
                one_rank_us=t_one * 1e6,
                per_gpu_ratio=ratio,
                model_comm_us=model,
                rel_l2=relative_l2_error(got, want),
                tolerance=tolerance(spec),
                parallel_graph_us=None if g_par is None else g_par * 1e6,
                one_rank_graph_us=None if g_one is None else g_one * 1e6,
                comm_us=None if comm is None else comm * 1e6,
                experts_us=None if experts is None else experts * 1e6,
            )
        )
    return records
