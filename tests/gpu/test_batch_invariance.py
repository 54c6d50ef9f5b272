"""`PlanOptions(batch_invariant=True)` on a CUDA GPU: a token's output is bitwise independent of the batch.

Data flow per preset (gpt-oss-20b MXFP4 and qwen3-30b-a3b bf16, both full size; deepseek-v3 FP8 with E
capped at 64, which keeps its 8 groups of which 4 are kept, so that the grouped sigmoid routing with its
correction bias runs as the one-launch Triton route): one random layer -> a batch-invariant `FusedMoE`
(router included) -> one fixed token alone (T = 1), then placed first, in the middle and last among
T = 7, 64, 300, 2048 other random tokens -> its output row bitwise equal to the T = 1 row every time; the
plans of those T share one config while the default plans do not (the test is not vacuous); the output
is within the spec's tolerance of the fp32 reference.
Expected runtime on an H200: about 40 s for gpt-oss-20b and qwen3-30b-a3b (a handful of Triton compiles
per preset), plus the DeepSeek-V3 case's FP8 compiles.
"""

from __future__ import annotations

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from moekit import MoESpec, RoutingMethod, fused_moe_reference, preset, route  # noqa: E402
from moekit.layer import FusedMoE, PlanOptions  # noqa: E402
from moekit.presets import cap_experts  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.router import batch_invariant_routing_reason, compute_router_logits  # noqa: E402
from moekit.synthetic import SyntheticLayer, random_layer  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda", torch.cuda.current_device())
TOKENS = (7, 64, 300, 2048)
# E capped as `benchmarks/bench_batch_invariant.py --max-experts 64` runs DeepSeek-V3: 64 FP8 experts
# (2.8 GB against 11.3 for 256; the reference dequantizes each expert it runs) still route by 8 groups of 8,
# 4 kept, K = 8, with the correction bias.
CAPPED_EXPERTS = {"deepseek-v3": 64}


def _spec(name: str) -> MoESpec:
    return cap_experts(preset(name), CAPPED_EXPERTS.get(name))


def _layer(spec: MoESpec, layer: SyntheticLayer, *, batch_invariant: bool) -> FusedMoE:
    return FusedMoE(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        correction_bias=layer.correction_bias,
        device=DEVICE,
        options=PlanOptions(batch_invariant=batch_invariant),
    )


def test_the_grouped_routing_runs_as_the_per_token_triton_route() -> None:
    """DeepSeek-V3's capped spec still routes by groups with a correction bias, and on CUDA that routing is
    the one-launch route (not the torch twin, whose reductions are tiled by T)."""
    spec = _spec("deepseek-v3")
    assert spec.E == 64 and spec.K == 8 and spec.routing.method is RoutingMethod.SIGMOID_GROUPED
    assert (spec.routing.n_group, spec.routing.topk_group, spec.routing.has_correction_bias) == (8, 4, True)
    assert batch_invariant_routing_reason(spec, DEVICE) is None


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-30b-a3b", "deepseek-v3"])
def test_a_tokens_output_is_bitwise_independent_of_the_batch(name: str) -> None:
    spec = _spec(name)
    layer = random_layer(spec, seed=0, device=DEVICE)
    moe = _layer(spec, layer, batch_invariant=True)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    token = torch.randn(1, spec.H, generator=gen, device=DEVICE).to(spec.act_dtype)
    mismatches = []
    with torch.no_grad():
        alone = moe(token)[0].clone()
        for t in TOKENS:
            others = torch.randn(t, spec.H, generator=gen, device=DEVICE).to(spec.act_dtype)
            for pos in (0, t // 2, t - 1):
                batch = others.clone()
                batch[pos] = token[0]
                got = moe(batch)[pos]
                if not torch.equal(got, alone):
                    diff = (got.float() - alone.float()).abs()
                    mismatches.append((t, pos, int((diff > 0).sum()), float(diff.max())))
            if t == 300:  # the invariant config still computes the layer
                logits = compute_router_logits(batch, moe.router_weight, None, batch_invariant=True)
                routing = route(
                    logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias
                )
                expected = fused_moe_reference(batch, layer.weights, routing, spec=spec)
                err = relative_l2_error(moe(batch), expected)
                assert err <= tolerance(spec), err
    assert not mismatches, f"(T, position, elements differing, max |diff|): {mismatches}"
    configs = {moe.plan_for(t).config for t in (1, *TOKENS)}
    assert len(configs) == 1 and all(moe.plan_for(t).batch_invariant for t in TOKENS)
    assert "batch-invariant: yes" in moe.explain()
    default = _layer(spec, layer, batch_invariant=False)
    assert len({default.plan_for(t).config for t in (1, *TOKENS)}) > 1
