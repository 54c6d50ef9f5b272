"""The public operations at their edges: values they must refuse, plans they must not trust, arguments that
are not tensors, tensors on another device than the plan.

Data flow per case: a small GPT-OSS-like spec -> `random_layer` -> `plan` / `prepare_weights` / `fused_moe`
(`fused_moe_reference`, `route`, `FusedMoE`) with one thing wrong -> the moekit error that names it, raised
before any kernel runs (kernels that must not run are replaced by ones that fail the test).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fake_kernels import CudaGroupedKernel, SiluGeluOnlyKernel, TileConfig
from moekit import (
    Activation,
    ActivationSpec,
    DeviceError,
    DTypeError,
    FormatError,
    GateLayout,
    MoESpec,
    RoutingResult,
    ShapeError,
    UnsupportedSpecError,
    WeightFormat,
    fused_moe,
    fused_moe_reference,
    plan,
    prepare_weights,
    route,
)
from moekit.errors import ArgumentError
from moekit.kernels.base import DeviceInfo, DeviceKind
from moekit.kernels.reference import ReferenceKernel
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.layer import FusedMoE
from moekit.ops import _plan_reason
from moekit.synthetic import random_layer, random_tokens

SPEC = MoESpec(
    num_experts=8,
    top_k=2,
    hidden_size=64,
    intermediate_size=32,
    weight_format=WeightFormat.MXFP4,
    act_dtype=torch.float32,
    activation=ActivationSpec.gpt_oss(),
    gate_layout=GateLayout.INTERLEAVED,
    has_bias=True,
)
REFERENCE_ONLY = KernelRegistry([ReferenceKernel()])  # runs the weights as given: no repacking
H200 = DeviceInfo(DeviceKind.CUDA, "NVIDIA H200", (9, 0))


def _inputs(t: int = 4):
    layer = random_layer(SPEC, seed=3)
    x = random_tokens(SPEC, t)
    logits = torch.nn.functional.linear(x, layer.router_weight)
    return layer, x, route(logits, top_k=SPEC.K, spec=SPEC.routing)


def _poisoned(weights, name: str = "w2_scale"):
    scales = getattr(weights, name).clone()
    scales[1, 2, 0] = 0xFF  # E8M0 NaN
    return replace(weights, **{name: scales})


# ----- a 0xFF (NaN) MXFP4 scale byte -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["w13_scale", "w2_scale"])
def test_nan_scale_byte_is_refused_on_the_plan_prepare_fused_moe_path(name: str) -> None:
    layer, x, routing = _inputs()
    bad = _poisoned(layer.weights, name)
    cpu_plan = plan(SPEC, num_tokens=4, device="cpu")  # torch_grouped: would dequantize the NaN into w
    with pytest.raises(FormatError, match=rf"{name}: 1 of .*0xFF.*\(1, 2, 0\)"):
        prepare_weights(bad, cpu_plan)
    ref_plan = plan(SPEC, num_tokens=4, device="cpu", registry=REFERENCE_ONLY)
    with pytest.raises(FormatError, match=name):
        prepare_weights(bad, ref_plan, registry=REFERENCE_ONLY)
    with pytest.raises(FormatError, match=name):  # unprepared weights straight into fused_moe
        fused_moe(x, bad, routing, plan=ref_plan, registry=REFERENCE_ONLY)
    with pytest.raises(FormatError, match=name):
        fused_moe_reference(x, bad, routing, spec=SPEC)


def test_scale_bytes_are_scanned_once_and_again_after_an_in_place_change() -> None:
    layer, x, routing = _inputs()
    ref_plan = plan(SPEC, num_tokens=4, device="cpu", registry=REFERENCE_ONLY)
    prepared = prepare_weights(layer.weights, ref_plan, registry=REFERENCE_ONLY)
    out = fused_moe(x, prepared, routing, plan=ref_plan, registry=REFERENCE_ONLY)
    assert torch.isfinite(out).all()
    prepared.w13_scale[0, 0, 0] = 0xFF  # the same tensor, edited in place after it was scanned
    with pytest.raises(FormatError, match="w13_scale"):
        fused_moe(x, prepared, routing, plan=ref_plan, registry=REFERENCE_ONLY)


# ----- a plan built or edited by hand ----------------------------------------------------------------------
def test_a_hand_edited_plan_cannot_run_an_incapable_kernel(monkeypatch) -> None:
    registry = default_registry().with_kernels(SiluGeluOnlyKernel())
    layer, x, routing = _inputs()
    good = plan(SPEC, num_tokens=4, device="cpu", registry=registry)
    assert good.kernel != "silu_gelu_only"  # the planner refused it: SWIGLU_OAI is not SILU
    weights = prepare_weights(layer.weights, good, registry=registry)
    monkeypatch.setattr(SiluGeluOnlyKernel, "run", lambda *a: pytest.fail("ran an incapable kernel"))
    edited = replace(good, kernel="silu_gelu_only")
    match = r"kernel 'silu_gelu_only'.*activation SWIGLU_OAI not in GELU/SILU"
    with pytest.raises(UnsupportedSpecError, match=match):
        fused_moe(x, weights, routing, plan=edited, registry=registry)
    with pytest.raises(UnsupportedSpecError, match=match):
        prepare_weights(layer.weights, edited, registry=registry)
    with pytest.raises(UnsupportedSpecError, match=r"config \{'block_m': 16\}.*TileConfig.*torch_grouped"):
        fused_moe(x, weights, routing, plan=replace(good, config=TileConfig()), registry=registry)


def test_a_capable_kernel_runs_and_the_plan_check_is_cached() -> None:
    registry = default_registry().with_kernels(SiluGeluOnlyKernel())
    silu = replace(SPEC, activation=ActivationSpec(Activation.SILU, limit=7.0))
    layer = random_layer(silu, seed=3)
    x = random_tokens(silu, 4)
    routing = route(torch.nn.functional.linear(x, layer.router_weight), top_k=silu.K, spec=silu.routing)
    chosen = plan(silu, num_tokens=4, device="cpu", registry=registry)
    assert chosen.kernel == "silu_gelu_only"  # capable here, and first by priority
    expected = fused_moe_reference(x, layer.weights, routing, spec=silu)
    fused_moe(x, layer.weights, routing, plan=chosen, registry=registry)
    before = _plan_reason.cache_info()
    for _ in range(3):
        out = fused_moe(x, layer.weights, routing, plan=chosen, registry=registry)
    after = _plan_reason.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ----- arguments that are not tensors ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "given", [[[0.0] * 64] * 4, np.zeros((4, 64), dtype=np.float32), 3.0], ids=["list", "numpy", "float"]
)
def test_x_that_is_not_a_tensor_is_a_moekit_error_everywhere(given) -> None:
    layer, _, routing = _inputs()
    kind = type(given).__name__
    cpu_plan = plan(SPEC, num_tokens=4, device="cpu")
    weights = prepare_weights(layer.weights, cpu_plan)
    with pytest.raises(ShapeError, match=rf"x must be a torch.Tensor .*got a {kind}"):
        fused_moe(given, weights, routing, plan=cpu_plan)
    with pytest.raises(ShapeError, match=rf"x must be a torch.Tensor .*got a {kind}"):
        fused_moe_reference(given, layer.weights, routing, spec=SPEC)
    with pytest.raises(ShapeError, match=rf"router logits must be a torch.Tensor .*got a {kind}"):
        route(given, top_k=2, spec=SPEC.routing)
    moe = FusedMoE(spec=SPEC, weights=layer.weights, router_weight=layer.router_weight)
    with pytest.raises(ShapeError, match=rf"hidden_states must be a torch.Tensor .*got a {kind}"):
        moe(given)


def test_containers_that_are_not_moekit_types_are_named() -> None:
    layer, x, routing = _inputs()
    cpu_plan = plan(SPEC, num_tokens=4, device="cpu")
    weights = prepare_weights(layer.weights, cpu_plan)
    with pytest.raises(DTypeError, match="plan must be a moekit Plan, got a dict"):
        fused_moe(x, weights, routing, plan={"kernel": "torch_grouped"})
    with pytest.raises(DTypeError, match="weights must be a moekit ExpertWeights, got a list"):
        fused_moe(x, [weights.w13, weights.w2], routing, plan=cpu_plan)
    with pytest.raises(DTypeError, match="routing must be a moekit RoutingResult, got a tuple"):
        fused_moe(x, weights, (routing.weights, routing.ids), plan=cpu_plan)
    with pytest.raises(DTypeError, match="weights must be"):
        prepare_weights({"w13": weights.w13}, cpu_plan)


@pytest.mark.parametrize("flag", [0, 1, "no", None], ids=["zero", "one", "no", "none"])
def test_check_values_that_is_not_a_bool_is_refused_before_any_launch(flag, monkeypatch) -> None:
    # 0 would turn the checks off and let id 8 (E=8) into the kernel; "no" would read as True.
    layer, x, _ = _inputs()
    cpu_plan = plan(SPEC, num_tokens=4, device="cpu")
    weights = prepare_weights(layer.weights, cpu_plan)
    ids = torch.tensor([[8, 0]] * 4, dtype=torch.int32)
    bad = RoutingResult(weights=torch.full((4, 2), 0.5), ids=ids)
    monkeypatch.setattr("moekit.ops.run_checked", lambda *a, **k: pytest.fail("ran despite a bad flag"))
    with pytest.raises(ArgumentError, match=r"fused_moe\(check_values=\.\.\.\) must be True or False"):
        fused_moe(x, weights, bad, plan=cpu_plan, check_values=flag)


# ----- tensors on another device than the plan -------------------------------------------------------------
def test_cpu_tensors_with_a_cuda_plan_are_refused_before_any_launch(monkeypatch) -> None:
    registry = KernelRegistry([ReferenceKernel(), CudaGroupedKernel()])
    layer, x, routing = _inputs()
    cuda_plan = plan(SPEC, num_tokens=4, device=H200, registry=registry)
    assert cuda_plan.kernel == "cuda_grouped"
    weights = prepare_weights(layer.weights, cuda_plan, registry=registry)  # load time: any device
    monkeypatch.setattr(CudaGroupedKernel, "run", lambda *a: pytest.fail("launched on the wrong device"))
    match = r"plan was made for NVIDIA H200 \(sm_90\) \(cuda\) but x is on cpu.*device='cpu'"
    with pytest.raises(DeviceError, match=match):
        fused_moe(x, weights, routing, plan=cuda_plan, registry=registry)
    default_cuda = plan(SPEC, num_tokens=4, device=H200)  # whatever the default registry picks for CUDA
    with pytest.raises(DeviceError, match="cuda"):
        fused_moe(x, weights, routing, plan=default_cuda)
