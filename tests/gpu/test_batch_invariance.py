"""`PlanOptions(batch_invariant=True)` on a CUDA GPU: a token's output is bitwise independent of the batch.

Data flow per preset (gpt-oss-20b MXFP4, qwen3-30b-a3b bf16, both full size): one random layer -> a
batch-invariant `FusedMoE` (router included) -> one fixed token alone (T = 1), then placed first, in the
middle and last among T = 7, 64, 300, 2048 other random tokens -> its output row bitwise equal to the
T = 1 row every time; the plans of those T share one config while the default plans do not (the test is
not vacuous); the output is within the bf16 tolerance of the fp32 reference.
Expected runtime on an H200: about 40 s (a handful of Triton compiles per preset).
"""

from __future__ import annotations

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from moekit import fused_moe_reference, preset, route  # noqa: E402
from moekit.layer import FusedMoE, PlanOptions  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.router import compute_router_logits  # noqa: E402
from moekit.synthetic import random_layer  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda", torch.cuda.current_device())
TOKENS = (7, 64, 300, 2048)


def _layer(name: str, *, batch_invariant: bool, layer=None) -> FusedMoE:
    spec = preset(name)
    layer = layer or random_layer(spec, seed=0, device=DEVICE)
    return FusedMoE(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        device=DEVICE,
        options=PlanOptions(batch_invariant=batch_invariant),
    )


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_a_tokens_output_is_bitwise_independent_of_the_batch(name: str) -> None:
    spec = preset(name)
    layer = random_layer(spec, seed=0, device=DEVICE)
    moe = _layer(name, batch_invariant=True, layer=layer)
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
                routing = route(logits, top_k=spec.K, spec=spec.routing)
                expected = fused_moe_reference(batch, layer.weights, routing, spec=spec)
                err = relative_l2_error(moe(batch), expected)
                assert err <= tolerance(spec), err
    assert not mismatches, f"(T, position, elements differing, max |diff|): {mismatches}"
    configs = {moe.plan_for(t).config for t in (1, *TOKENS)}
    assert len(configs) == 1 and all(moe.plan_for(t).batch_invariant for t in TOKENS)
    assert "batch-invariant: yes" in moe.explain()
    default = _layer(name, batch_invariant=False, layer=layer)
    assert len({default.plan_for(t).config for t in (1, *TOKENS)}) > 1
