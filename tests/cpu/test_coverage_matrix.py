"""Coverage matrix: for every weight format x activation (with and without clamp) x gate layout x bias x
router placement, and each registered kernel alone, the plan either runs and matches the oracle
(`fused_moe_reference`) within the tolerance table, or is refused at plan time with UnsupportedSpecError.
Nothing else, ever. The oracle itself is checked on the same matrix against the per-token loop, a second
spelling of the math that shares none of its code, so the `reference` kernel's row (which runs the
oracle) does not merely compare the oracle with itself.
"""

import functools
import itertools
from dataclasses import replace

import pytest
import torch

import moekit
from moekit import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    UnsupportedSpecError,
    WeightFormat,
)
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.ops import fused_moe, prepare_weights
from moekit.planning.plan import plan
from moekit.reference import relative_l2_error
from moekit.synthetic import random_layer, random_tokens
from oracle_loop import fused_moe_per_token_loop

# (format, fp8 scale, activation quantization, activation dtype); fp32 activations where the kernel's own
# arithmetic can be exact, so a wrong element shows; one bf16 row to cover the bf16 rounding path.
FORMATS = [
    (WeightFormat.FP32, None, ActivationQuant.NONE, torch.float32),
    (WeightFormat.BF16, None, ActivationQuant.NONE, torch.bfloat16),
    (WeightFormat.FP16, None, ActivationQuant.NONE, torch.float32),
    (WeightFormat.MXFP4, None, ActivationQuant.NONE, torch.float32),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_TENSOR, ActivationQuant.NONE, torch.float32),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_CHANNEL, ActivationQuant.FP8_PER_TOKEN, torch.float32),
    (WeightFormat.FP8_E4M3, Fp8Scale.BLOCK_128, ActivationQuant.FP8_PER_GROUP_128, torch.float32),
]
ACTIVATIONS = [
    ActivationSpec(kind, alpha=1.702 if kind is Activation.SWIGLU_OAI else None, limit=limit)
    for kind in Activation
    for limit in (None, 0.5)
]  # 0.5 clamps a good share of values
# Relative L2 error allowed against the fp32 reference, by activation dtype. fp32 paths differ only by
# summation order; bf16 rounds x, h and the output to 8 bits.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _specs():
    for (fmt, scale, quant, dtype), act, layout, bias, placement in itertools.product(
        FORMATS, ACTIVATIONS, GateLayout, (False, True), RouterWeightPlacement
    ):
        if layout is GateLayout.INTERLEAVED and scale is Fp8Scale.BLOCK_128:
            continue  # not expressible: a 128-row scale block would mix gate and up rows of 2 scales
        top_k = 1 if placement is RouterWeightPlacement.INPUT else 2
        # H=160: MXFP4 ragged (5 groups), FP8 blocks ragged (2 of 128); I=72 ragged too.
        yield MoESpec(
            num_experts=6,
            top_k=top_k,
            hidden_size=160,
            intermediate_size=72,
            weight_format=fmt,
            fp8_scale=scale,
            act_quant=quant,
            act_dtype=dtype,
            activation=act,
            gate_layout=layout,
            has_bias=bias,
            router_weight_placement=placement,
            routing=moekit.RoutingSpec(moekit.RoutingMethod.SOFTMAX_TOPK, renormalize=False),
        )


SPECS = list(_specs())


@functools.cache
def _case(index: int):
    """(layer, x, routing, oracle output) of SPECS[index], shared by every kernel's row."""
    spec = SPECS[index]
    layer = random_layer(spec, seed=index)
    x = random_tokens(spec, 5, seed=index)
    logits = x.float() @ layer.router_weight.float().T
    routing = moekit.route(logits, top_k=spec.K, spec=spec.routing)
    return layer, x, routing, moekit.fused_moe_reference(x, layer.weights, routing, spec=spec)


@pytest.mark.parametrize("kernel_name", default_registry().names)
def test_coverage_matrix(kernel_name):
    registry = KernelRegistry([default_registry().get(kernel_name)])
    ran = refused = 0
    for index, spec in enumerate(SPECS):
        try:
            result = plan(spec, num_tokens=5, device="cpu", registry=registry, tuned=None)
        except UnsupportedSpecError as err:
            assert kernel_name in str(err)
            refused += 1
            continue
        layer, x, routing, expected = _case(index)
        out = fused_moe(
            x,
            prepare_weights(layer.weights, result, registry=registry),
            routing,
            plan=result,
            registry=registry,
        )
        err = relative_l2_error(out, expected)
        assert err <= TOLERANCE[spec.act_dtype], f"{kernel_name} on {spec.describe()}: rel L2 {err:.2e}"
        ran += 1
    assert ran + refused == len(SPECS)
    # On a CPU the CUDA-only kernels refuse everything; CPU kernels must run the whole matrix.
    cpu_kernel = registry.get(kernel_name).capabilities.devices != {moekit.kernels.base.DeviceKind.CUDA}
    assert (ran == len(SPECS)) if cpu_kernel else (ran == 0), (kernel_name, ran, refused)


def test_the_oracle_matches_the_per_token_loop_on_the_whole_matrix():
    for index, spec in enumerate(SPECS):
        layer, x, routing, expected = _case(index)
        loop = fused_moe_per_token_loop(x, layer.weights, routing, spec=spec)
        err = relative_l2_error(expected, loop)
        assert err <= TOLERANCE[spec.act_dtype], f"oracle on {spec.describe()}: rel L2 {err:.2e} vs the loop"


def test_matrix_covers_the_combinations():
    assert len(SPECS) == (len(FORMATS) * len(ACTIVATIONS) * 2 * 2 * 2) - (len(ACTIVATIONS) * 2 * 2)
    assert any(
        s.gate_layout is GateLayout.INTERLEAVED and s.weight_format is WeightFormat.MXFP4 for s in SPECS
    )
    assert {replace(s.activation, limit=None) for s in SPECS} == {replace(a, limit=None) for a in ACTIVATIONS}


def test_unfused_w8a8_in_bf16_matches_the_reference():
    # Regression (H200, 2026-11-29, `moekit check --all`): the unfused path ran W8A8 GEMMs in bf16 and
    # the re-quantized intermediate flipped FP8 codes: 1.7e-2 on DeepSeek-V3 shapes. It now runs in fp32.
    spec = MoESpec(
        num_experts=16,
        top_k=8,
        hidden_size=1024,
        intermediate_size=512,
        weight_format=WeightFormat.FP8_E4M3,
        fp8_scale=Fp8Scale.BLOCK_128,
        act_quant=ActivationQuant.FP8_PER_GROUP_128,
        act_dtype=torch.bfloat16,
        activation=ActivationSpec(Activation.SILU),
    )
    layer = random_layer(spec, seed=0)
    x = random_tokens(spec, 64)
    routing = moekit.route(
        torch.randn(64, 16, generator=torch.Generator().manual_seed(0)), top_k=8, spec=spec.routing
    )
    registry = KernelRegistry([default_registry().get("torch_grouped")])
    result = plan(spec, num_tokens=64, device="cpu", registry=registry, tuned=None)
    out = fused_moe(
        x, prepare_weights(layer.weights, result, registry=registry), routing, plan=result, registry=registry
    )
    expected = moekit.fused_moe_reference(x, layer.weights, routing, spec=spec)
    assert relative_l2_error(out, expected) <= 1e-5  # only the final bf16 cast of the output differs
