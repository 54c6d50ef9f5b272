"""Eight gloo ranks: the parallel layer at DeepSeek-V3's and gpt-oss-120b's expert-parallel group sizes.

Data flow: pytest -> 8 ranks (tests/spawn_ranks.py) -> per spec (DeepSeek-V3's math: FP8 block-128 weights
and activations, grouped sigmoid routing with a correction bias, K = 8; gpt-oss-120b's: MXFP4, SwiGLU with
clamp, interleaved rows, biases, K = 4; E = 16, so each rank holds 2 experts) -> a global batch drawn the
same on every rank -> EP (engine chosen per bucket, then each engine named): each rank its own uneven
slice, one rank empty -> TP where the sizes allow (gpt-oss: I / 8 = 32, one MXFP4 block; DeepSeek's FP8
block-128 I / 8 is refused, with the group sizes that fit) -> every rank's rows against the 1-rank layer,
within `tolerance(spec)`. Small sizes: 8 processes share the CI machine's cores.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from moekit import EpEngine, FusedMoE, Parallel, UnsupportedSpecError, preset
from moekit.reference import relative_l2_error, tolerance
from moekit.synthetic import random_layer, random_tokens
from spawn_ranks import run_on_ranks

WORLD = 8
DEEPSEEK_SMALL = replace(
    preset("deepseek-v3", act_dtype=torch.float32), num_experts=16, hidden_size=128, intermediate_size=128
)
GPT_OSS_SMALL = replace(
    preset("gpt-oss-120b", act_dtype=torch.float32), num_experts=16, hidden_size=64, intermediate_size=256
)
SPLIT = (3, 0, 5, 1, 7, 2, 4, 6)  # tokens of ranks 0..7: uneven, rank 1 empty


def _layers(spec):
    layer = random_layer(spec, seed=11)
    common = dict(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        correction_bias=layer.correction_bias,
    )
    return common, FusedMoE(**common)


def _check_expert_parallel(spec, rank: int) -> None:
    common, one = _layers(spec)
    x = random_tokens(spec, sum(SPLIT), seed=5)
    start = sum(SPLIT[:rank])
    want = one(x)[start : start + SPLIT[rank]]
    for engine in (None, *EpEngine):
        ep = FusedMoE(**common, parallel=Parallel.expert(dist.group.WORLD, engine=engine))
        assert ep.spec.E_local == spec.E // WORLD
        got = ep(x[start : start + SPLIT[rank]])
        assert got.shape == want.shape
        if SPLIT[rank]:
            err = relative_l2_error(got, want)
            assert err <= tolerance(spec), f"rank {rank}, EP {engine}: rel L2 {err:.2e}"


def _rank_main(rank: int, world: int) -> None:
    assert world == WORLD
    for spec in (DEEPSEEK_SMALL, GPT_OSS_SMALL):
        _check_expert_parallel(spec, rank)
    common, one = _layers(GPT_OSS_SMALL)
    tp = FusedMoE(**common, parallel=Parallel.tensor(dist.group.WORLD))
    x = random_tokens(GPT_OSS_SMALL, 9, seed=6)  # the same tokens on every rank
    err = relative_l2_error(tp(x), one(x))
    assert err <= tolerance(GPT_OSS_SMALL), f"rank {rank}, TP: rel L2 {err:.2e}"
    common, _ = _layers(DEEPSEEK_SMALL)
    with pytest.raises(UnsupportedSpecError, match="128"):
        FusedMoE(**common, parallel=Parallel.tensor(dist.group.WORLD))


@pytest.mark.timeout(300)
def test_eight_ranks_match_one(tmp_path) -> None:
    run_on_ranks(_rank_main, WORLD, tmp_path)
