"""Batch invariance, planning side: `plan_batch_invariant` gives every token bucket one kernel and config.

Data flow: preset specs -> `plan_batch_invariant` for a fake H200 (planning reads no device) at every
bucket 1 ... 16384 -> one config, no split-K, no tail blocks, and `explain` says so; the default plans of
the same buckets differ (the test is not vacuous). CPU: no kernel can promise it, and the layer says so
when it is built. The router's fixed-shape matmuls give each row the same bits at every T. On CUDA the
routing is per token for every method up to the one-launch route's E bound; a wider router is refused.
"""

from __future__ import annotations

import pytest
import torch

from moekit import MoESpec, SpecError, UnsupportedSpecError, preset
from moekit.kernels.base import DeviceInfo, DeviceKind
from moekit.layer import FusedMoE, PlanOptions
from moekit.planning.plan import batch_invariant_tokens, plan, plan_batch_invariant
from moekit.presets import reshaped
from moekit.router import batch_invariant_routing_reason, compute_router_logits
from moekit.synthetic import random_layer

pytest.importorskip("triton")
from moekit.kernels.triton.route import MAX_EXPERTS  # noqa: E402

H200 = DeviceInfo(DeviceKind.CUDA, "NVIDIA H200", (9, 0))
BUCKETS = tuple(2**i for i in range(15))
PRESETS = ("gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")


@pytest.mark.parametrize("name", PRESETS)
def test_every_bucket_gets_one_config_without_split_k_or_tail_blocks(name: str) -> None:
    spec = preset(name)
    plans = [plan_batch_invariant(spec, num_tokens=t, device=H200) for t in BUCKETS]
    assert {(p.kernel, p.config) for p in plans} == {(plans[0].kernel, plans[0].config)}
    assert plans[0].kernel == "triton_fused"
    assert plans[0].config.split_k == 1 and plans[0].config.tail_block_m is None
    assert all(p.batch_invariant and p.invariant_tokens == batch_invariant_tokens(spec) for p in plans)
    assert [p.bucket for p in plans] == list(BUCKETS)
    assert "batch-invariant: yes" in plans[-1].explain()
    default = {plan(spec, num_tokens=t, device=H200).config for t in BUCKETS}
    assert len(default) > 1  # without the option the tiles change with T
    assert "batch-invariant" not in plan(spec, num_tokens=1, device=H200).explain()


def test_anchor_is_32_tokens_per_expert() -> None:
    assert batch_invariant_tokens(preset("gpt-oss-20b")) == 256  # 32 * 32 / 4
    assert batch_invariant_tokens(preset("qwen3-30b-a3b")) == 512  # 32 * 128 / 8
    assert batch_invariant_tokens(preset("mixtral-8x7b")) == 128  # 32 * 8 / 2


def test_cpu_has_no_batch_invariant_kernel_and_the_layer_says_so_when_built() -> None:
    spec = preset("qwen3-30b-a3b", act_dtype=torch.float32)
    with pytest.raises(UnsupportedSpecError, match="batch_invariant=True: no kernel"):
        plan_batch_invariant(spec, num_tokens=8, device="cpu")
    small = random_layer(MoESpec(num_experts=4, top_k=2, hidden_size=32, intermediate_size=32))
    with pytest.raises(UnsupportedSpecError, match="batch_invariant"):
        FusedMoE(
            spec=small.spec,
            weights=small.weights,
            router_weight=small.router_weight,
            options=PlanOptions(batch_invariant=True),
        )


def test_option_must_be_a_bool() -> None:
    with pytest.raises(SpecError, match="PlanOptions.batch_invariant must be a bool, got 'yes'"):
        PlanOptions(batch_invariant="yes")
    assert PlanOptions().batch_invariant is False


def test_routing_on_cuda_is_per_token_up_to_the_widest_triton_route() -> None:
    """On CUDA every routing method up to the one-launch route's MAX_EXPERTS runs one token a program
    (DeepSeek-V3's grouped sigmoid included); a wider router would run on the torch twin, whose
    reductions are tiled by T, and is refused with a reason that names its method and E."""
    cuda = torch.device("cuda", 0)
    grouped = preset("deepseek-v3")
    assert batch_invariant_routing_reason(grouped, cuda) is None
    assert batch_invariant_routing_reason(reshaped(grouped, f"{MAX_EXPERTS}x8x7168x2048"), cuda) is None
    assert batch_invariant_routing_reason(preset("gpt-oss-20b"), cuda) is None
    wide_grouped = reshaped(grouped, "2048x8x7168x2048")  # still 8 groups (of 256), 4 kept
    wide_softmax = reshaped(preset("qwen3-30b-a3b"), "2048x8x2048x768")
    assert wide_grouped.routing.n_group == 8 and wide_grouped.routing.has_correction_bias
    for wide in (wide_grouped, wide_softmax):
        why = batch_invariant_routing_reason(wide, cuda)
        assert why is not None and f"{wide.routing.method.name} with E=2048" in why, why
        assert batch_invariant_routing_reason(wide, torch.device("cpu")) is None


def test_batch_invariant_router_rows_do_not_depend_on_t() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(24, generator=gen).to(torch.bfloat16)
    token = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    alone = compute_router_logits(token, weight, bias, batch_invariant=True)
    expected = torch.nn.functional.linear(token.float(), weight.float(), bias.float())
    torch.testing.assert_close(alone, expected, rtol=1e-6, atol=1e-6)
    for num_tokens in (7, 256, 300, 1000):
        others = torch.randn(num_tokens, 96, generator=gen).to(torch.bfloat16)
        for pos in (0, num_tokens // 2, num_tokens - 1):
            batch = others.clone()
            batch[pos] = token[0]
            got = compute_router_logits(batch, weight, bias, batch_invariant=True)
            assert got.shape == (num_tokens, 24)
            assert torch.equal(got[pos], alone[0]), (num_tokens, pos)
