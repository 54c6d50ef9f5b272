"""The MMA_WORDS_DECODE engine (Gluon mma.sync decode GEMMs over MXFP4 words) on an sm_90 GPU, against
the reference.

Data flow per case: an MXFP4 W4A16 spec (GPT-OSS's math at reduced shapes; gate/up rows interleaved or
concatenated; with and without biases; H and I not multiples of the 128-wide K-step; N not a multiple of
the 64-row tile) -> random MXFP4 weights, word-packed as the layer prepares them -> routing of a decode
step (one block a pair, or aligned 16- and 32-pair blocks) -> `triton_fused_moe` with the engine's config
(every split and queue depth) into a NaN-poisoned `out` -> relative L2 error against
`fused_moe_reference`. Also: ids skewed onto one expert, an expert map, routing ids out of range,
CUDA-graph capture and replay, and weights that keep the checkpoint packing.
"""

from dataclasses import replace

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from test_triton_gpu import _gpu_weights, _inputs, graph_replays, scrambled_expert_map, skewed_inputs  # noqa: E402
from test_wgmma_fp8_gpu import _assert_close, _run  # noqa: E402  (NaN-poisoned out, tolerance(spec))

from moekit import Activation, ActivationSpec, GateLayout, fused_moe_reference  # noqa: E402
from moekit.errors import SpecError  # noqa: E402
from moekit.kernels.triton.config import MMA_WORDS_DECODE_TILES, MatmulEngine, TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.kernel import TritonFusedKernel  # noqa: E402
from moekit.kernels.triton.words_decode import words_decode_reason  # noqa: E402
from moekit.presets import preset_at  # noqa: E402
from moekit.routing import RoutingResult  # noqa: E402
from moekit.weights import WeightPacking  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.get_device_capability() != (9, 0), reason="the MMA_WORDS_DECODE engine targets sm_90 only"
    ),
]
ENGINE = TritonMoEConfig(
    **MMA_WORDS_DECODE_TILES, block_m=16, split_k=2, num_stages=3, engine=MatmulEngine.MMA_WORDS_DECODE
)

SPECS = {
    # gpt-oss's math, H = I = 2880: 22.5 K-steps (a half-padded last run), GEMM2's N = 45 tiles of 64
    "gpt-oss-e16": preset_at("gpt-oss-120b@16x4x2880x2880"),
    # concatenated gate/up rows with biases, a long GEMM2 K-loop
    "concat-e8": replace(preset_at("gpt-oss-120b@8x2x1024x4096"), gate_layout=GateLayout.CONCAT),
    # no biases, plain SiLU; H = 800 (6.25 K-steps, N of GEMM2 not a multiple of 64), I = 1056
    "silu-no-bias": replace(
        preset_at("gpt-oss-120b@32x4x800x1056"), has_bias=False, activation=ActivationSpec(Activation.SILU)
    ),
}
CONFIGS = {
    "split1-depth3": replace(ENGINE, split_k=1),
    "split2-depth4": replace(ENGINE, num_stages=4),
    "split5-depth3": replace(ENGINE, split_k=5),
    "pairs32-split3-depth4": replace(ENGINE, block_m=32, split_k=3, num_stages=4),
}


def _words(spec, *, seed: int):
    weights = TritonFusedKernel().prepare_weights(_gpu_weights(spec, seed=seed), spec)
    assert weights.packing is WeightPacking.MXFP4_MMA_WORDS
    return weights


@pytest.mark.parametrize("t", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, config, t):
    spec = SPECS[name]
    assert words_decode_reason(spec) is None
    weights = _words(spec, seed=len(name))
    x, routing = _inputs(spec, t, seed=t)
    reason = CONFIGS[config].reason_unusable(spec)
    if reason is not None:  # a share of K too long for shared memory: refused before any launch
        assert "raise split_k" in reason
        with pytest.raises(SpecError, match="raise split_k"):
            _run(spec, weights, x, routing, CONFIGS[config])
        return
    got = _run(spec, weights, x, routing, CONFIGS[config])
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, f"{name} {config} T={t}")


def test_skewed_onto_few_experts():
    # 24 tokens on the same 4 experts: 24 pairs an expert, two 16-pair blocks each (one ragged).
    spec = SPECS["gpt-oss-e16"]
    weights = _words(spec, seed=3)
    x, routing = skewed_inputs(spec, 24, [0, 5, 9, 15], seed=4)
    got = _run(spec, weights, x, routing, ENGINE)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, "skewed")


@pytest.mark.parametrize("t", [1, 9])
def test_expert_map(t):
    base = SPECS["gpt-oss-e16"]
    spec = replace(base, num_local_experts=8)
    expert_map = scrambled_expert_map(base.E, 8, seed=5)
    weights = _words(spec, seed=9)
    x, routing = _inputs(base, t, seed=t)
    got = _run(spec, weights, x, routing, ENGINE, expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t}")


def test_ids_out_of_range_are_dropped():
    # Routing not checked (`triton_fused_moe` reads ids as given): a pair on expert E or -1 adds nothing.
    spec = SPECS["gpt-oss-e16"]
    weights = _words(spec, seed=6)
    x, routing = _inputs(spec, 1, seed=8)
    ids = routing.ids.clone()
    ids[0, 1], ids[0, 3] = spec.E, -1
    got = _run(spec, weights, x, RoutingResult(routing.weights, ids), ENGINE)
    kept = RoutingResult(routing.weights * ((ids >= 0) & (ids < spec.E)), ids.clamp(0, spec.E - 1))
    _assert_close(got, fused_moe_reference(x, weights, kept, spec=spec), spec, "ids out of range")


def test_cuda_graph_capture_and_replay():
    spec = SPECS["gpt-oss-e16"]
    weights = _words(spec, seed=2)

    def inputs(seed):
        return _inputs(spec, 3, seed=seed)

    for seed, out, x, routing in graph_replays(spec, weights, ENGINE, inputs(1), inputs, (11, 12)):
        _assert_close(out, fused_moe_reference(x, weights, routing, spec=spec), spec, f"replay seed {seed}")


def test_checkpoint_packing_runs_the_tl_dot_decode_tiles():
    # Scale bytes above 128 keep the checkpoint packing, which this engine cannot read: the layer falls
    # back to the tl.dot decode tiles with the plan's split (and stays right).
    spec = SPECS["gpt-oss-e16"]
    raw = _gpu_weights(spec, seed=7)
    raw.w13_scale[2, 40, 7] = 130
    with pytest.warns(UserWarning, match="CHECKPOINT packing"):
        weights = TritonFusedKernel().prepare_weights(raw, spec)
    assert weights.packing is WeightPacking.CHECKPOINT
    x, routing = _inputs(spec, 2, seed=2)
    got = _run(spec, weights, x, routing, ENGINE)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, "checkpoint packing")


def test_share_too_long_for_shared_memory_is_refused_before_launch():
    # DeepSeek-class H = 7168 in one share: 16 rows x 7168 columns of bf16 exceed a program's budget.
    spec = preset_at("gpt-oss-120b@16x8x7168x2048")
    weights = _words(spec, seed=1)
    x, routing = _inputs(spec, 1, seed=1)
    with pytest.raises(SpecError, match="raise split_k"):
        _run(spec, weights, x, routing, replace(ENGINE, split_k=1))
