"""`Parallel`: how one `FusedMoE` is spread over the ranks of a torch.distributed process group.

Data flow: a process group -> `Parallel.tensor(group)` or `Parallel.expert(group)` (checks that
torch.distributed is initialized, that `group` is a process group and that this rank belongs to it) ->
a frozen value the layer reads `mode`, `rank` and `world_size` from.

TENSOR: every rank holds all experts with the intermediate size I sharded N ways; every rank passes the
same tokens (activations are replicated across a tensor-parallel group, as in vLLM and SGLang) and gets
the full output after one all-reduce. EXPERT: every rank holds E/N whole experts and its own tokens,
moved to their experts' ranks and back by an engine of `moekit.ep.engines`: the one `engine` names, or
(engine=None, the default) the one `moekit.parallel.expert` chooses per token bucket.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from moekit.ep.engines import EpEngine, engine_for
from moekit.errors import ArgumentError, DeviceError, MoekitError, SpecError, check_enum
from moekit.parallel.agreement import raise_refusal, refusal_code
from moekit.spec import MoESpec


class ParallelMode(enum.Enum):
    EXPERT = "expert"  # E/N whole experts per rank; tokens dispatched to their owners and combined back
    TENSOR = "tensor"  # all experts per rank, I/N of each; one all-reduce of the output


def _check_group(group: object, mode: ParallelMode) -> None:
    if not dist.is_available():
        raise SpecError(
            f"Parallel.{mode.value}: this torch build has no torch.distributed; install one with it"
        )
    if not dist.is_initialized():
        raise SpecError(
            f"Parallel.{mode.value}(group) needs torch.distributed initialized; call "
            "torch.distributed.init_process_group(backend, ...) on every rank first"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out
        raise SpecError(
            f"Parallel.{mode.value}(group): this process (global rank {dist.get_rank()}) is not a member of "
            "group (new_group returned GroupMember.NON_GROUP_MEMBER here); build the layer only on the "
            "group's ranks"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise ArgumentError(
            f"Parallel.{mode.value}(group): group must be a torch.distributed ProcessGroup, got "
            f"{type(group).__name__}; pass torch.distributed.group.WORLD or torch.distributed.new_group(...)"
        )
    try:
        rank = dist.get_rank(group)
    except ValueError as err:  # torch's answer for a group it does not know: destroyed, or another's
        raise ArgumentError(
            f"Parallel.{mode.value}(group): torch.distributed does not know this group ({err}); was it "
            "destroyed? pass a live group from torch.distributed.new_group(...)"
        ) from err
    if rank < 0:
        raise SpecError(
            f"Parallel.{mode.value}(group): this process (global rank {dist.get_rank()}) is not a member of "
            "group; build the layer only on the group's ranks"
        )


@dataclass(frozen=True)
class Parallel:
    """A parallel mode over a process group. Build it with `Parallel.tensor` or `Parallel.expert`."""

    mode: ParallelMode
    group: dist.ProcessGroup
    # EXPERT: the `moekit.ep.engines` engine that dispatches and combines; None: chosen per token bucket
    engine: EpEngine | None = None

    def __post_init__(self) -> None:
        check_enum("Parallel.mode", self.mode, ParallelMode, error=ArgumentError)
        if self.engine is not None:
            engine_for(self.engine)  # anything but an EpEngine is refused with the choices
        if self.mode is ParallelMode.TENSOR and self.engine is not None:
            raise ArgumentError(
                f"Parallel.engine={self.engine!r}: tensor parallelism moves no tokens; drop engine="
            )
        _check_group(self.group, self.mode)

    @classmethod
    def tensor(cls, group: dist.ProcessGroup) -> Parallel:
        """Tensor parallelism over `group`: I sharded, the same tokens on every rank, one all-reduce."""
        return cls(ParallelMode.TENSOR, group)

    @classmethod
    def expert(cls, group: dist.ProcessGroup, *, engine: EpEngine | None = None) -> Parallel:
        """Expert parallelism over `group`: E/N whole experts per rank, each rank its own tokens, moved
        by `engine` (`EpEngine.ALLGATHER_REDUCESCATTER` or `EpEngine.ALL_TO_ALL`); None, the default,
        lets the layer choose per token bucket (`moekit.parallel.expert.ExpertParallel.choice_for`)."""
        return cls(ParallelMode.EXPERT, group, engine)

    @property
    def rank(self) -> int:
        """This process's rank within `group`."""
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        """N, the number of ranks in `group`."""
        return dist.get_world_size(self.group)

    def describe(self) -> str:
        engine = ""
        if self.mode is ParallelMode.EXPERT:
            engine = f", engine {'chosen per bucket' if self.engine is None else self.engine.value}"
        return f"{self.mode.value} parallel, rank {self.rank} of {self.world_size}{engine}"


def device_problem(backend: str, device: torch.device) -> str | None:
    """Why this rank's layer device cannot serve the group's `backend`, or None. NCCL moves CUDA tensors
    of the rank's current device; gloo moves CPU tensors."""
    if backend == "nccl":
        if device.type != "cuda":
            return f"an NCCL group moves CUDA tensors, this layer is on {device}; build it with device='cuda'"
        if device.index != torch.cuda.current_device():
            current = torch.cuda.current_device()
            return (
                f"NCCL runs on this rank's current CUDA device cuda:{current}, this layer is on {device}; "
                "call torch.cuda.set_device(local_rank) first, or build it there"
            )
    elif backend == "gloo" and device.type != "cpu":
        return f"a gloo group moves CPU tensors, this layer is on {device}; use an NCCL group for CUDA"
    return None


_NO_FINGERPRINT = -(1 << 62)


def check_same_layer(
    parallel: Parallel,
    spec: MoESpec | None,
    device: torch.device | None,
    *,
    refused: MoekitError | None = None,
) -> None:
    """Every rank of `parallel.group` builds the same global layer in the same mode, each on a device its
    backend serves, from arguments it did not refuse: one all-reduce of a fingerprint of (mode, engine,
    global spec: every field, routing parameters included), of a device flag and of `refused`'s code
    (`moekit.parallel.agreement`: this rank's own arguments, checked before), at construction. Ranks
    holding different layers (another checkpoint layer, another preset) would otherwise exchange tokens
    of mismatched shapes or sum unrelated partial outputs, and a rank refusing alone would leave the
    others waiting in a collective: every rank raises (`DeviceError`, `SpecError`, `refused`'s type).
    A rank refused before it had a spec or device (a checkpoint it could not read) passes None for them:
    it joins with `refused` only, and the others' layers are still compared among themselves."""
    engine = None if parallel.engine is None else parallel.engine.value
    whole = None if spec is None else replace(spec, num_local_experts=None)
    # repr, not describe(): it names every field (renormalize, scaling factor, groups, clamp ...)
    fingerprint = zlib.crc32(f"{parallel.mode.value}|{engine}|{whole!r}".encode())
    if whole is None:  # below every crc32 and its negation: leaves the group's MAX of both to the others
        fingerprint = _NO_FINGERPRINT
    backend = str(dist.get_backend(parallel.group))
    problem = None if device is None else device_problem(backend, device)
    where = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    state = [fingerprint, -fingerprint if whole is not None else _NO_FINGERPRINT]
    state += [problem is not None, refusal_code(refused)]
    state = torch.tensor(state, dtype=torch.int64, device=where)
    dist.all_reduce(state, op=dist.ReduceOp.MAX, group=parallel.group)
    largest, negated_smallest, any_problem, code = state.tolist()
    if any_problem:
        raise DeviceError(
            f"Parallel.{parallel.mode.value}: "
            + (problem or "a device problem on another rank of this group; see that rank's error")
        )
    if whole is not None and largest != -negated_smallest:
        raise SpecError(
            f"Parallel.{parallel.mode.value}: the ranks of this group built different layers (this rank: "
            f"{whole.describe()}, {whole.routing}, engine {engine}); build every rank's FusedMoE from the "
            "same spec, checkpoint layer and engine"
        )
    raise_refusal(code, refused, f"Parallel.{parallel.mode.value}")
