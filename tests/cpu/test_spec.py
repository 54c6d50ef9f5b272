"""MoESpec and its parts refuse inconsistent fields with messages that name the values."""

import dataclasses

import pytest
import torch

from moekit import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    MoESpec,
    RouterWeightPlacement,
    RoutingMethod,
    RoutingSpec,
    SpecError,
    WeightFormat,
    preset,
)
from moekit.presets import PRESETS


def test_presets_match_guide_table():
    oss = preset("gpt-oss-120b")
    assert (oss.E, oss.K, oss.H, oss.I) == (128, 4, 2880, 2880)
    assert oss.activation == ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0)
    ds = preset("deepseek-v3")
    assert (ds.E, ds.K, ds.H, ds.I, ds.fp8_scale) == (256, 8, 7168, 2048, Fp8Scale.BLOCK_128)
    assert preset("Mixtral-8x7B").I == 14336  # case-insensitive lookup
    assert len(PRESETS) >= 6


def test_spec_is_frozen_and_hashable():
    spec = preset("gpt-oss-20b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.top_k = 2
    assert hash(spec) == hash(preset("gpt-oss-20b"))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(top_k=9), "cannot exceed num_experts E=8"),  # K > E
        (dict(hidden_size=0), "hidden_size must be a positive int, got 0"),
        (dict(intermediate_size=2.5), "intermediate_size must be a positive int"),
        (dict(weight_format="mxfp4"), "must be a WeightFormat"),  # strings are not enums
        (dict(weight_format=WeightFormat.FP8_E4M3), "need fp8_scale"),
        (dict(fp8_scale=Fp8Scale.PER_CHANNEL), "only applies to FP8_E4M3, not BF16"),
        (
            dict(act_quant=ActivationQuant.FP8_PER_TOKEN),
            "or MXFP4 .W4A8. weights, got BF16",
        ),
        (
            dict(
                weight_format=WeightFormat.FP8_E4M3,
                fp8_scale=Fp8Scale.PER_CHANNEL,
                act_quant=ActivationQuant.FP8_PER_GROUP_128,
            ),
            "pairs with BLOCK_128",
        ),
        (dict(act_dtype=torch.int8), "act_dtype must be one of"),
        (dict(router_weight_placement=RouterWeightPlacement.INPUT), "only defined for K=1, got K=2"),
        (dict(num_local_experts=9), "num_local_experts must be None or in [1, E=8], got 9"),
        (
            dict(routing=RoutingSpec(RoutingMethod.SIGMOID_GROUPED, n_group=3, topk_group=1)),
            "E=8 is not divisible by n_group=3",
        ),
        (
            dict(routing=RoutingSpec(RoutingMethod.SIGMOID_GROUPED, n_group=8, topk_group=1)),
            "exceeds the experts in the 1 groups kept",
        ),
    ],
)
def test_spec_refuses(kwargs, fragment):
    base = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    with pytest.raises(SpecError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        MoESpec(**{**base, **kwargs})


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(kind=Activation.SWIGLU_OAI), "needs a finite alpha > 0"),
        (dict(kind=Activation.SILU, alpha=1.0), "only meaningful for SWIGLU_OAI"),
        (dict(kind=Activation.SILU, limit=0.0), r"None: no clamp\) must be None or a finite number > 0"),
        (dict(kind=Activation.GELU, limit=float("inf")), "must be None or a finite number > 0, got inf"),
    ],
)
def test_activation_refuses(kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        ActivationSpec(**kwargs)


def test_missing_limit_stays_none():
    # A missing limit must never become 7.0 (or 0) on its own.
    act = ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702)
    assert act.limit is None and "no clamp" in act.describe()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(method=RoutingMethod.TOPK_SOFTMAX, n_group=2, topk_group=1), "only apply to SIGMOID_GROUPED"),
        (dict(method=RoutingMethod.TOPK_SOFTMAX, renormalize=False), "renormalize=False is not defined"),
        (dict(method=RoutingMethod.SIGMOID_GROUPED, n_group=4), "give both n_group and topk_group"),
        (dict(method=RoutingMethod.SIGMOID_GROUPED, n_group=4, topk_group=5), "topk_group <= n_group"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a finite number > 0"),
    ],
)
def test_routing_spec_refuses(kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        RoutingSpec(**kwargs)


def test_spec_errors_are_value_errors():
    # Generic handlers written for ValueError keep working.
    with pytest.raises(ValueError):
        MoESpec(num_experts=2, top_k=3, hidden_size=8, intermediate_size=8)


def test_cap_experts_keeps_a_valid_spec():
    from moekit.presets import cap_experts

    ds = preset("deepseek-v3")
    assert cap_experts(ds, None) is ds and cap_experts(ds, 512) is ds
    assert cap_experts(ds, 16).routing.n_group == 8  # 4 kept groups of 2 still hold K=8 experts
    small = cap_experts(ds, 8)  # 4 kept groups of 1 cannot hold K=8: grouping is dropped
    assert (small.E, small.K, small.routing.n_group) == (8, 8, None)
    assert small.routing.has_correction_bias and small.routing.routed_scaling_factor == 2.5
    tiny = cap_experts(preset("qwen3-30b-a3b"), 4)
    assert (tiny.E, tiny.K) == (4, 4)
