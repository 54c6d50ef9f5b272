"""Tensor parallelism on CPU: N gloo ranks spawned from pytest give the 1-rank layer's answer.

Data flow: pytest -> torch.multiprocessing.spawn(N ranks, a FileStore under tmp_path: no ports, so
xdist workers never collide) -> each rank builds the same global random layer, its TP share through
`FusedMoE(parallel=Parallel.tensor(group))` and the full 1-rank layer, runs the same tokens through both
(a TP group's activations are replicated) and compares them and the reference. Refusals (blocks split by
a shard) are checked inside the ranks, at construction. One spawn per group size keeps the file quick:
starting ranks costs more than the tiny layers.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from moekit import (
    Activation,
    ActivationSpec,
    Fp8Scale,
    FusedMoE,
    GateLayout,
    Parallel,
    ParallelMode,
    RoutingMethod,
    RoutingSpec,
    SpecError,
    UnsupportedSpecError,
    WeightFormat,
    fused_moe_reference,
    preset,
    route,
)
from moekit.errors import ArgumentError, DTypeError, NonFiniteError, ShapeError
from moekit.parallel import tensor_shard
from moekit.synthetic import random_layer, random_tokens
from spawn_ranks import run_on_ranks

# H and I are multiples of 32 * 4 where a format has blocks, so 2 and 4 ranks both shard.
GPT_OSS_SMALL = replace(
    preset("gpt-oss-20b", act_dtype=torch.float32), num_experts=8, hidden_size=64, intermediate_size=128
)
QWEN3_SMALL = replace(preset("qwen3-30b-a3b"), num_experts=8, top_k=2, hidden_size=64, intermediate_size=64)
FP8_BLOCK = replace(
    QWEN3_SMALL,
    num_experts=4,
    hidden_size=128,
    intermediate_size=128,  # times N below: I/N = 128, one scale block per rank
    weight_format=WeightFormat.FP8_E4M3,
    fp8_scale=Fp8Scale.BLOCK_128,
    act_dtype=torch.float32,
)
FP8_CHANNEL_INTERLEAVED = replace(
    QWEN3_SMALL,
    weight_format=WeightFormat.FP8_E4M3,
    fp8_scale=Fp8Scale.PER_CHANNEL,
    act_dtype=torch.float32,
    gate_layout=GateLayout.INTERLEAVED,
    has_bias=True,
    activation=ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0),
    routing=RoutingSpec(RoutingMethod.TOPK_SOFTMAX),
)


def _cases(world: int) -> dict[str, tuple]:
    """name -> (global spec, tolerance)."""
    return {
        "gpt-oss-mxfp4": (GPT_OSS_SMALL, 1e-5),
        "qwen3-bf16-concat": (QWEN3_SMALL, 2e-2),
        "fp8-block128": (replace(FP8_BLOCK, intermediate_size=128 * world), 1e-5),
        "fp8-channel-interleaved-bias": (FP8_CHANNEL_INTERLEAVED, 1e-5),
    }


def _check_case(spec, tol: float, parallel: Parallel) -> None:
    layer = random_layer(spec, seed=3)
    common = dict(weights=layer.weights, router_weight=layer.router_weight)
    one = FusedMoE(spec=spec, **common)
    tp = FusedMoE(spec=spec, parallel=parallel, **common)
    assert tp.spec.I == spec.I // parallel.world_size and tp.spec.E == spec.E
    x = random_tokens(spec, 37, seed=5)  # the same tokens on every rank
    got = tp(x)
    torch.testing.assert_close(got, one(x), rtol=tol, atol=tol)
    logits = torch.nn.functional.linear(x.float(), layer.router_weight.float())
    routing = route(logits, top_k=spec.K, spec=spec.routing)
    ref = fused_moe_reference(x, layer.weights, routing, spec=spec)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert tp(x[:0]).shape == (0, spec.H)  # an empty batch still joins the all-reduce


def _check_refusals(parallel: Parallel, world: int) -> None:
    mxfp4 = replace(GPT_OSS_SMALL, intermediate_size=48 * world)  # I/N = 48: splits a 32-block
    fp8 = replace(FP8_BLOCK, intermediate_size=64 * world)  # I/N = 64: splits a 128 block
    for spec, block in ((mxfp4, "multiple of 32"), (fp8, "multiple of 128")):
        layer = random_layer(spec, seed=3)
        with pytest.raises(UnsupportedSpecError, match=block):
            FusedMoE(spec=spec, weights=layer.weights, router_weight=layer.router_weight, parallel=parallel)
    expert = Parallel.expert(parallel.group)
    assert expert.mode is ParallelMode.EXPERT and expert.world_size == world


def _check_one_rank_refused(parallel: Parallel, rank: int) -> None:
    """One rank's NaN logits, another token count, a wrong dtype or no tokens: every rank raises that
    error type (tensor parallelism replicates tokens; none is left waiting in the all-reduce), and the
    group goes on."""
    spec = QWEN3_SMALL
    layer = random_layer(spec, seed=3)
    tp = FusedMoE(spec=spec, weights=layer.weights, router_weight=layer.router_weight, parallel=parallel)
    x = random_tokens(spec, 5, seed=5)
    logits = torch.nn.functional.linear(x.float(), layer.router_weight.float())
    nan = logits.clone()
    nan[2, 1] = float("nan")
    cases = (
        (NonFiniteError, r"at \[token 2, expert 1\]", dict(hidden_states=x, router_logits=nan)),
        (ShapeError, "passed 4 to 5 tokens", dict(hidden_states=x[:4])),
        (ShapeError, "passed 0 to 5 tokens", dict(hidden_states=x[:0])),
        (DTypeError, "hidden_states have dtype", dict(hidden_states=x.float())),
    )
    for error, own, bad in cases:
        with pytest.raises(error, match=own if rank == 1 else "another rank|passed"):
            tp(**(bad if rank == 1 else dict(hidden_states=x)))
    assert torch.isfinite(tp(x)).all()  # the collectives are still matched


def _rank_main(rank: int, world: int) -> None:
    parallel = Parallel.tensor(dist.group.WORLD)
    assert (parallel.rank, parallel.world_size, parallel.mode) == (rank, world, ParallelMode.TENSOR)
    for name, (spec, tol) in _cases(world).items():
        try:
            _check_case(spec, tol, parallel)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} of {world}, case {name}: {e}") from e
    _check_refusals(parallel, world)
    _check_one_rank_refused(parallel, rank)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_one_rank(world: int, tmp_path) -> None:
    run_on_ranks(_rank_main, world, tmp_path)


def test_parallel_needs_initialized_distributed_and_a_group() -> None:
    assert not dist.is_initialized()  # pytest's process never joins a group; ranks are spawned
    with pytest.raises(SpecError, match="init_process_group"):
        Parallel.tensor(None)
    with pytest.raises(ArgumentError, match="mode"):
        Parallel("tensor", None)


def test_tensor_shard_slices_consistently_for_both_gate_layouts() -> None:
    """Concatenating every rank's w13 rows (per gate layout), w2 columns and b13 gives the whole layer;
    b2 is on rank 0 only."""
    for layout in GateLayout:
        spec = replace(QWEN3_SMALL, gate_layout=layout, has_bias=True, act_dtype=torch.float32)
        w = random_layer(spec, seed=1).weights
        shards = [tensor_shard(spec, w, rank=r, world_size=4)[1] for r in range(4)]
        if layout is GateLayout.CONCAT:  # each shard is [gate slice; up slice]
            gate = torch.cat([s.w13[:, :16] for s in shards], dim=1)
            up = torch.cat([s.w13[:, 16:] for s in shards], dim=1)
            assert torch.equal(torch.cat([gate, up], dim=1), w.w13)
        else:  # each shard is a contiguous run of (gate, up) pairs
            assert torch.equal(torch.cat([s.w13 for s in shards], dim=1), w.w13)
        assert torch.equal(torch.cat([s.w2 for s in shards], dim=2), w.w2)
        assert torch.equal(shards[0].b2, w.b2) and all(not s.b2.any() for s in shards[1:])
    with pytest.raises(UnsupportedSpecError, match=r"N in \[1, 2, 4, 8"):
        tensor_shard(QWEN3_SMALL, random_layer(QWEN3_SMALL).weights, rank=0, world_size=3)
