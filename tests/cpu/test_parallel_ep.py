"""Expert parallelism in FusedMoE on CPU: N gloo ranks, each with its own tokens, give the 1-rank layer.

Data flow: pytest -> torch.multiprocessing.spawn(N ranks, a FileStore under tmp_path: no ports) -> every
rank builds the same global random layer, its EP share through `FusedMoE(parallel=Parallel.expert(group,
engine=...))` and the full 1-rank layer -> runs its own uneven token batch (one rank empty) through both
and the reference -> compares within the reference tolerance, and checks the share holds only E_r
experts. One spawn per group size: starting ranks costs more than the tiny layers.
"""

import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from moekit import EpEngine, FusedMoE, Parallel, fused_moe_reference, preset, route
from moekit.ep.ownership import expert_ownership, local_expert_map
from moekit.errors import ArgumentError, DeviceError, DTypeError, NonFiniteError, ShapeError, SpecError
from moekit.parallel import expert_shard
from moekit.parallel.expert import ExpertParallel
from moekit.planning.tuned import token_bucket
from moekit.reference import relative_l2_error, tolerance
from moekit.synthetic import random_layer, random_tokens
from spawn_ranks import run_on_ranks

GPT_OSS_SMALL = replace(
    preset("gpt-oss-20b", act_dtype=torch.float32), num_experts=8, hidden_size=64, intermediate_size=64
)
QWEN3_SMALL = replace(preset("qwen3-30b-a3b"), num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
ENGINES = (*EpEngine, None)  # None: chosen per bucket


def _specs(world: int) -> dict[str, object]:
    odd = 7 if world == 2 else 6  # E not divisible by N
    return {
        "gpt-oss-mxfp4": GPT_OSS_SMALL,
        "gpt-oss-mxfp4-uneven-E": replace(GPT_OSS_SMALL, num_experts=odd),
        "qwen3-bf16-concat-uneven-E": replace(QWEN3_SMALL, num_experts=odd),
    }


def _check_case(spec, parallel: Parallel, counts: list[int], seed: int) -> None:
    rank, world = parallel.rank, parallel.world_size
    layer = random_layer(spec, seed=seed)
    common = dict(weights=layer.weights, router_weight=layer.router_weight)
    ep = FusedMoE(spec=spec, parallel=parallel, **common)
    owned = expert_ownership(spec.E, world)[rank]
    assert ep.spec.E_local == len(owned) and ep.spec.E == spec.E
    assert all(t.shape[0] == len(owned) for t in ep.weights.tensors().values())
    assert torch.equal(ep.weights.w13, layer.weights.w13[owned.start : owned.stop])
    assert torch.equal(ep.expert_map, local_expert_map(spec.E, rank, world))
    named = "chosen per bucket" if parallel.engine is None else parallel.engine.value
    assert f"engine {named}" in ep.explain()
    assert ep.warmup(4).plans  # one forward per bucket on every rank, local runs for the kernels
    x = random_tokens(spec, counts[rank], seed=seed * 10 + rank)  # this rank's own tokens
    got = ep(x)
    assert got.shape == x.shape and got.dtype == spec.act_dtype
    if parallel.engine is None:  # the choice for this forward's bucket of max T_r is shown
        assert f"M bucket {token_bucket(max(counts))}: " in ep.explain(), ep.explain()
    if counts[rank] == 0:
        return
    one = FusedMoE(spec=spec, **common)(x)
    logits = torch.nn.functional.linear(x.float(), layer.router_weight.float())
    ref = fused_moe_reference(x, layer.weights, route(logits, top_k=spec.K, spec=spec.routing), spec=spec)
    tol = tolerance(spec)
    assert relative_l2_error(got, one) < tol, relative_l2_error(got, one)
    assert relative_l2_error(got, ref) < tol, relative_l2_error(got, ref)


def _check_refusals(group, world: int) -> None:
    spec = _specs(world)["qwen3-bf16-concat-uneven-E"]
    layer = random_layer(spec, seed=1)
    common = dict(spec=spec, weights=layer.weights, router_weight=layer.router_weight)
    with pytest.raises(ArgumentError, match="expert_map"):
        FusedMoE(
            **common, expert_map=torch.arange(spec.E, dtype=torch.int32), parallel=Parallel.expert(group)
        )
    with pytest.raises(ArgumentError, match="EpEngine"):
        Parallel.expert(group, engine="all_to_all")  # a string, not the enum
    with pytest.raises(ArgumentError, match="tensor parallelism moves no tokens"):
        Parallel(Parallel.tensor(group).mode, group, EpEngine.ALL_TO_ALL)


def _rank_main(rank: int, world: int) -> None:
    for engine in ENGINES:
        parallel = Parallel.expert(dist.group.WORLD, engine=engine)
        for n, (name, spec) in enumerate(_specs(world).items()):
            counts = [(5 * r + 3 * n) % 11 + 1 for r in range(world)]  # uneven
            counts[n % world] = 0  # one rank without tokens
            try:
                _check_case(spec, parallel, counts, seed=n + 1)
            except AssertionError as e:
                raise AssertionError(f"rank {rank} of {world}, {engine}, {name}, {counts}: {e}") from e
        empty = FusedMoE(
            spec=GPT_OSS_SMALL,
            weights=random_layer(GPT_OSS_SMALL).weights,
            router_weight=None,
            parallel=parallel,
        )
        x = random_tokens(GPT_OSS_SMALL, 0)
        assert empty(x, router_logits=torch.zeros(0, GPT_OSS_SMALL.E)).shape == (0, GPT_OSS_SMALL.H)
    _check_refusals(dist.group.WORLD, world)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_rank(world: int, tmp_path) -> None:
    run_on_ranks(_rank_main, world, tmp_path)


def test_expert_shard_keeps_only_owned_experts_and_refuses_a_local_spec() -> None:
    spec = replace(QWEN3_SMALL, num_experts=7, has_bias=True)
    w = random_layer(spec, seed=2).weights
    shards = [expert_shard(spec, w, rank=r, world_size=3) for r in range(3)]
    assert [s.E_local for s, _, _ in shards] == [3, 2, 2]
    for name, t in w.tensors().items():
        assert torch.equal(torch.cat([getattr(sw, name) for _, sw, _ in shards]), t), name
    assert shards[1][2].tolist() == [-1, -1, -1, 0, 1, -1, -1]
    local = replace(spec, num_local_experts=7)
    with pytest.raises(SpecError, match="num_local_experts"):
        expert_shard(local, w, rank=0, world_size=2)
    with pytest.raises(SpecError, match="at least one expert per rank"):
        expert_shard(spec, w, rank=0, world_size=8)


def _check_choice(rank: int, world: int) -> None:
    """The model picks all-gather/reduce-scatter where latency rules and all-to-all where bytes do (many
    ranks, few of them per token), the same on every rank; a named engine is kept."""
    spec = replace(QWEN3_SMALL, top_k=1, hidden_size=4096)
    auto = ExpertParallel(Parallel.expert(dist.group.WORLD), spec)
    small, large = auto.choice_for(1), auto.choice_for(1 << 16)
    assert small.engine is EpEngine.ALLGATHER_REDUCESCATTER and not small.forced, small.describe()
    assert large.engine is EpEngine.ALL_TO_ALL, large.describe()
    named = ExpertParallel(Parallel.expert(dist.group.WORLD, engine=EpEngine.ALL_TO_ALL), spec)
    assert named.choice_for(1).engine is EpEngine.ALL_TO_ALL and named.choice_for(1).forced


def test_engine_choice_follows_the_cost_model(tmp_path) -> None:
    run_on_ranks(_check_choice, 4, tmp_path)


def _check_non_finite(rank: int, world: int) -> None:
    """NaN logits on one rank: every rank raises (none left waiting in a collective), and the group goes
    on serving; with value checks off, only that token's row is NaN. Then inputs refused on one rank."""
    spec = QWEN3_SMALL
    layer = random_layer(spec, seed=4)
    for engine in ENGINES:
        ep = FusedMoE(
            spec=spec,
            weights=layer.weights,
            router_weight=layer.router_weight,
            parallel=Parallel.expert(dist.group.WORLD, engine=engine),
        )
        x = random_tokens(spec, 3 + rank, seed=rank)
        logits = torch.randn(x.shape[0], spec.E)
        bad = logits.clone()
        if rank == 0:
            bad[1, 2] = float("nan")
        own = "at [token 1, expert 2]" if rank == 0 else "another rank"
        with pytest.raises(NonFiniteError, match=re.escape(own)):
            ep(x, router_logits=bad)
        assert torch.isfinite(ep(x, router_logits=logits)).all()  # the collectives are still matched
        ep.check_values = False
        out = ep(x, router_logits=bad)
        finite_rows = torch.isfinite(out).all(dim=1).tolist()
        assert finite_rows == [not (rank == 0 and t == 1) for t in range(x.shape[0])], (engine, finite_rows)
        _check_refused_inputs(rank, layer, engine)


def _check_refused_inputs(rank: int, layer, engine) -> None:
    """Inputs refused on rank 1 only (hidden size, dtype, logits shape), with value checks on and off:
    every rank raises that error type (none left waiting in a collective), and the group goes on."""
    spec = QWEN3_SMALL
    ep = FusedMoE(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        parallel=Parallel.expert(dist.group.WORLD, engine=engine),
    )
    x = random_tokens(spec, 3, seed=rank)
    bad_inputs = (
        (ShapeError, "hidden_states must be", dict(hidden_states=x[:, :32])),
        (DTypeError, "hidden_states have dtype", dict(hidden_states=x.float())),
        (ShapeError, "router_logits must be", dict(hidden_states=x, router_logits=torch.randn(3, 9))),
    )
    for check_values in (True, False):
        ep.check_values = check_values
        for error, own, bad in bad_inputs:
            with pytest.raises(error, match="another rank" if rank == 0 else own):
                ep(**(bad if rank == 1 else dict(hidden_states=x)))
    ep.check_values = rank == 0  # set differently on the ranks: the collectives still pair
    assert torch.isfinite(ep(x)).all()
    ep.warmup(1 + 3 * rank)  # different counts: every rank warms up to the largest, none waits


@pytest.mark.timeout(120)  # a rank left waiting in a collective would hang here
def test_non_finite_logits_on_one_rank_raise_on_every_rank(tmp_path) -> None:
    run_on_ranks(_check_non_finite, 2, tmp_path)


def _check_mismatch(rank: int, world: int) -> None:
    """Ranks that build different layers (another intermediate size, or routing parameters that the
    spec's summary leaves out, on rank 1) all raise at construction, for both modes, instead of
    exchanging mismatched rows later; so do they when one rank's own arguments are refused."""
    routing = replace(QWEN3_SMALL.routing, renormalize=not QWEN3_SMALL.routing.renormalize)
    for other in (replace(QWEN3_SMALL, intermediate_size=64), replace(QWEN3_SMALL, routing=routing)):
        spec = QWEN3_SMALL if rank == 0 else other
        layer = random_layer(spec, seed=9)
        for parallel in (Parallel.expert(dist.group.WORLD), Parallel.tensor(dist.group.WORLD)):
            with pytest.raises(SpecError, match="built different layers"):
                FusedMoE(
                    spec=spec, weights=layer.weights, router_weight=layer.router_weight, parallel=parallel
                )
    layer = random_layer(QWEN3_SMALL, seed=9)
    refused = (
        (ArgumentError, "expert_map", dict(expert_map=torch.arange(QWEN3_SMALL.E, dtype=torch.int32))),
        (ShapeError, "router_weight has shape", dict(router_weight=layer.router_weight[:, :32])),
        (ShapeError, "w2 has shape", dict(weights=replace(layer.weights, w2=layer.weights.w2[..., :16]))),
        (DeviceError, "gpu0", dict(device="gpu0")),  # refused before the layer has a device to agree on
        (SpecError, "options must be PlanOptions", dict(options="fast")),
    )
    for error, own, bad in refused:
        args = dict(spec=QWEN3_SMALL, weights=layer.weights, router_weight=layer.router_weight)
        with pytest.raises(error, match=own if rank == 1 else "another rank"):
            FusedMoE(**(args | bad if rank == 1 else args), parallel=Parallel.expert(dist.group.WORLD))
    # A group of rank 0 alone (made by a collective of the whole world): rank 1 is not a member, and rank 0
    # then destroys it. The check builds no second two-rank group: gloo's TCP full mesh between spawned
    # ranks on a loaded 2-core machine can fail with "connection closed by peer", and the check needs none.
    only_rank_0 = dist.new_group([0])
    if rank == 1:
        with pytest.raises(SpecError, match="not a member"):
            Parallel.expert(only_rank_0)
    else:
        dist.destroy_process_group(only_rank_0)
        with pytest.raises(ArgumentError, match="destroyed"):
            Parallel.tensor(only_rank_0)


@pytest.mark.timeout(120)
def test_ranks_building_different_layers_are_refused_on_every_rank(tmp_path) -> None:
    run_on_ranks(_check_mismatch, 2, tmp_path)


def _check_device(rank: int, world: int) -> None:
    """A rank whose layer sits on a device its backend cannot move (CUDA with gloo) makes every rank
    raise DeviceError at construction; the others are told to look at that rank."""
    layer = random_layer(QWEN3_SMALL, seed=9)
    device = torch.device("cuda", 0) if rank == 1 else torch.device("cpu")
    expected = "gloo group moves CPU tensors" if rank == 1 else "another rank"
    for parallel in (Parallel.expert(dist.group.WORLD), Parallel.tensor(dist.group.WORLD)):
        with pytest.raises(DeviceError, match=expected):
            FusedMoE(
                spec=QWEN3_SMALL,
                weights=layer.weights,
                router_weight=layer.router_weight,
                device=device,
                parallel=parallel,
            )


@pytest.mark.timeout(120)
def test_a_device_the_backend_cannot_serve_is_refused_on_every_rank(tmp_path) -> None:
    run_on_ranks(_check_device, 2, tmp_path)
