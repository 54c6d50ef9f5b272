"""The expert-parallel forward of a `FusedMoE`: this rank's tokens to their experts' ranks and back.

Data flow: x_local [T_r, H] (any T_r, zero included) and its routing on GLOBAL expert ids (each rank
routes its own tokens on the full router) -> the group's token count M (below) -> the engine for M's
bucket (`EpChoice`: `Parallel.engine` when given, else the capable engine the cost model of
`moekit.ep.cost` predicts fastest with the shipped collective constants (`moekit.ep.constants`; the
one all-reduce of T that both engines pay in eager forwards is left out of the comparison), chosen once
per bucket and shown by `explain`) -> dispatch ->
`local_experts(x, routing)`: the layer's own plan and kernel for the received row count, with its expert
map, so other ranks' experts add nothing -> combine -> out_local.

M, the largest T_r of the group, must be the same on every rank (the engines' collectives are matched by
shape and order). Eager forwards agree on it with one all-reduce read on the host (a sync,
`moekit.parallel.agreement`: the same all-reduce makes every rank raise when any rank's inputs were
refused or its router logits are not finite, whatever the engine). While a CUDA
graph is being captured nothing may be read back, so M is this rank's T_r, and every rank must capture
at the same token count (pad to it, as serving engines pad data-parallel batches to one graph size); the
engine is then the capturable all-gather / reduce-scatter with static shapes. Every rank of the group must
call the layer for every forward (an empty batch included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.checks import capturing
from moekit.ep.constants import shipped_collectives
from moekit.ep.cost import predict_us
from moekit.ep.engines import ENGINES, EpEngine, LocalExperts, engine_for
from moekit.errors import UnsupportedSpecError
from moekit.parallel.agreement import agree
from moekit.parallel.spec import Parallel
from moekit.planning.tuned import token_bucket
from moekit.routing import RoutingResult
from moekit.spec import MoESpec


@dataclass(frozen=True)
class EpChoice:
    """The engine that moves one bucket's tokens, and why."""

    bucket: int  # of M, the group's largest per-rank token count
    engine: EpEngine
    forced: bool  # Parallel.engine named it
    predicted_us: tuple[tuple[EpEngine, float], ...]  # the model's communication time per capable engine
    refused: tuple[tuple[EpEngine, str], ...]  # engines that cannot run here, with the reason

    def describe(self) -> str:
        how = "named by Parallel.engine" if self.forced else "fastest by the cost model"
        model = ", ".join(f"{e.value} {us:.0f} us" for e, us in self.predicted_us)
        refused = "".join(f"; refused {e.value}: {why}" for e, why in self.refused)
        return f"M bucket {self.bucket}: {self.engine.value} ({how}; model: {model}){refused}"


def check_engine(parallel: Parallel) -> None:
    """Refuse, when the layer is built, an engine (or a group) no engine can serve."""
    backend = str(dist.get_backend(parallel.group))
    if parallel.engine is not None:
        if (why := engine_for(parallel.engine).capabilities.reason(backend)) is not None:
            raise UnsupportedSpecError(
                f"Parallel.engine={parallel.engine!r} cannot run here: {why}; pick another engine or backend"
            )
    elif all(e.capabilities.reason(backend) is not None for e in ENGINES.values()):
        raise UnsupportedSpecError(f"no expert-parallel engine runs on backend {backend!r}; use gloo or nccl")


class ExpertParallel:
    """One layer's expert-parallel state: the group, the global dims the cost model needs, the choices."""

    def __init__(self, parallel: Parallel, spec: MoESpec) -> None:
        check_engine(parallel)
        self.parallel = parallel
        self._spec = spec
        self._backend = str(dist.get_backend(parallel.group))
        self._choices: dict[int, EpChoice] = {}

    def choice_for(self, max_tokens: int) -> EpChoice:
        """The engine for a forward whose group-wide largest per-rank token count is `max_tokens`."""
        bucket = token_bucket(max_tokens)
        if (found := self._choices.get(bucket)) is not None:
            return found
        spec, world = self._spec, self.parallel.world_size
        predicted, refused = [], []
        for kind, engine in ENGINES.items():
            if (why := engine.capabilities.reason(self._backend)) is not None:
                refused.append((kind, why))
                continue
            us = predict_us(
                engine,
                tokens_per_rank=bucket,
                H=spec.H,
                K=spec.K,
                E=spec.E,
                world=world,
                act_bytes=spec.act_dtype.itemsize,
                constants=shipped_collectives(),
            )
            predicted.append((kind, us))
        forced = self.parallel.engine is not None
        engine = self.parallel.engine if forced else min(predicted, key=lambda p: p[1])[0]
        choice = EpChoice(bucket, engine, forced, tuple(predicted), tuple(refused))
        self._choices[bucket] = choice
        return choice

    def forward(
        self,
        x: torch.Tensor,
        routing: RoutingResult,
        local_experts: LocalExperts,
        *,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out_local [T_r, H] for this rank's tokens `x` routed to global experts (module docstring).

        `logits`: this rank's router logits when the layer checks values. A non-finite logit on any rank
        then raises `NonFiniteError` on every rank, after the one all-reduce they share (a rank raising
        alone would leave the others waiting in a collective)."""
        group = self.parallel.group
        if capturing(x):
            if self.parallel.engine not in (None, EpEngine.ALLGATHER_REDUCESCATTER):
                raise UnsupportedSpecError(
                    f"Parallel.engine={self.parallel.engine!r} reads split sizes on the host and cannot be "
                    "captured in a CUDA graph; capture with EpEngine.ALLGATHER_REDUCESCATTER or engine=None"
                )
            engine, max_tokens = EpEngine.ALLGATHER_REDUCESCATTER, x.shape[0]
        else:
            # Every eager forward agrees, whatever the engine and `check_values`: a rank skipping it would
            # pair its next collective with a peer's agreement (a hang), and a rank whose inputs were
            # refused joins it to make its peers raise too (`FusedMoE.forward`).
            agreement = agree(x.shape[0], logits, group=group, device=x.device)
            agreement.raise_for_group(logits, where="expert parallel", same_tokens=False)
            max_tokens = agreement.largest
            engine = self.choice_for(max_tokens).engine
            max_tokens = None if engine is EpEngine.ALL_TO_ALL else max_tokens
        return engine_for(engine).run(
            x,
            routing,
            group=group,
            local_experts=local_experts,
            num_experts=self._spec.E,
            max_tokens=max_tokens,
        )

    def routing_to_own_experts(self, rows: int, expert_map: torch.Tensor) -> RoutingResult:
        """`rows` tokens whose K experts cycle through this rank's own (for warming up its kernels)."""
        own = (expert_map >= 0).nonzero().flatten().to(torch.int32)
        k = self._spec.K
        ids = own[torch.arange(rows * k, device=own.device).remainder_(own.numel())].view(rows, k)
        return RoutingResult(weights=torch.full((rows, k), 1.0 / k, device=own.device), ids=ids)

    def explain(self) -> str:
        lines = [f"[parallel] {self.parallel.describe()}"]
        lines += [f"  {c.describe()}" for _, c in sorted(self._choices.items())]
        lines.append(
            "  captured in a CUDA graph: allgather_reducescatter at the captured T (the same on every rank)"
        )
        return "\n".join(lines)
