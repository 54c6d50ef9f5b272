"""Bad values for every public field and argument are moekit errors naming the field, value and fix.

A string where a bool belongs must not read as true, a float where an int belongs must not pass, and no
bad value may surface as Python's own TypeError, AttributeError or RuntimeError from deep inside.
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit import (
    Activation,
    ActivationSpec,
    Fp8Scale,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
    preset,
)
from moekit.errors import ArgumentError, DeviceError, MoekitError, ShapeError, SpecError, TunedTableError
from moekit.kernels.base import DeviceInfo, DeviceKind
from moekit.planning.plan import plan
from moekit.presets import cap_experts

BASE = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
SPEC = MoESpec(**BASE)
GROUPED = dict(method=RoutingMethod.SIGMOID_GROUPED, n_group=4, topk_group=2)


@pytest.mark.parametrize(
    "build, field, shown",
    [
        # Strings are truthy: these were taken as True.
        (lambda: MoESpec(**BASE, has_bias="no"), "MoESpec.has_bias", "'no' (str)"),
        (lambda: RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize="false"), "renormalize", "'false'"),
        (lambda: RoutingSpec(**{**GROUPED, "has_correction_bias": "yes"}), "has_correction_bias", "'yes'"),
        (lambda: MoESpec(**BASE, has_bias=1), "MoESpec.has_bias", "1 (int)"),
        # Whole floats where ints belong: these passed (n_group) or gave no fix (top_k).
        (lambda: RoutingSpec(**{**GROUPED, "n_group": 4.0}), "RoutingSpec.n_group", "4.0 (float)"),
        (lambda: RoutingSpec(**{**GROUPED, "topk_group": 2.0}), "RoutingSpec.topk_group", "2.0 (float)"),
        (lambda: MoESpec(**{**BASE, "top_k": 2.0}), "MoESpec.top_k", "2.0 (float)"),
        # Bools where ints belong.
        (lambda: MoESpec(**{**BASE, "top_k": True}), "MoESpec.top_k", "True (bool)"),
        (lambda: RoutingSpec(**{**GROUPED, "topk_group": True}), "RoutingSpec.topk_group", "True (bool)"),
        (lambda: MoESpec(**BASE, num_local_experts=True), "num_local_experts", "True (bool)"),
        # Strings where numbers belong: these were TypeErrors from math.isfinite or a comparison.
        (lambda: RoutingSpec(routed_scaling_factor="2.5"), "routed_scaling_factor", "'2.5' (str)"),
        (lambda: RoutingSpec(routed_scaling_factor=True), "routed_scaling_factor", "True (bool)"),
        (lambda: RoutingSpec(**{**GROUPED, "n_group": "4"}), "RoutingSpec.n_group", "'4' (str)"),
        (lambda: ActivationSpec(Activation.SWIGLU_OAI, alpha="1.702"), "ActivationSpec.alpha", "'1.702'"),
        (lambda: ActivationSpec(Activation.SILU, limit="7"), "ActivationSpec.limit", "'7' (str)"),
        (lambda: ActivationSpec(Activation.SILU, limit=None), None, None),
        # Strings where enums belong.
        (lambda: ActivationSpec("silu"), "ActivationSpec.kind", "'silu' (str)"),
        (lambda: RoutingSpec("softmax_topk"), "RoutingSpec.method", "'softmax_topk'"),
        # The error path that raised AttributeError formatting its own message (`self.fp8_scale.name`).
        (lambda: MoESpec(**BASE, fp8_scale="per_tensor"), "MoESpec.fp8_scale", "'per_tensor' (str)"),
        (lambda: MoESpec(**BASE, fp8_scale=1), "MoESpec.fp8_scale", "1 (int)"),
        (lambda: MoESpec(**BASE, act_dtype="bf16"), "act_dtype", "'bf16'"),
    ],
)
def test_field_of_the_wrong_type_is_a_spec_error_naming_field_and_value(build, field, shown):
    if field is None:
        build()  # the valid neighbour of the cases around it
        return
    with pytest.raises(SpecError) as info:
        build()
    message = str(info.value)
    assert field in message and shown in message and "; " in message  # the fix follows the "; "


def test_the_fix_names_what_to_pass():
    with pytest.raises(SpecError, match=r"pass the int 2$"):
        MoESpec(**{**BASE, "top_k": 2.0})
    with pytest.raises(SpecError, match=r"pass Fp8Scale.PER_TENSOR$"):
        MoESpec(**BASE, fp8_scale="per_tensor")
    with pytest.raises(SpecError, match=r"Python reads 'no' as True"):
        MoESpec(**BASE, has_bias="no")
    with pytest.raises(SpecError, match=r"pass Activation.SILU$"):
        ActivationSpec("SILU")
    with pytest.raises(SpecError, match=r"pass the number -12, not a string$"):
        MoESpec(**{**BASE, "top_k": " -12"})
    # Unicode digits that int() does not read (superscripts) get the plain fix, not a crash in the message.
    for text in ("²", "+", "1e3", ""):
        with pytest.raises(SpecError, match=r"pass a Python int$"):
            MoESpec(**{**BASE, "top_k": text})
    # An int too long for str() still gets a message, not str()'s own ValueError.
    with pytest.raises(SpecError, match="cannot be shown"):
        ActivationSpec(Activation.SWIGLU_OAI, alpha=10**5000, limit=7.0)


# Values of every kind a careless caller passes: wrong types, out of range, whole floats, strings.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.integers(2**62, 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["no", "false", "bf16", "mxfp4", "per_tensor", "silu", "4"]),
    st.sampled_from(list(WeightFormat) + list(Fp8Scale) + list(Activation) + list(RoutingMethod)),
    st.sampled_from([torch.bfloat16, torch.int8, [1], (1, 2), {}, object(), b"x", torch.tensor(2)]),
    st.sampled_from([ActivationSpec(Activation.SILU), RoutingSpec(RoutingMethod.SOFTMAX_TOPK)]),
)
SPEC_FIELDS = [f.name for f in dataclasses.fields(MoESpec)]
ROUTING_FIELDS = [f.name for f in dataclasses.fields(RoutingSpec)]
ACTIVATION_FIELDS = [f.name for f in dataclasses.fields(ActivationSpec)]


def _valid_or_moekit_error(build) -> None:
    try:
        build()
    except MoekitError:
        pass  # anything else (TypeError, AttributeError, ValueError, ...) fails the test


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(SPEC_FIELDS), value=ANY_VALUE)
def test_any_value_for_any_moespec_field_is_a_spec_or_a_moekit_error(field, value):
    _valid_or_moekit_error(lambda: MoESpec(**{**BASE, field: value}))


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(ROUTING_FIELDS), value=ANY_VALUE, grouped=st.booleans())
def test_any_value_for_any_routing_field_is_a_spec_or_a_moekit_error(field, value, grouped):
    _valid_or_moekit_error(lambda: RoutingSpec(**{**(GROUPED if grouped else {}), field: value}))


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(ACTIVATION_FIELDS), value=ANY_VALUE, swiglu=st.booleans())
def test_any_value_for_any_activation_field_is_a_spec_or_a_moekit_error(field, value, swiglu):
    kind = Activation.SWIGLU_OAI if swiglu else Activation.SILU
    base = dict(kind=kind, alpha=1.702 if swiglu else None)
    _valid_or_moekit_error(lambda: ActivationSpec(**{**base, field: value}))


@settings(max_examples=200, deadline=None)
@given(num_tokens=ANY_VALUE, device=st.one_of(ANY_VALUE, st.sampled_from(["cpu", "tpu", "cuda:x", "meta"])))
def test_any_plan_arguments_are_a_plan_or_a_moekit_error(num_tokens, device):
    if device == "cuda" and torch.cuda.is_available():
        return
    _valid_or_moekit_error(lambda: plan(SPEC, num_tokens=num_tokens, device=device))


@pytest.mark.parametrize("num_tokens", [-1, 1.5, 4.0, "4", True, None])
def test_plan_refuses_a_token_count_that_is_not_a_count(num_tokens):
    with pytest.raises(ShapeError, match=r"plan\(num_tokens=\.\.\.\) must be an int >= 0, got "):
        plan(SPEC, num_tokens=num_tokens, device="cpu")


@pytest.mark.parametrize(
    "device, fragment",
    [
        ("tpu", "'tpu' is not a device string"),
        ("cuda:banana", "'cuda:banana' is not a device string"),
        (0, "a bare index is ambiguous, pass 'cuda:0'"),
        (True, "got True (bool)"),
        ("meta", "runs on cpu or cuda devices"),
        (None, "must be a torch.device or a string"),
    ],
)
def test_plan_refuses_an_unknown_device(device, fragment):
    with pytest.raises(DeviceError) as info:
        plan(SPEC, num_tokens=1, device=device)
    assert fragment in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_cuda_is_a_device_error_with_the_way_out(device):
    with pytest.raises(DeviceError, match="no CUDA device on this machine.*use device='cpu'"):
        plan(SPEC, num_tokens=1, device=device)


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(spec="gpt-oss-20b"), SpecError, "plan(spec=...) must be a MoESpec"),
        (dict(strict="no"), ArgumentError, "plan(strict=...) must be True or False"),
        (dict(allow_reference="false"), ArgumentError, "plan(allow_reference=...)"),
        (dict(tuned=4.0), TunedTableError, "plan(tuned=...) must be None or a TunedTables or str or Path"),
        (dict(registry=["reference"]), ArgumentError, "plan(registry=...) must be None or a KernelRegistry"),
    ],
)
def test_plan_refuses_arguments_of_the_wrong_type(kwargs, error, fragment):
    with pytest.raises(error) as info:
        plan(**{"spec": SPEC, "num_tokens": 1, "device": "cpu", **kwargs})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (dict(kind="cuda"), "DeviceInfo.kind must be a DeviceKind, got 'cuda' (str); pass DeviceKind.CUDA"),
        (dict(name=""), "DeviceInfo.name must be a non-empty str"),
        (dict(name=None), "DeviceInfo.name must be a non-empty str"),
        (dict(compute_capability=9.0), "(major, minor) tuple"),
        (dict(compute_capability=(9, "0")), "compute_capability[i] must be an int >= 0"),
    ],
)
def test_device_info_refuses_bad_fields(fields, fragment):
    with pytest.raises(DeviceError) as info:
        DeviceInfo(**{"kind": DeviceKind.CUDA, "name": "NVIDIA H200", "compute_capability": (9, 0), **fields})
    assert fragment in str(info.value)


def test_preset_and_cap_experts_refuse_bad_arguments():
    with pytest.raises(SpecError, match=r"preset\(name\) must be a str, got 0 \(int\); pass one of"):
        preset(0)
    with pytest.raises(SpecError, match="act_dtype must be one of"):
        preset("gpt-oss-20b", act_dtype="bf16")
    with pytest.raises(SpecError, match=r"cap_experts\(max_experts\) must be None or a positive int"):
        cap_experts(preset("gpt-oss-20b"), 0)
    with pytest.raises(SpecError, match="pass the int 8"):
        cap_experts(preset("gpt-oss-20b"), 8.0)
