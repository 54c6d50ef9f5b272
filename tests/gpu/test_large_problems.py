"""Problems whose T * K * H exceeds 2^31 on a CUDA GPU: every offset that scales with pairs must be int64.

Data flow per case (qwen3-30b-a3b bf16 at T = 140000; deepseek-v3 FP8 block-128 W8A8 with E capped at 32
at T = 40000: both put T * K * H near 2.3e9 > 2^31): random layer and batch -> `plan` -> `route` ->
allocator NaN-poisoned -> `fused_moe` over the whole batch -> finite everywhere, and on 384 sampled tokens
(the last 128 among them, where pair offsets t * K * H pass 2^31) within the bf16 tolerance of the fp32
reference computed on those tokens only (the full reference would be slow).
Expected runtime on an H200: about 30 s (two compiles, two large forwards, ~10 GB of device memory each).
"""

from __future__ import annotations

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from moekit import RoutingResult, fused_moe, fused_moe_reference, plan, prepare_weights, preset  # noqa: E402
from moekit.app.check import poison_allocator  # noqa: E402
from moekit.presets import cap_experts  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.synthetic import random_batch, random_layer  # noqa: E402

# Each case holds tens of GiB (x, h and y past 2**31 elements): beside parallel workers it can run out.
pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu]
DEVICE = torch.device("cuda", torch.cuda.current_device())
CASES = {"qwen3-30b-a3b": (None, 140_000), "deepseek-v3": (32, 40_000)}


@pytest.mark.parametrize("name", list(CASES))
def test_t_k_h_above_2_31_is_correct(name: str) -> None:
    max_experts, num_tokens = CASES[name]
    spec = cap_experts(preset(name), max_experts)
    assert num_tokens * spec.K * spec.H > 2**31
    layer = random_layer(spec, seed=0, device=DEVICE)
    x, _, routing = random_batch(
        spec, num_tokens, correction_bias=layer.correction_bias, seed=1, device=DEVICE
    )
    chosen = plan(spec, num_tokens=num_tokens, device=DEVICE)
    assert chosen.kernel == "triton_fused", chosen.explain()
    weights = prepare_weights(layer.weights, chosen)
    poison_allocator(DEVICE, num_bytes=num_tokens * spec.K * (spec.I + spec.H) * 4)
    out = fused_moe(x, weights, routing, plan=chosen)
    torch.cuda.synchronize()
    assert out.shape == (num_tokens, spec.H) and bool(torch.isfinite(out).all())

    gen = torch.Generator(device=DEVICE).manual_seed(2)
    tail = torch.arange(num_tokens - 128, num_tokens, device=DEVICE)
    picked = torch.randperm(num_tokens - 128, generator=gen, device=DEVICE)[:256]
    for rows in (tail, torch.cat([picked, tail])):
        sub = RoutingResult(weights=routing.weights[rows].contiguous(), ids=routing.ids[rows].contiguous())
        expected = fused_moe_reference(x[rows].contiguous(), layer.weights, sub, spec=spec)
        err = relative_l2_error(out[rows], expected)
        print(f"\n{name} T={num_tokens}: rel L2 on {rows.numel()} sampled tokens {err:.2e}")
        assert err <= tolerance(spec), err
