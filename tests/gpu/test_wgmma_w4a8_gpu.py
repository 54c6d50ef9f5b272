"""The WGMMA_W4A8 engine (MXFP4 weights against per-token FP8 activations on FP8 wgmma) on an sm_90 GPU,
against the reference.

Data flow per case: a W4A8 spec (GPT-OSS's math at reduced shapes, gate/up rows interleaved or concatenated,
with and without biases, another gated activation, H and I not multiples of the 128-column K-step or of
GEMM2's 128-row program) -> random MXFP4 weights drawn on the GPU, packed as the layer prepares them
(MXFP4_W4A8) -> softmax top-k routing, or ids skewed onto few experts -> `triton_fused_moe` with the
engine's configs into a NaN-poisoned `out` -> relative L2 error against `fused_moe_reference` on the packed
weights (the weights the kernels compute with) and on the checkpoint ones. Also: an expert map, CUDA-graph
capture and replay, weights with flushed groups, the planner's choice on this device, the workspace.
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
from test_wgmma_fp8_gpu import _assert_close, _run  # noqa: E402  (NaN-poisoned out, tolerance(spec))

from moekit import Activation, ActivationSpec, GateLayout, fused_moe_reference  # noqa: E402
from moekit.kernels.base import DeviceInfo, DeviceKind, Problem  # noqa: E402
from moekit.kernels.triton import wgmma_w4a8 as wgmma_w4a8_host  # noqa: E402
from moekit.kernels.triton.config import MatmulEngine  # noqa: E402
from moekit.kernels.triton.kernel import TritonFusedKernel  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.tuning import wgmma_w4a8_configs  # noqa: E402
from moekit.kernels.triton.wgmma_w4a8 import wgmma_w4a8_reason  # noqa: E402
from moekit.presets import preset_at  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.spec import ActivationQuant  # noqa: E402
from moekit.weights import WeightPacking  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.get_device_capability() != (9, 0), reason="the WGMMA_W4A8 engine targets sm_90 only"
    ),
]
DEVICE = torch.device("cuda")


def _w4a8(label: str, **changes):
    return replace(preset_at(label), act_quant=ActivationQuant.FP8_PER_TOKEN, **changes)


SPECS = {
    # gpt-oss-120b's math and H = I = 2880 on 16 experts: 23 K-steps (an odd last one), GEMM2's last
    # program 64 rows past H
    "gpt-oss-e16": _w4a8("gpt-oss-120b@16x4x2880x2880"),
    # concatenated gate/up rows with biases, Mixtral's proportions reduced (GEMM2 32 K-steps)
    "concat-e8": _w4a8("gpt-oss-120b@8x2x1024x4096", gate_layout=GateLayout.CONCAT),
    # no biases, plain SiLU, H = 832 (6.5 K-steps: the last half zeros; GEMM2 rows padded to 896)
    "silu-no-bias": _w4a8(
        "gpt-oss-120b@32x4x832x1536", has_bias=False, activation=ActivationSpec(Activation.SILU)
    ),
}
DEFAULT, *OTHERS = wgmma_w4a8_configs()
DEEPEST = max(OTHERS, key=lambda c: c.num_stages)
CONFIGS = {"default": DEFAULT, f"stages{DEEPEST.num_stages}-group8": replace(DEEPEST, group_m=8)}


# (NARROW_BLOCKS, PERSISTENT, decode under the wgmmas at every T): the shipped setting with the decode under
# the wgmmas, every block on a 128-row wgmma, a program a tile, the next pair's decode after the pair's wait
KERNEL_SETS = {
    "narrow-persistent": (True, True, True),
    "full-width": (False, True, True),
    "a-program-a-tile": (True, False, True),
    "decode-after-wait": (True, True, False),
}


@pytest.fixture(params=list(KERNEL_SETS))
def narrow(request, monkeypatch):
    """The kernel's paths: blocks at most a quarter or half full on a narrower wgmma or every block on 128;
    one program an SM walking its tiles, or a program a tile; the next pair's decode under the pair's
    wgmmas or after their wait."""
    narrow_blocks, persistent, decode_under_mma = KERNEL_SETS[request.param]
    monkeypatch.setattr(wgmma_w4a8_host, "NARROW_BLOCKS", narrow_blocks)
    monkeypatch.setattr(wgmma_w4a8_host, "PERSISTENT", persistent)
    # the decode order is chosen by tokens an expert: a threshold of 0 puts it under the wgmmas at every T
    under_from = 0 if decode_under_mma else math.inf
    monkeypatch.setattr(wgmma_w4a8_host, "DECODE_UNDER_MMA_FROM_TOKENS_PER_EXPERT", under_from)
    return request.param


def _packed(spec, *, seed: int, raw=None):
    """Random MXFP4 weights of `spec` (or `raw`) and their MXFP4_W4A8 packing, as the layer prepares them."""
    raw = _gpu_weights(spec, seed=seed) if raw is None else raw
    weights = TritonFusedKernel().prepare_weights(raw, spec)
    assert weights.packing is WeightPacking.MXFP4_W4A8
    return raw, weights


@pytest.mark.parametrize("t", [1, 7, 130, 1000, 3000])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, config, t, narrow):
    spec = SPECS[name]
    assert wgmma_w4a8_reason(spec) is None
    raw, weights = _packed(spec, seed=len(name))
    x, routing = _inputs(spec, t, seed=t)
    got = _run(spec, weights, x, routing, CONFIGS[config])
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, f"{name} {config} T={t}")
    # Nothing flushed at these scales: the packed weights are the checkpoint's.
    _assert_close(got, fused_moe_reference(x, raw, routing, spec=spec), spec, f"{name} checkpoint T={t}")


def test_packing_round_trips_the_checkpoint():
    spec = SPECS["concat-e8"]
    raw, weights = _packed(spec, seed=4)
    back = weights.unpacked()
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(raw, name)), name


@pytest.mark.parametrize("t", [200, 2600])
def test_skewed_routing_with_empty_experts(t, narrow):
    spec = SPECS["gpt-oss-e16"]
    _, weights = _packed(spec, seed=3)
    x, routing = skewed_inputs(spec, t, [0, 5, 9, 15], seed=t)
    got = _run(spec, weights, x, routing, DEFAULT)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, f"skewed T={t}")


@pytest.mark.parametrize("t", [9, 1500])
def test_expert_map(t):
    base = SPECS["gpt-oss-e16"]
    spec = replace(base, num_local_experts=8)
    expert_map = scrambled_expert_map(base.E, 8, seed=5)
    _, weights = _packed(spec, seed=9)
    x, routing = _inputs(base, t, seed=t)
    got = _run(spec, weights, x, routing, DEFAULT, expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t}")


def test_cuda_graph_capture_and_replay():
    spec = SPECS["concat-e8"]
    _, weights = _packed(spec, seed=2)

    def inputs(seed):
        return _inputs(spec, 777, seed=seed)

    for seed, static_out, x, routing in graph_replays(spec, weights, DEFAULT, inputs(1), inputs, (11, 12)):
        _assert_close(static_out, fused_moe_reference(x, weights, routing, spec=spec), spec, f"seed {seed}")


def test_flushed_groups_are_announced_and_computed_as_packed():
    # A scale byte 12 binades below its row's largest over two K-steps cannot decode exactly: the packing
    # zeroes that group, warns, and the layer matches the reference of the packed weights.
    spec = SPECS["gpt-oss-e16"]
    raw = _gpu_weights(spec, seed=8)
    raw.w13_scale[2, 40, :8] = torch.tensor([125, 120, 120, 113, 120, 120, 120, 120], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="flushes 1 of"):
        _, weights = _packed(spec, seed=8, raw=raw)
    assert not weights.unpacked().w13[2, 40, 3].any()  # the flushed group's codes
    x, routing = _inputs(spec, 600, seed=8)
    got = _run(spec, weights, x, routing, DEFAULT)
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, "flushed")


def test_tl_dot_configs_refuse_the_packed_weights_and_the_engine_runs_checkpoint_weights():
    spec = SPECS["gpt-oss-e16"]
    raw, weights = _packed(spec, seed=6)
    x, routing = _inputs(spec, 300, seed=6)
    tl_dot = replace(DEFAULT, engine=MatmulEngine.TL_DOT, block_k=32)
    with pytest.raises(Exception, match="WGMMA_W4A8 engine only"):
        _run(spec, weights, x, routing, tl_dot)
    got = _run(spec, raw, x, routing, DEFAULT)  # not packed: the tl.dot W4A8 tiles
    _assert_close(got, fused_moe_reference(x, raw, routing, spec=spec), spec, "checkpoint packing")


def test_planner_takes_the_engine_here():
    props = torch.cuda.get_device_properties(DEVICE)
    info = DeviceInfo(DeviceKind.CUDA, props.name, (props.major, props.minor), props.multi_processor_count)
    kernel = TritonFusedKernel()
    spec = _w4a8("gpt-oss-120b")
    assert kernel.extra_check(spec, Problem(num_tokens=16, device=info)) is None
    for t in (1, 4096):
        assert (
            kernel.default_config(spec, Problem(num_tokens=t, device=info)).engine is MatmulEngine.WGMMA_W4A8
        )
    groups = replace(spec, act_quant=ActivationQuant.FP8_PER_GROUP_128)
    assert "FP8_PER_TOKEN" in kernel.extra_check(groups, Problem(num_tokens=16, device=info))


def test_workspace_prediction_holds():
    spec = SPECS["gpt-oss-e16"]
    _, weights = _packed(spec, seed=6)
    t = 3000
    x, routing = _inputs(spec, t, seed=6)
    out = torch.empty(t, spec.H, dtype=spec.act_dtype, device=DEVICE)
    _, peak = peak_bytes(lambda: triton_fused_moe(x, weights, routing, spec=spec, config=DEFAULT, out=out))
    predicted = TritonFusedKernel().workspace_bytes(spec, t, DEFAULT)
    assert 0.5 * predicted <= peak <= 1.1 * predicted, (peak, predicted)
    assert relative_l2_error(out, fused_moe_reference(x, weights, routing, spec=spec)) <= tolerance(spec)
