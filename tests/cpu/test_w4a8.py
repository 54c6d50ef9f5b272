"""W4A8: MXFP4 weights with FP8 E4M3 activations (per token or per 1x128 group). The spec, the reference's
definition of it, the capability data that keeps it off kernels that cannot quantize activations next to
MXFP4 weights, the Triton plan (its kernel runs interpreted in tests/interpret), and the layer on the CPU."""

from dataclasses import replace

import pytest
import torch

from moekit import FusedMoE
from moekit.app.cli_spec import SIMULATED_DEVICES
from moekit.errors import SpecError
from moekit.kernels.registry import default_registry
from moekit.kernels.triton.config import MatmulEngine, triton_supports, words_reason
from moekit.kernels.triton.tuning import default_config
from moekit.kernels.triton.tuning_space import tuning_space
from moekit.ops import fused_moe, prepare_weights
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
from moekit.spec import ActivationQuant, WeightFormat
from moekit.synthetic import random_batch, random_layer

W4A16 = preset_at("gpt-oss-20b@8x2x256x192")  # GPT-OSS math, small: H and I not multiples of 128
W4A16_ODD_I = preset_at("gpt-oss-20b@8x2x256x200")  # 2I = 400: not whole 128-row programs
FP8_ACTS = [ActivationQuant.FP8_PER_TOKEN, ActivationQuant.FP8_PER_GROUP_128]


@pytest.mark.parametrize("quant", FP8_ACTS)
def test_spec_accepts_fp8_activations_with_mxfp4_weights(quant):
    spec = replace(W4A16, act_quant=quant)
    assert spec.weight_format is WeightFormat.MXFP4 and spec.act_quant is quant
    assert quant.name in spec.describe()
    assert tolerance(spec) >= 1e-2  # judged like W8A8: FP8 activations round each element to 3 bits


def test_float_weights_still_refuse_fp8_activations():
    with pytest.raises(SpecError, match="W4A8"):
        replace(preset_at("qwen3-30b-a3b"), act_quant=ActivationQuant.FP8_PER_TOKEN)


@pytest.mark.parametrize("quant", FP8_ACTS)
def test_triton_w4a8_tl_dot_tiles_promote_every_step(quant):
    # Off sm_90 (the interpreter, tests/interpret) W4A8 runs the tl.dot tiles.
    spec = replace(W4A16, act_quant=quant)
    for t in (1, 64, 4096):
        space = tuning_space(spec, t, 132)
        assert space[0] == default_config(spec, t, 132)
        assert space[0].block_k == 32  # one MX group a step: exact
        assert {c.block_k for c in space} == {32, 128} and all(c.reason_unusable(spec) is None for c in space)
    wide = replace(space[0], block_k=256)
    assert "block_k must be 32, 64 or 128" in wide.reason_unusable(spec)
    assert "W4A8" in words_reason(spec)  # decoded from checkpoint bytes, never MMA words


def test_planner_runs_per_token_w4a8_on_the_wgmma_w4a8_engine_on_hopper():
    spec = replace(W4A16, act_quant=ActivationQuant.FP8_PER_TOKEN)
    for t in (1, 64, 4096):
        chosen = plan(spec, num_tokens=t, device=SIMULATED_DEVICES["h200"])
        assert chosen.kernel == "triton_fused" and chosen.config.engine is MatmulEngine.WGMMA_W4A8


@pytest.mark.parametrize(
    "spec, why",
    [
        (replace(W4A16, act_quant=ActivationQuant.FP8_PER_GROUP_128), "FP8_PER_TOKEN"),
        (
            replace(preset_at("gpt-oss-20b@8x2x256x200"), act_quant=ActivationQuant.FP8_PER_TOKEN),
            "2I must be",
        ),
    ],
    ids=["per-1x128-groups", "2I-not-a-multiple-of-128"],
)
def test_planner_keeps_w4a8_the_engine_cannot_compute_off_the_gpu_triton_path(spec, why):
    # The tl.dot W4A8 decode ran at a third of W4A16's speed on an H200: on a GPU the planner takes the
    # unfused path, and says why.
    chosen = plan(spec, num_tokens=64, device=SIMULATED_DEVICES["h200"])
    assert chosen.kernel == "torch_grouped"
    (refusal,) = [r for r in chosen.refused if r.kernel == "triton_fused"]
    assert "WGMMA_W4A8 engine only" in refusal.reason and why in refusal.reason
    assert triton_supports(spec) is None  # the launch itself (interpreter, GPU tests) accepts it


def test_kernels_without_fp8_activations_next_to_mxfp4_refuse_w4a8():
    from moekit.kernels.base import Capabilities

    spec = replace(W4A16, act_quant=ActivationQuant.FP8_PER_TOKEN)
    only_w8a8 = replace(
        default_registry().get("triton_fused").capabilities,
        act_quant_weight_formats=frozenset({WeightFormat.FP8_E4M3}),
    )
    assert isinstance(only_w8a8, Capabilities)
    reason = only_w8a8.check(spec)
    assert reason is not None and "MXFP4" in reason and "FP8_PER_TOKEN" in reason


@pytest.mark.parametrize("quant", FP8_ACTS)
def test_reference_rounds_activations_on_top_of_w4a16(quant):
    w4a8 = replace(W4A16, act_quant=quant)
    layer = random_layer(W4A16, seed=3)  # the same MXFP4 weights serve both specs
    x, _, routing = random_batch(W4A16, 37, correction_bias=None, seed=5)
    w4a16_out = fused_moe_reference(x, layer.weights, routing, spec=W4A16)
    w4a8_out = fused_moe_reference(x, layer.weights, routing, spec=w4a8)
    err = relative_l2_error(w4a8_out, w4a16_out)
    # FP8 E4M3 keeps 3 mantissa bits (half-ulp 2^-4 relative) at two points, GEMM1's and GEMM2's inputs:
    # a few percent of rel L2 on random data, never zero, never more than the bound the tolerance allows.
    assert 1e-3 < err < 6e-2, err


@pytest.mark.parametrize("quant", FP8_ACTS)
def test_unfused_path_matches_the_reference(quant):
    spec = replace(W4A16, act_quant=quant)
    layer = random_layer(spec, seed=4)
    x, _, routing = random_batch(spec, 29, correction_bias=None, seed=6)
    chosen = plan(spec, num_tokens=29, device="cpu")
    assert chosen.kernel in {"torch_grouped", "reference"}
    out = fused_moe(x, prepare_weights(layer.weights, chosen), routing, plan=chosen)
    assert torch.isfinite(out).all()
    assert relative_l2_error(out, fused_moe_reference(x, layer.weights, routing, spec=spec)) <= tolerance(
        spec
    )


def test_layer_runs_w4a8_on_the_cpu():
    spec = replace(W4A16, act_quant=ActivationQuant.FP8_PER_GROUP_128)
    layer = random_layer(spec, seed=7)
    moe = FusedMoE(spec=spec, weights=layer.weights, router_weight=layer.router_weight, device="cpu")
    x = torch.randn(11, spec.H, dtype=spec.act_dtype)
    out = moe(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
