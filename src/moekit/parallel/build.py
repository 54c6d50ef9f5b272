"""The parallel part of building and warming up a `FusedMoE`: this rank's share, checked, agreed on by
the group before any rank goes on.

Data flow: (parallel, global spec, weights, expert map, router tensors, device) -> `layer_share`: this
rank's share (`shard_for`) and its own tensors checked (`moekit.checks.check_layer_tensors`), a
refusal kept -> `check_same_layer`: one all-reduce; every rank raises when any rank refused its
arguments or device or built another layer -> the share. `agree_warmup`: the group's largest warmup
count, in one all-reduce. A rank refusing alone would leave its peers, built, waiting in their first
collective."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from moekit.checks import check_layer_tensors
from moekit.errors import MoekitError
from moekit.parallel.agreement import raise_refusal, refusal_code
from moekit.parallel.shard import shard_for
from moekit.parallel.spec import Parallel, check_same_layer
from moekit.spec import MoESpec
from moekit.weights import ExpertWeights

Share = tuple[MoESpec, ExpertWeights, torch.Tensor | None]


def layer_share(
    parallel: Parallel,
    spec: MoESpec,
    weights: ExpertWeights,
    expert_map: torch.Tensor | None,
    presharded: bool,
    router: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    device: torch.device,
) -> Share:
    """This rank's (local spec, weights, expert map), once every rank of the group accepted its own
    arguments and all built the same layer on devices their backend serves (module docstring).
    `router`: (router weight, router bias, correction bias)."""
    refused = share = None
    try:
        share = shard_for(parallel, spec, weights, expert_map, presharded=presharded)
        check_layer_tensors(*share[:2], *router)
    except MoekitError as err:
        refused = err
    check_same_layer(parallel, spec, device, refused=refused)  # raises on every rank, or on none
    return share


def agree_warmup(
    parallel: Parallel, max_tokens: object, execute: bool, refused: MoekitError | None, device: torch.device
) -> tuple[int, bool]:
    """(the group's largest `max_tokens`, whether any rank executes): ranks warming up to different
    counts would run different numbers of forwards, the extra ones waiting in a collective. One
    all-reduce; a rank whose `max_tokens` was refused makes every rank raise."""
    state = [0 if refused else max_tokens, bool(execute), refusal_code(refused)]
    state = torch.tensor(state, dtype=torch.int64, device=device)
    dist.all_reduce(state, op=dist.ReduceOp.MAX, group=parallel.group)
    largest, any_execute, code = state.tolist()
    raise_refusal(code, refused, "FusedMoE.warmup")
    return largest, bool(any_execute)


@contextmanager
def refused_in_construction(parallel: Parallel | None) -> Iterator[None]:
    """Around what a rank does before it has a layer to agree on (reading its checkpoint share): a moekit
    error raised inside joins the group's construction agreement (`check_same_layer`, which the peers
    reach with their layers) before it propagates, so every rank raises it."""
    try:
        yield
    except MoekitError as refused:
        if parallel is not None:
            check_same_layer(parallel, None, None, refused=refused)
        raise
