"""The WGMMA_WORDS engine (Gluon MXFP4 word-path GEMMs) on an sm_90 GPU, against the reference.

Data flow per case: an MXFP4 W4A16 spec (GPT-OSS's math at reduced shapes, gate/up rows interleaved or
concatenated, with and without biases, another gated activation, H not a multiple of GEMM2's 128-row
tile) -> random
MXFP4 blocks and scales drawn on the GPU, word-packed as the layer prepares them -> softmax top-k
routing, or ids skewed onto few experts -> `triton_fused_moe` with the engine's config into a
NaN-poisoned `out` -> relative L2 error against `fused_moe_reference`, and the same layer through the
tl.dot engine. Also: an expert map, CUDA-graph capture and replay, weights whose scale bytes rule out
the word packing, the planner's choice on this device and the workspace prediction.
"""

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
from test_wgmma_fp8_gpu import _assert_close, _run  # noqa: E402  (NaN-poisoned out, tolerance(spec))

from moekit import (  # noqa: E402
    Activation,
    ActivationSpec,
    GateLayout,
    MoESpec,
    fused_moe_reference,
)
from moekit.kernels.triton import wgmma_words as wgmma_words_host  # noqa: E402
from moekit.kernels.triton.config import WGMMA_WORDS_TILES, MatmulEngine, TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.kernel import TritonFusedKernel  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.tuning import default_config  # noqa: E402
from moekit.kernels.triton.wgmma_words import wgmma_words_reason  # noqa: E402
from moekit.presets import preset_at  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.weights import WeightPacking  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.get_device_capability() != (9, 0), reason="the WGMMA_WORDS engine targets sm_90 only"
    ),
]
DEVICE = torch.device("cuda")
ENGINE = TritonMoEConfig(
    **WGMMA_WORDS_TILES, block_m=128, group_m=8, num_stages=4, engine=MatmulEngine.WGMMA_WORDS
)

SPECS = {
    # gpt-oss-120b's math and H = I = 2880 (GEMM2's last N-tile half full) on 16 experts
    "gpt-oss-e16": preset_at("gpt-oss-120b@16x4x2880x2880"),
    # Mixtral's proportions, reduced: 8 experts, top-2, long GEMM2 K-loop (I = 4 H)
    "mixtral-like-small": preset_at("gpt-oss-120b@8x2x1024x4096"),
    # concatenated gate/up rows (Mixtral's and Qwen's checkpoints) with biases: the up half 4032 rows on
    "concat-e8": replace(preset_at("gpt-oss-120b@8x2x1024x4096"), gate_layout=GateLayout.CONCAT),
    # no biases, plain SiLU, H a multiple of 64 but not of 128
    "silu-no-bias": replace(
        preset_at("gpt-oss-120b@32x4x832x1536"), has_bias=False, activation=ActivationSpec(Activation.SILU)
    ),
}
CONFIGS = {
    "pairs128-stages4": ENGINE,
    "pairs256-stages3-group1": replace(ENGINE, block_m=256, num_stages=3, group_m=1),
}


# Both kernel sets whatever the routing's share of half-full blocks: a bar of 0 takes the half-wide kernels
# (a block at most half full runs a wgmma of BLOCK_M / 2 pairs), one above 1 the one-loop kernels.
HALF_WIDE_BARS = {"half-wide": 0.0, "one-loop": 2.0}


@pytest.fixture(params=list(HALF_WIDE_BARS))
def kernel_set(request, monkeypatch):
    monkeypatch.setattr(wgmma_words_host, "HALF_WIDE_MIN_SHARE", HALF_WIDE_BARS[request.param])
    return request.param


def _words(spec: MoESpec, *, seed: int):
    """Random MXFP4 weights of `spec`, word-packed as the layer prepares them for the Triton path."""
    weights = TritonFusedKernel().prepare_weights(_gpu_weights(spec, seed=seed), spec)
    assert weights.packing is WeightPacking.MXFP4_MMA_WORDS
    return weights


@pytest.mark.parametrize("t", [1, 7, 130, 1000, 3000])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, config, t, kernel_set):
    spec = SPECS[name]
    assert wgmma_words_reason(spec) is None
    weights = _words(spec, seed=len(name))
    x, routing = _inputs(spec, t, seed=t)
    got = _run(spec, weights, x, routing, CONFIGS[config])
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"{name} {config} {kernel_set} T={t}")
    dot = _run(spec, weights, x, routing, default_config(spec, t))  # the tl.dot engine, same words
    assert relative_l2_error(got, dot) <= tolerance(spec)


@pytest.mark.parametrize("t", [200, 2600])
def test_skewed_routing_with_empty_experts(t, kernel_set):
    # Every token picks the same 4 of 16 experts: 12 experts get nothing, 4 get t pairs each (many full
    # blocks and a ragged last one: more than half full at T = 200, 40 pairs at T = 2600).
    spec = SPECS["gpt-oss-e16"]
    weights = _words(spec, seed=3)
    x, routing = skewed_inputs(spec, t, [0, 5, 9, 15], seed=t)
    for config in CONFIGS.values():
        got = _run(spec, weights, x, routing, config)
        expected = fused_moe_reference(x, weights, routing, spec=spec)
        _assert_close(got, expected, spec, f"skewed T={t} block_m {config.block_m} {kernel_set}")


@pytest.mark.parametrize("t", [9, 1500])
def test_expert_map(t, kernel_set):
    # This rank owns 8 of 16 experts in scrambled order; pairs routed elsewhere contribute zero.
    base = SPECS["gpt-oss-e16"]
    spec = replace(base, num_local_experts=8)
    expert_map = scrambled_expert_map(base.E, 8, seed=5)
    weights = _words(spec, seed=9)
    x, routing = _inputs(base, t, seed=t)
    got = _run(spec, weights, x, routing, ENGINE, expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t} {kernel_set}")


def test_cuda_graph_capture_and_replay():
    spec = SPECS["mixtral-like-small"]
    weights = _words(spec, seed=2)
    t = 777

    def inputs(seed):
        return _inputs(spec, t, seed=seed)

    replays = graph_replays(spec, weights, ENGINE, inputs(1), inputs, (11, 12))
    for seed, static_out, x, routing in replays:
        _assert_close(static_out, fused_moe_reference(x, weights, routing, spec=spec), spec, f"seed {seed}")


def test_scale_bytes_that_rule_out_words_run_the_tl_dot_tiles():
    # A scale byte above 128 keeps CHECKPOINT packing (with a warning); a plan of this engine then runs
    # the tl.dot prefill tiles on those bytes, still matching the reference.
    spec = SPECS["gpt-oss-e16"]
    raw = _gpu_weights(spec, seed=8)
    raw.w2_scale[3, 17, 5] = 129
    with pytest.warns(UserWarning, match="CHECKPOINT packing"):
        weights = TritonFusedKernel().prepare_weights(raw, spec)
    assert weights.packing is WeightPacking.CHECKPOINT
    x, routing = _inputs(spec, 600, seed=8)
    got = _run(spec, weights, x, routing, ENGINE)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, "checkpoint packing")


def test_planner_takes_the_engine_for_prefill_here():
    from moekit.kernels.base import DeviceInfo, DeviceKind, Problem

    props = torch.cuda.get_device_properties(DEVICE)
    info = DeviceInfo(DeviceKind.CUDA, props.name, (props.major, props.minor), props.multi_processor_count)
    kernel = TritonFusedKernel()
    mixtral_like = preset_at("gpt-oss-120b@8x2x4096x14336")
    prefill = kernel.default_config(mixtral_like, Problem(num_tokens=4096, device=info))
    decode = kernel.default_config(mixtral_like, Problem(num_tokens=16, device=info))
    assert prefill.engine is MatmulEngine.WGMMA_WORDS and prefill.block_m == 256
    assert decode.engine is MatmulEngine.TL_DOT
    gpt_oss = SPECS["gpt-oss-e16"]  # 32, then 64 tokens an expert
    assert kernel.default_config(gpt_oss, Problem(num_tokens=128, device=info)).engine is MatmulEngine.TL_DOT
    at_64 = kernel.default_config(gpt_oss, Problem(num_tokens=256, device=info))
    assert at_64.engine is MatmulEngine.WGMMA_WORDS and at_64.block_m == 128


def test_workspace_prediction_holds():
    spec = SPECS["gpt-oss-e16"]
    weights = _words(spec, seed=6)
    t = 3000
    x, routing = _inputs(spec, t, seed=6)
    out = torch.empty(t, spec.H, dtype=spec.act_dtype, device=DEVICE)
    _, peak = peak_bytes(lambda: triton_fused_moe(x, weights, routing, spec=spec, config=ENGINE, out=out))
    predicted = TritonFusedKernel().workspace_bytes(spec, t, ENGINE)
    assert 0.5 * predicted <= peak <= 1.1 * predicted, (peak, predicted)
