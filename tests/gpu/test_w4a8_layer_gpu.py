"""W4A8 through the layer on an sm_90 GPU: `FusedMoE` with a per-token FP8 activation spec plans the
WGMMA_W4A8 engine at every bucket, packs its weights once, and serves decode and prefill batches without a
host sync, equal to the reference on the source weights; a captured CUDA graph replays exactly as eager;
the workspace prediction bounds the measured peak."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from test_triton_gpu import peak_bytes  # noqa: E402

from moekit import fused_moe_reference, route  # noqa: E402
from moekit.kernels.triton.config import MatmulEngine  # noqa: E402
from moekit.layer import FusedMoE  # noqa: E402
from moekit.presets import preset_at  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.spec import ActivationQuant  # noqa: E402
from moekit.synthetic import random_layer  # noqa: E402
from moekit.weights import WeightPacking  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.get_device_capability() != (9, 0), reason="the WGMMA_W4A8 engine targets sm_90 only"
    ),
]
DEVICE = torch.device("cuda")
SPEC = replace(preset_at("gpt-oss-20b@16x4x1024x768"), act_quant=ActivationQuant.FP8_PER_TOKEN)
TOKENS = (1, 37, 200, 1500)


@pytest.fixture(scope="module")
def layer() -> FusedMoE:
    source = random_layer(SPEC, seed=0, device=DEVICE)
    moe = FusedMoE(spec=SPEC, weights=source.weights, router_weight=source.router_weight, device=DEVICE)
    for t in TOKENS:
        plan = moe.plan_for(t)
        assert plan.kernel == "triton_fused" and plan.config.engine is MatmulEngine.WGMMA_W4A8, plan
    return moe


def _reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(x.float(), moe.router_weight.float())
    routing = route(logits, top_k=SPEC.K, spec=SPEC.routing)
    return fused_moe_reference(x, moe.weights, routing, spec=SPEC)


def test_serves_each_bucket_without_a_sync_and_replays_a_graph_exactly(layer: FusedMoE) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for t in TOKENS:
        static_x = torch.randn(t, SPEC.H, generator=gen, device=DEVICE).to(torch.bfloat16)
        with torch.no_grad():
            layer(static_x)  # compile and pack outside the sync check
            layer.check_values = False  # the finite-logits check reads one bool (a sync)
            torch.cuda.set_sync_debug_mode("error")
            try:
                eager = layer(static_x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                layer.check_values = True
            assert relative_l2_error(eager, _reference(layer, static_x)) <= tolerance(SPEC), t
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(static_x)
            for seed in (2, 3):
                static_x.copy_(torch.randn(t, SPEC.H, generator=gen.manual_seed(seed), device=DEVICE))
                graph.replay()
                torch.cuda.synchronize()
                torch.testing.assert_close(static_out, layer(static_x), rtol=0, atol=0)


def test_weights_are_packed_once_for_the_engine(layer: FusedMoE) -> None:
    packed = [w for w in layer._prepared.values() if w.packing is WeightPacking.MXFP4_W4A8]
    assert len(packed) == 1 and layer.weights.packing is WeightPacking.CHECKPOINT


def test_workspace_bytes_bounds_the_measured_peak(layer: FusedMoE) -> None:
    x = torch.randn(1500, SPEC.H, device=DEVICE).to(torch.bfloat16)
    with torch.no_grad():
        _, peak = peak_bytes(lambda: layer(x))
    predicted = layer.workspace_bytes(1500)
    assert 0.5 * predicted <= peak <= 1.5 * predicted, (peak, predicted)
