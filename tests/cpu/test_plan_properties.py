"""Property: over random specs, shapes, devices and random tuned tables, `plan` never returns a kernel
that does not support the spec on that device."""

import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_kernels import ConcatOnlyKernel, CudaGroupedKernel, SiluGeluOnlyKernel
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
from moekit.app.cli_spec import SIMULATED_DEVICES
from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.planning.plan import plan
from moekit.planning.tuned import load_tables, row_to_json, triton_version

REGISTRY = default_registry().with_kernels(SiluGeluOnlyKernel(), ConcatOnlyKernel(), CudaGroupedKernel())
DEVICES = [DeviceInfo.of("cpu"), *SIMULATED_DEVICES.values()]


@st.composite
def specs(draw):
    fmt = draw(st.sampled_from(list(WeightFormat)))
    scale = draw(st.sampled_from(list(Fp8Scale))) if fmt is WeightFormat.FP8_E4M3 else None
    quant = ActivationQuant.NONE
    if fmt is WeightFormat.FP8_E4M3:
        quant = draw(
            st.sampled_from(
                [ActivationQuant.NONE, ActivationQuant.FP8_PER_TOKEN]
                + ([ActivationQuant.FP8_PER_GROUP_128] if scale is Fp8Scale.BLOCK_128 else [])
            )
        )
    kind = draw(st.sampled_from(list(Activation)))
    alpha = draw(st.floats(0.5, 3.0)) if kind is Activation.SWIGLU_OAI else None
    limit = draw(st.none() | st.floats(0.1, 20.0))
    e = draw(st.integers(1, 256))
    placement = draw(st.sampled_from(list(RouterWeightPlacement)))
    k = 1 if placement is RouterWeightPlacement.INPUT else draw(st.integers(1, min(e, 8)))
    return MoESpec(
        num_experts=e,
        top_k=k,
        hidden_size=draw(st.integers(1, 8192)),
        intermediate_size=draw(st.integers(1, 8192)),
        weight_format=fmt,
        fp8_scale=scale,
        act_quant=quant,
        act_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        activation=ActivationSpec(kind, alpha=alpha, limit=limit),
        gate_layout=draw(st.sampled_from(list(GateLayout))),
        has_bias=draw(st.booleans()),
        router_weight_placement=placement,
        num_local_experts=draw(st.none() | st.integers(1, e)),
    )


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    spec=specs(),
    tokens=st.integers(0, 20000),
    device=st.sampled_from(DEVICES),
    row_kernels=st.lists(st.sampled_from([*REGISTRY.names, "nope"]), max_size=4),
    row_tokens=st.lists(st.integers(1, 20000), min_size=4, max_size=4),
    data=st.data(),
)
def test_plan_never_returns_an_incapable_kernel(
    tmp_path_factory, spec, tokens, device, row_kernels, row_tokens, data
):
    rows = []
    for kernel, row_t in zip(row_kernels, row_tokens, strict=False):
        config = data.draw(st.sampled_from([{}, {"use_grouped_mm": True}, {"block_m": 16}, {"x": 1}]))
        row = row_to_json(
            spec=spec,
            device=device.name,
            triton=triton_version(),
            tokens=row_t,
            kernel=kernel,
            config=REGISTRY.get("reference").default_config(spec, Problem(1, device)),
        )
        row["config"] = config
        rows.append(row)
    path = tmp_path_factory.mktemp("t") / "table.json"
    path.write_text(json.dumps({"schema_version": 1, "rows": rows}))
    tables = load_tables([path], registry=REGISTRY)
    allow_reference = data.draw(st.booleans())
    try:
        result = plan(
            spec,
            num_tokens=tokens,
            device=device,
            tuned=tables,
            registry=REGISTRY,
            allow_reference=allow_reference,
        )
    except UnsupportedSpecError:
        capable = [
            k.name
            for k in REGISTRY
            if k.supports(spec, Problem(tokens, device)) is None
            and (allow_reference or k.name != "reference")
        ]
        assert not capable
        return
    kernel = REGISTRY.get(result.kernel)
    assert kernel.supports(spec, Problem(tokens, device)) is None
    assert kernel.validate_config(result.config, spec) is None
    assert isinstance(result.config, kernel.config_type)
