"""The WGMMA_FP8 engine (Gluon W8A8 GEMMs: block-128, and per-channel / per-tensor weights with per-token
activations) on an sm_90 GPU, against the reference.

Data flow per case: a block-128 W8A8 spec (DeepSeek-V3's math at reduced and full shapes) -> random FP8
weights and scales drawn on the GPU -> routing (softmax top-k, or DeepSeek's grouped route, or ids
skewed onto few experts so that most experts are empty and a few get many tails) -> `triton_fused_moe`
with the engine's config into a NaN-poisoned `out` -> relative L2 error against `fused_moe_reference`,
and the same layer through the tl.dot engine. Also: an expert map, CUDA-graph capture and replay, and
the planner taking the engine for prefill on this device.
"""

import math
from dataclasses import replace

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from test_triton_gpu import (  # noqa: E402
    _gpu_weights,
    _inputs,
    graph_replays,
    peak_bytes,
    scrambled_expert_map,
    skewed_inputs,
)

from moekit import Activation, ActivationSpec, Fp8Scale, MoESpec, fused_moe_reference, preset  # noqa: E402
from moekit.kernels.triton.config import WGMMA_FP8_TILES, MatmulEngine, TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.tuning import WGMMA_FP8_DEFAULT, WGMMA_FP8_TALL, default_config  # noqa: E402
from moekit.kernels.triton.wgmma_fp8 import wgmma_fp8_reason  # noqa: E402
from moekit.presets import fp8_channel  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.get_device_capability() != (9, 0), reason="the WGMMA_FP8 engine targets sm_90 only"
    ),
]
DEVICE = torch.device("cuda")

SPECS = {
    "deepseek-v3-e16": replace(preset("deepseek-v3"), num_experts=16),
    # A held-out shape: 64 experts, top-6, H 2048, I 1280 (odd number of 64-row GEMM1 N-tiles, 5 h groups)
    "small-e64": replace(
        preset("deepseek-v3"), num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1280
    ),
}
CONFIGS = {
    "default": WGMMA_FP8_DEFAULT,
    "stages3-group1": replace(WGMMA_FP8_DEFAULT, num_stages=3, group_m=1),
    # GEMM1 on the 128-row blocks: two passes over K a program, an expert's odd last 64 rows on one
    # warpgroup while the other only hands the ring's stages back.
    "tall": WGMMA_FP8_TALL,
    "tall-stages3": replace(WGMMA_FP8_TALL, num_stages=3),
    "tall-stages4-group1": replace(WGMMA_FP8_TALL, num_stages=4, group_m=1),
    # the shallowest ring either GEMM1 runs (each math warpgroup holds both of its stages at once)
    "stages2": replace(WGMMA_FP8_DEFAULT, num_stages=2),
    "tall-stages2": replace(WGMMA_FP8_TALL, num_stages=2),
}


def _spec_inputs(name: str, t: int, *, seed: int):
    """The spec and its tokens and routing (DeepSeek's grouped route at the spec's expert count)."""
    spec = SPECS[name]
    return spec, *_inputs(spec, t, seed=seed)


def _run(spec: MoESpec, weights, x, routing, config, *, expert_map=None) -> torch.Tensor:
    out = torch.full((x.shape[0], spec.H), math.nan, dtype=spec.act_dtype, device=DEVICE)
    got = triton_fused_moe(x, weights, routing, spec=spec, config=config, expert_map=expert_map, out=out)
    assert got is out
    return got


def _assert_close(got, expected, spec, what):
    assert torch.isfinite(got).all(), f"non-finite output: {what}"
    err = relative_l2_error(got, expected)
    assert err <= tolerance(spec), f"rel L2 {err:.2e} > {tolerance(spec):g}: {what}"


@pytest.mark.parametrize("t", [1, 5, 64, 333, 1024, 4096])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, config, t):
    spec, x, routing = _spec_inputs(name, t, seed=t)
    assert wgmma_fp8_reason(spec) is None
    weights = _gpu_weights(spec, seed=len(name))
    got = _run(spec, weights, x, routing, CONFIGS[config])
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"{name} {config} T={t}")
    # The tl.dot engine computes the same products, scales and quantizations.
    dot = _run(spec, weights, x, routing, default_config(spec, t))
    assert relative_l2_error(got, dot) <= tolerance(spec)
    if CONFIGS[config].gemm1_block_m is not None:
        # Same products in the same order, the same group maxima: the same FP8 h, so the same output.
        assert torch.equal(got, _run(spec, weights, x, routing, WGMMA_FP8_DEFAULT))


@pytest.mark.parametrize("config", [WGMMA_FP8_DEFAULT, WGMMA_FP8_TALL], ids=["default", "tall"])
@pytest.mark.parametrize("t", [200, 3000])
def test_skewed_routing_with_empty_experts_and_tails(t, config):
    # Every token picks the same 6 of 64 experts, in its own order: 58 experts get nothing, the 6 get
    # t pairs each, long runs of 64-row blocks (GEMM2's 128-row blocks plus a 64-row tail when odd).
    spec = SPECS["small-e64"]
    weights = _gpu_weights(spec, seed=3)
    x, routing = skewed_inputs(spec, t, [1, 4, 7, 11, 40, 63], seed=t)
    got = _run(spec, weights, x, routing, config)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, f"skewed T={t}")


@pytest.mark.parametrize("config", [WGMMA_FP8_DEFAULT, WGMMA_FP8_TALL], ids=["default", "tall"])
@pytest.mark.parametrize("t", [7, 1500])
def test_expert_map(t, config):
    # This rank owns 8 of 16 experts in scrambled order; pairs routed elsewhere contribute zero.
    base = SPECS["deepseek-v3-e16"]
    spec = replace(base, num_local_experts=8)
    expert_map = scrambled_expert_map(base.E, 8, seed=5)
    weights = _gpu_weights(spec, seed=9)
    _, x, routing = _spec_inputs("deepseek-v3-e16", t, seed=t)
    got = _run(spec, weights, x, routing, config, expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t}")


def test_cuda_graph_capture_and_replay():
    spec = SPECS["deepseek-v3-e16"]
    weights = _gpu_weights(spec, seed=2)
    t = 777

    def inputs(seed):
        return _spec_inputs("deepseek-v3-e16", t, seed=seed)[1:]

    for config in (WGMMA_FP8_DEFAULT, WGMMA_FP8_TALL):
        replays = graph_replays(spec, weights, config, inputs(1), inputs, (11, 12))
        for seed, static_out, x, routing in replays:
            expected = fused_moe_reference(x, weights, routing, spec=spec)
            _assert_close(static_out, expected, spec, f"seed {seed} {config}")


@pytest.mark.parametrize("t", [300, 2000])
def test_almost_zero_activation_groups(t):
    # Groups 2^-110 below their token's other groups: every promotion stays within fp32's range.
    spec = SPECS["deepseek-v3-e16"]
    weights = _gpu_weights(spec, seed=6)
    _, x, routing = _spec_inputs("deepseek-v3-e16", t, seed=t)
    x = x.clone()
    x[::3, 128:256] *= 2.0**-110
    x[1::3, -128:] *= 2.0**-110
    x[2::3, :128] *= 2.0**-110
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    for config in (WGMMA_FP8_DEFAULT, WGMMA_FP8_TALL):
        _assert_close(_run(spec, weights, x, routing, config), expected, spec, f"tiny groups T={t} {config}")


@pytest.mark.whole_gpu  # 256 experts' weights and their fp32 reference: about 28 GiB
def test_full_deepseek_shape_matches_reference():
    # The real expert count and shapes (256 experts, H 7168, I 2048) at a prefill size.
    spec = preset("deepseek-v3")
    weights = _gpu_weights(spec, seed=4)
    x, routing = _inputs(spec, 4096, seed=4)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    for config in (WGMMA_FP8_DEFAULT, WGMMA_FP8_TALL):
        _assert_close(_run(spec, weights, x, routing, config), expected, spec, f"deepseek-v3 T=4096 {config}")


def test_planner_takes_the_engine_for_prefill_here():
    from moekit.kernels.base import DeviceInfo, DeviceKind, Problem
    from moekit.kernels.triton.kernel import TritonFusedKernel

    spec = preset("deepseek-v3")
    props = torch.cuda.get_device_properties(DEVICE)
    info = DeviceInfo(DeviceKind.CUDA, props.name, (props.major, props.minor), props.multi_processor_count)
    prefill = TritonFusedKernel().default_config(spec, Problem(num_tokens=16384, device=info))
    decode = TritonFusedKernel().default_config(spec, Problem(num_tokens=16, device=info))
    assert prefill == WGMMA_FP8_TALL  # 512 tokens an expert
    assert decode.engine is MatmulEngine.TL_DOT
    assert TritonMoEConfig(**WGMMA_FP8_TILES, engine=MatmulEngine.WGMMA_FP8) == replace(
        WGMMA_FP8_DEFAULT, group_m=1, num_stages=3
    )


def test_workspace_prediction_holds():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    spec = SPECS["small-e64"]
    weights = _gpu_weights(spec, seed=6)
    t = 3000
    _, x, routing = _spec_inputs("small-e64", t, seed=6)
    out = torch.empty(t, spec.H, dtype=spec.act_dtype, device=DEVICE)
    _, peak = peak_bytes(
        lambda: triton_fused_moe(x, weights, routing, spec=spec, config=WGMMA_FP8_DEFAULT, out=out)
    )
    predicted = TritonFusedKernel().workspace_bytes(spec, t, WGMMA_FP8_DEFAULT)
    assert 0.5 * predicted <= peak <= 1.1 * predicted, (peak, predicted)


# The per-channel form: FP8-dynamic checkpoints' math at reduced shapes (GEMM1 on 128-row blocks only).
CHANNEL_SPECS = {
    # Mixtral's: 8 experts, top-2, per-channel weights (7 K-step pairs in GEMM2, 28 N-tiles of 64 in GEMM1)
    "mixtral-channel": replace(fp8_channel(preset("mixtral-8x7b")), hidden_size=1024, intermediate_size=1792),
    # Qwen3-30B's 128 experts top-8 cut to 32, one scale a weight matrix (compressed-tensors "tensor")
    "qwen3-tensor": replace(
        fp8_channel(preset("qwen3-30b-a3b")),
        fp8_scale=Fp8Scale.PER_TENSOR,
        num_experts=32,
        hidden_size=768,
        intermediate_size=512,
    ),
    # GPT-OSS's clamped SwiGLU on concatenated gate/up rows: the epilogue's other activations
    "swiglu-limit-channel": replace(
        fp8_channel(preset("qwen3-30b-a3b")),
        num_experts=16,
        hidden_size=512,
        intermediate_size=768,
        activation=ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0),
    ),
}
CHANNEL_CONFIGS = {
    "tall": WGMMA_FP8_TALL,
    "stages3-group1": replace(WGMMA_FP8_TALL, num_stages=3, group_m=1),
    "stages2": replace(WGMMA_FP8_TALL, num_stages=2),
}


@pytest.mark.parametrize("t", [1, 5, 64, 333, 1024, 4096])
@pytest.mark.parametrize("config", list(CHANNEL_CONFIGS))
@pytest.mark.parametrize("name", list(CHANNEL_SPECS))
def test_per_channel_form_matches_reference(name, config, t):
    spec = CHANNEL_SPECS[name]
    assert wgmma_fp8_reason(spec) is None
    x, routing = _inputs(spec, t, seed=t)
    weights = _gpu_weights(spec, seed=len(name))
    got = _run(spec, weights, x, routing, CHANNEL_CONFIGS[config])
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"{name} {config} T={t}")
    dot = _run(spec, weights, x, routing, default_config(spec, t))
    assert relative_l2_error(got, dot) <= tolerance(spec)
    # The ring depth and the tile order change no sum: the same output bit for bit.
    assert torch.equal(got, _run(spec, weights, x, routing, WGMMA_FP8_TALL))


@pytest.mark.parametrize("t", [200, 3000])
def test_per_channel_form_with_skewed_routing_and_an_expert_map(t):
    # Every token on the same 2 of 8 experts (long runs of blocks and odd tails), and a rank owning 4 of
    # the 8 in scrambled order (pairs routed elsewhere contribute zero).
    base = CHANNEL_SPECS["mixtral-channel"]
    weights = _gpu_weights(base, seed=3)
    x, routing = skewed_inputs(base, t, [6, 1], seed=t)
    got = _run(base, weights, x, routing, WGMMA_FP8_TALL)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=base), base, f"skewed T={t}")
    spec = replace(base, num_local_experts=4)
    expert_map = scrambled_expert_map(base.E, 4, seed=5)
    local = _gpu_weights(spec, seed=9)
    x, routing = _inputs(base, t, seed=t)
    got = _run(spec, local, x, routing, WGMMA_FP8_TALL, expert_map=expert_map)
    expected = fused_moe_reference(x, local, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t}")


def test_per_channel_form_under_cuda_graph_replay():
    spec = CHANNEL_SPECS["mixtral-channel"]
    weights = _gpu_weights(spec, seed=2)

    def inputs(seed):
        return _inputs(spec, 777, seed=seed)

    for seed, static_out, x, routing in graph_replays(
        spec, weights, WGMMA_FP8_TALL, inputs(1), inputs, (11, 12)
    ):
        _assert_close(static_out, fused_moe_reference(x, weights, routing, spec=spec), spec, f"seed {seed}")


def test_full_mixtral_per_channel_shape_matches_reference():
    spec = fp8_channel(preset("mixtral-8x7b"))
    weights = _gpu_weights(spec, seed=4)
    x, routing = _inputs(spec, 2048, seed=4)
    _assert_close(
        _run(spec, weights, x, routing, WGMMA_FP8_TALL),
        fused_moe_reference(x, weights, routing, spec=spec),
        spec,
        "mixtral per-channel T=2048",
    )


def test_per_channel_workspace_prediction_holds():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    spec = CHANNEL_SPECS["qwen3-tensor"]
    weights = _gpu_weights(spec, seed=6)
    t = 3000
    x, routing = _inputs(spec, t, seed=6)
    out = torch.empty(t, spec.H, dtype=spec.act_dtype, device=DEVICE)
    _, peak = peak_bytes(
        lambda: triton_fused_moe(x, weights, routing, spec=spec, config=WGMMA_FP8_TALL, out=out)
    )
    predicted = TritonFusedKernel().workspace_bytes(spec, t, WGMMA_FP8_TALL)
    assert 0.5 * predicted <= peak <= 1.1 * predicted, (peak, predicted)
