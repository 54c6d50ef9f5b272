"""The reference: invariants that any correct MoE must satisfy, and early, specific errors."""

import re
import time
from dataclasses import replace

import pytest
import torch

from moekit import (
    DeviceError,
    DTypeError,
    ExpertIdError,
    ExpertWeights,
    FormatError,
    FusedMoE,
    GateLayout,
    LayoutMismatchError,
    MoESpec,
    RouterWeightPlacement,
    RoutingMethod,
    RoutingResult,
    RoutingSpec,
    ShapeError,
    SpecError,
    WeightFormat,
    fused_moe_reference,
    plan,
    prepare_weights,
    preset,
    route,
)
from moekit.reference import TOLERANCE, relative_l2_error, tolerance
from moekit.spec import Activation, ActivationQuant, ActivationSpec, Fp8Scale
from moekit.synthetic import random_layer, random_tokens
from oracle_loop import fused_moe_per_token_loop

SMALL_OSS = MoESpec(
    num_experts=8,
    top_k=2,
    hidden_size=64,
    intermediate_size=48,
    weight_format=WeightFormat.MXFP4,
    activation=ActivationSpec.gpt_oss(),
    gate_layout=GateLayout.INTERLEAVED,
    has_bias=True,
    act_dtype=torch.float32,
)


def _setup(spec, t=5, seed=0):
    layer = random_layer(spec, seed=seed)
    x = random_tokens(spec, t, seed=seed + 1)
    routing = route(
        torch.randn(t, spec.E, generator=torch.Generator().manual_seed(seed)), top_k=spec.K, spec=spec.routing
    )
    return layer.weights, x, routing


def test_layout_conversion_preserves_the_function():
    # Converting w13 between layouts (with the spec following) must not change the output at all.
    for fmt in (WeightFormat.FP32, WeightFormat.MXFP4):
        spec = replace(SMALL_OSS, weight_format=fmt)
        weights, x, routing = _setup(spec)
        out = fused_moe_reference(x, weights, routing, spec=spec)
        concat = weights.to_layout(GateLayout.CONCAT)
        assert concat.gate_layout is GateLayout.CONCAT
        out2 = fused_moe_reference(x, concat, routing, spec=replace(spec, gate_layout=GateLayout.CONCAT))
        torch.testing.assert_close(out, out2, rtol=0, atol=0)
        back = concat.to_layout(GateLayout.INTERLEAVED)
        assert torch.equal(back.w13, weights.w13) and torch.equal(back.b13, weights.b13)


def test_concat_weights_where_spec_says_interleaved_is_refused():
    weights, x, routing = _setup(SMALL_OSS)
    with pytest.raises(
        LayoutMismatchError, match="CONCAT gate layout but the spec says INTERLEAVED.*to_layout"
    ):
        fused_moe_reference(x, weights.to_layout(GateLayout.CONCAT), routing, spec=SMALL_OSS)


def test_gate_and_up_are_not_interchangeable():
    # Reading INTERLEAVED weights as CONCAT must change the result (else layout tests prove nothing).
    spec = replace(SMALL_OSS, weight_format=WeightFormat.FP32)
    weights, x, routing = _setup(spec)
    right = fused_moe_reference(x, weights, routing, spec=spec)
    mislabeled = replace(weights, gate_layout=GateLayout.CONCAT)
    wrong = fused_moe_reference(x, mislabeled, routing, spec=replace(spec, gate_layout=GateLayout.CONCAT))
    assert relative_l2_error(wrong, right) > 0.1


def test_expert_parallel_shards_sum_to_the_whole():
    spec = replace(SMALL_OSS, weight_format=WeightFormat.FP32)
    weights, x, routing = _setup(spec, t=9)
    full = fused_moe_reference(x, weights, routing, spec=spec)
    total = torch.zeros_like(full)
    for rank, owned in enumerate(([0, 2, 4, 6], [1, 3, 5, 7])):
        expert_map = torch.full((spec.E,), -1, dtype=torch.int32)
        expert_map[owned] = torch.arange(4, dtype=torch.int32)
        local = replace(
            weights,
            w13=weights.w13[owned],
            w2=weights.w2[owned],
            b13=weights.b13[owned],
            b2=weights.b2[owned],
        )
        part = fused_moe_reference(
            x, local, routing, spec=replace(spec, num_local_experts=4), expert_map=expert_map
        )
        assert part.abs().sum() > 0, f"rank {rank} contributed nothing"
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def test_router_weight_on_input_for_k1():
    spec = MoESpec(
        num_experts=4,
        top_k=1,
        hidden_size=32,
        intermediate_size=16,
        weight_format=WeightFormat.FP32,
        act_dtype=torch.float32,
        router_weight_placement=RouterWeightPlacement.INPUT,
        routing=RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=False),
    )  # weights != 1 at K=1
    weights, x, routing = _setup(spec)
    assert (routing.weights < 1).all()
    out = fused_moe_reference(x, weights, routing, spec=spec)
    # Silu is not homogeneous, so w on the input differs from w on the output:
    out_spec = replace(spec, router_weight_placement=RouterWeightPlacement.OUTPUT)
    assert relative_l2_error(fused_moe_reference(x, weights, routing, spec=out_spec), out) > 1e-3
    # ...and equals running the expert on the pre-scaled input with unit weights.
    ones = RoutingResult(weights=torch.ones_like(routing.weights), ids=routing.ids)
    torch.testing.assert_close(fused_moe_reference(x * routing.weights, weights, ones, spec=out_spec), out)


@pytest.mark.parametrize("kind", list(Activation))
def test_clamp_limit_changes_large_inputs_only(kind):
    alpha = 1.702 if kind is Activation.SWIGLU_OAI else None
    spec = replace(SMALL_OSS, weight_format=WeightFormat.FP32, activation=ActivationSpec(kind, alpha=alpha))
    weights, x, routing = _setup(spec)
    unclamped = fused_moe_reference(x, weights, routing, spec=spec)
    loose = replace(spec, activation=ActivationSpec(kind, alpha=alpha, limit=1e6))
    # Same values up to fp32 rounding (clamping makes a contiguous copy; vectorized silu rounds differently).
    torch.testing.assert_close(fused_moe_reference(x, weights, routing, spec=loose), unclamped)
    tight = replace(spec, activation=ActivationSpec(kind, alpha=alpha, limit=0.01))
    assert relative_l2_error(fused_moe_reference(x, weights, routing, spec=tight), unclamped) > 1e-2


# ----- against the independent per-token loop (tests/oracle_loop.py) ----------------------------------------
@pytest.mark.parametrize("limit", [None, 0.1], ids=["no_limit", "limit"])
@pytest.mark.parametrize("kind", list(Activation), ids=lambda k: k.name)
def test_every_activation_matches_the_per_token_loop(kind, limit):
    alpha = 1.702 if kind is Activation.SWIGLU_OAI else None
    spec = replace(SMALL_OSS, weight_format=WeightFormat.FP32, activation=ActivationSpec(kind, alpha, limit))
    weights, x, routing = _setup(spec, t=6)
    got = fused_moe_reference(x, weights, routing, spec=spec)
    assert relative_l2_error(got, fused_moe_per_token_loop(x, weights, routing, spec=spec)) < 1e-5


@pytest.mark.parametrize(
    ("fp8_scale", "act_quant", "hidden"),
    [
        (Fp8Scale.PER_CHANNEL, ActivationQuant.FP8_PER_TOKEN, 64),
        (Fp8Scale.BLOCK_128, ActivationQuant.FP8_PER_GROUP_128, 200),  # a ragged last group of 72
    ],
    ids=["per_token", "per_group_128"],
)
def test_fp8_activations_match_the_per_token_loop(fp8_scale, act_quant, hidden):
    spec = replace(
        SMALL_OSS,
        hidden_size=hidden,
        intermediate_size=160,
        weight_format=WeightFormat.FP8_E4M3,
        fp8_scale=fp8_scale,
        act_quant=act_quant,
        activation=ActivationSpec(Activation.SILU),
        gate_layout=GateLayout.CONCAT,
    )
    weights, x, routing = _setup(spec, t=6)
    got = fused_moe_reference(x, weights, routing, spec=spec)
    assert relative_l2_error(got, fused_moe_per_token_loop(x, weights, routing, spec=spec)) < 1e-5


def test_expert_map_and_input_router_weights_match_the_per_token_loop():
    spec = replace(
        SMALL_OSS,
        top_k=1,
        num_local_experts=4,
        router_weight_placement=RouterWeightPlacement.INPUT,
        weight_format=WeightFormat.FP32,
    )
    weights, x, routing = _setup(spec, t=9)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    got = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    expected = fused_moe_per_token_loop(x, weights, routing, spec=spec, expert_map=expert_map)
    assert expected.abs().sum() > 0 and (expected[(expert_map[routing.ids.long()] < 0).squeeze(1)] == 0).all()
    assert relative_l2_error(got, expected) < 1e-5


def test_bad_inputs_fail_before_compute():
    weights, x, routing = _setup(SMALL_OSS)
    with pytest.raises(ShapeError, match="x must be \\[T, H=64\\]"):
        fused_moe_reference(x[:, :32], weights, routing, spec=SMALL_OSS)
    with pytest.raises(DTypeError, match="spec.act_dtype is torch.float32"):
        fused_moe_reference(x.half(), weights, routing, spec=SMALL_OSS)
    with pytest.raises(ShapeError, match="routing is \\[T=5"):
        fused_moe_reference(x[:3], weights, routing, spec=SMALL_OSS)
    bad_ids = RoutingResult(weights=routing.weights, ids=routing.ids.clone().fill_(8))
    with pytest.raises(ExpertIdError, match="E=8"):
        fused_moe_reference(x, weights, bad_ids, spec=SMALL_OSS)
    with pytest.raises(DeviceError, match="meta"):
        fused_moe_reference(x.to("meta"), weights, routing, spec=SMALL_OSS)
    with pytest.raises(ShapeError, match="w2 has 32 rows \\(H\\)"):
        fused_moe_reference(x, replace(weights, w2=weights.w2[:, :32]), routing, spec=SMALL_OSS)
    with pytest.raises(DTypeError, match="weights are MXFP4 but the spec says BF16"):
        fused_moe_reference(x, weights, routing, spec=replace(SMALL_OSS, weight_format=WeightFormat.BF16))
    with pytest.raises(SpecError, match="needs an expert_map"):
        fused_moe_reference(x, weights, routing, spec=replace(SMALL_OSS, num_local_experts=8))


def test_nan_scale_bytes_are_caught_on_request():
    weights, _, _ = _setup(SMALL_OSS)
    scales = weights.w2_scale.clone()
    scales[3, 1, 0] = 0xFF
    poisoned = replace(weights, w2_scale=scales)
    poisoned.validate(SMALL_OSS)  # opt-in: the default validation does not scan scale bytes
    with pytest.raises(FormatError, match="w2_scale"):
        poisoned.validate(SMALL_OSS, check_nan_scales=True)


def test_weight_container_refuses_inconsistent_parts():
    w = torch.randn(2, 8, 16)
    with pytest.raises(ShapeError, match="both biases"):
        ExpertWeights(
            format=WeightFormat.FP32,
            gate_layout=GateLayout.CONCAT,
            w13=w,
            w2=torch.randn(2, 16, 4),
            b13=torch.zeros(2, 8),
        )
    with pytest.raises(FormatError, match="take no scales"):
        ExpertWeights(
            format=WeightFormat.FP32,
            gate_layout=GateLayout.CONCAT,
            w13=w,
            w2=torch.randn(2, 16, 4),
            w13_scale=torch.ones(2),
        )
    with pytest.raises(ShapeError, match="2I rows"):
        ExpertWeights(
            format=WeightFormat.FP32,
            gate_layout=GateLayout.CONCAT,
            w13=torch.randn(2, 7, 16),
            w2=torch.randn(2, 16, 4),
        )


def test_weight_container_type_checks_every_field_when_built():
    parts = dict(format=WeightFormat.FP32, gate_layout=GateLayout.CONCAT, w13=torch.randn(2, 8, 16))
    w2 = torch.randn(2, 16, 4)
    with pytest.raises(ShapeError, match="hidden_size must be None or a positive int, got '16' .*number 16"):
        ExpertWeights(**parts, w2=w2, hidden_size="16")
    with pytest.raises(DTypeError, match="ExpertWeights.b13 must be None or a torch.Tensor, got list"):
        ExpertWeights(**parts, w2=w2, b13=[0.0], b2=torch.zeros(2, 16))
    with pytest.raises(DTypeError, match="ExpertWeights.w2_scale must be None or a torch.Tensor, got float"):
        ExpertWeights(**parts, w2=w2, w2_scale=1.0)
    with pytest.raises(
        DTypeError, match="ExpertWeights.format must be a WeightFormat.*pass WeightFormat.FP32"
    ):
        ExpertWeights(**{**parts, "format": "fp32"}, w2=w2)


def test_from_float_refuses_what_the_constructor_refuses():
    w13, w2 = torch.randn(4, 128, 64), torch.randn(4, 64, 64)
    with pytest.raises(
        DTypeError, match="from_float\\(format=...\\) must be a WeightFormat.*WeightFormat.BF16"
    ):
        ExpertWeights.from_float(w13=w13, w2=w2, format="bf16", gate_layout=GateLayout.CONCAT)
    for fmt in (WeightFormat.BF16, WeightFormat.MXFP4):
        with pytest.raises(DTypeError, match=f"fp8_scale=Fp8Scale.PER_TENSOR given for {fmt.name} weights"):
            ExpertWeights.from_float(
                w13=w13, w2=w2, format=fmt, fp8_scale=Fp8Scale.PER_TENSOR, gate_layout=GateLayout.CONCAT
            )


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "bf16", None])
def test_dequantized_takes_only_a_float_dtype_weights_are_stored_in(dtype):
    weights, _, _ = _setup(SMALL_OSS)
    with pytest.raises(DTypeError, match="dequantized\\(dtype\\) must be torch.float32, torch.bfloat16 or"):
        weights.dequantized(dtype)
    assert weights.dequantized(torch.bfloat16).w13.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("fp8_scale", [Fp8Scale.PER_TENSOR, Fp8Scale.BLOCK_128])
def test_fp8_scales_no_checkpoint_may_hold_are_refused_at_load(bad, fp8_scale):
    spec = replace(SMALL_OSS, weight_format=WeightFormat.FP8_E4M3, fp8_scale=fp8_scale)
    weights = random_layer(spec).weights
    scale = weights.w2_scale.clone()
    scale.view(-1)[-1] = bad
    poisoned = replace(weights, w2_scale=scale)
    poisoned.validate(spec)  # opt-in, as for MXFP4 scale bytes
    last = tuple(d - 1 for d in scale.shape)
    fragment = f"1 of {scale.numel()} FP8 weight scales are not finite and > 0, first {bad!r} at index {last}"
    fragment = "w2_scale: " + fragment
    with pytest.raises(FormatError, match=re.escape(fragment)):
        poisoned.validate(spec, check_nan_scales=True)
    with pytest.raises(FormatError, match=re.escape(fragment)):
        prepare_weights(poisoned, plan(spec, num_tokens=1, device="cpu"))
    with pytest.raises(FormatError, match=re.escape(fragment)):
        FusedMoE(spec=spec, weights=poisoned, router_weight=None)


@pytest.mark.parametrize("scan_bytes", [None, 1], ids=["whole", "an-expert-a-slice"])
@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
def test_fp8_nan_codes_no_checkpoint_may_hold_are_refused_at_load(nan_byte, scan_bytes, monkeypatch):
    from moekit.formats import fp8

    if scan_bytes is not None:
        monkeypatch.setattr(fp8, "_SCAN_CHUNK_BYTES", scan_bytes)
    spec = replace(SMALL_OSS, weight_format=WeightFormat.FP8_E4M3, fp8_scale=Fp8Scale.PER_CHANNEL)
    weights = random_layer(spec).weights
    w13 = weights.w13.clone()
    w13.view(torch.uint8)[1, 2, 3] = nan_byte
    poisoned = replace(weights, w13=w13)
    poisoned.validate(spec)  # opt-in, as for the scales
    fragment = (
        f"w13: 1 of {w13.numel()} FP8 weight codes are NaN (E4M3 0x7F / 0xFF), first at index (1, 2, 3)"
    )
    with pytest.raises(FormatError, match=re.escape(fragment)):
        poisoned.validate(spec, check_nan_scales=True)
    with pytest.raises(FormatError, match=re.escape(fragment)):
        FusedMoE(spec=spec, weights=poisoned, router_weight=None)
    w13.view(torch.uint8)[1, 2, 3] = 0x7E  # 448, the largest finite code: accepted
    FusedMoE(spec=spec, weights=replace(weights, w13=w13), router_weight=None)


def test_reference_is_fast_enough_at_gpt_oss_20b_size():
    # Issue 2: usable at real sizes on a CPU for small T (seconds, not minutes).
    spec = preset("gpt-oss-20b")
    weights, x, routing = _setup(spec, t=4)
    start = time.perf_counter()
    out = fused_moe_reference(x, weights, routing, spec=spec)
    elapsed = time.perf_counter() - start
    assert torch.isfinite(out.float()).all() and out.float().abs().sum() > 0
    assert elapsed < 30, f"reference took {elapsed:.1f} s for T=4 at gpt-oss-20b size"


def test_synthetic_mxfp4_tails_are_zero_codes():
    # Ragged in_dim (H=70: 6 real elements in the last group of 32; I=48: 16) leaves padding codes at zero.
    spec = replace(SMALL_OSS, hidden_size=70, intermediate_size=48)
    weights = random_layer(spec, seed=1).weights
    for blocks, in_dim in ((weights.w13, 70), (weights.w2, 48)):
        last = blocks[..., -1, :]
        nibbles = torch.stack([last & 0x0F, last >> 4], dim=-1).flatten(-2)  # element order: low nibble first
        assert (nibbles[..., in_dim % 32 :] == 0).all()
        assert (nibbles[..., : in_dim % 32] != 0).any()


def test_tolerance_follows_the_output_dtype_unless_activations_are_fp8() -> None:
    fp16 = preset("gpt-oss-20b", act_dtype=torch.float16)
    assert tolerance(fp16) == TOLERANCE[torch.float16]
    w8a8 = preset("deepseek-v3", act_dtype=torch.float16)
    assert w8a8.act_quant is not ActivationQuant.NONE
    # E4M3 re-quantization of the intermediate sets the error, whatever the output dtype.
    assert tolerance(w8a8) == tolerance(replace(w8a8, act_dtype=torch.bfloat16)) == 1e-2
