"""The WGMMA_BF16 engine (tl.dot GEMM1 writing h in sorted rows, persistent Gluon GEMM2) on an sm_90 GPU,
against the reference and against the tl.dot engine.

Data flow per case: a 16-bit float spec (Qwen3's math at reduced and held-out shapes, gpt-oss's with
biases and interleaved SwiGLU in bf16, a top-1 spec with the router weight on the input, fp16) -> random
weights on the GPU -> routing (softmax top-k, or every token on the same few experts) ->
`triton_fused_moe` with the engine's config into a NaN-poisoned `out` -> relative L2 error against
`fused_moe_reference`, and the tl.dot engine's output at the same GEMM1 tiles. Also: an expert map,
CUDA-graph capture and replay.
"""

import math
from dataclasses import replace

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from test_triton_gpu import _gpu_weights, _inputs, graph_replays, scrambled_expert_map, skewed_inputs  # noqa: E402

from moekit import MoESpec, RouterWeightPlacement, fused_moe_reference, preset  # noqa: E402
from moekit.kernels.triton.config import MatmulEngine, TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.wgmma_bf16 import wgmma_bf16_reason  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.spec import WeightFormat  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.get_device_capability() != (9, 0), reason="the WGMMA_BF16 engine targets sm_90 only"
    ),
]
DEVICE = torch.device("cuda")

QWEN3 = preset("qwen3-30b-a3b")
GPT_OSS_BF16 = replace(preset("gpt-oss-20b"), weight_format=WeightFormat.BF16)
SPECS = {
    "qwen3-e16": replace(QWEN3, num_experts=16),
    # Held out: H not a multiple of 256 (a partial last GEMM2 tile), I not a multiple of 64 (a partial
    # last K-step, zero-filled by TMA).
    "odd-dims": replace(QWEN3, num_experts=24, top_k=6, hidden_size=1440, intermediate_size=712),
    # The same with H a multiple of 64, so that the Gluon GEMM1 runs: a partial last tile of h (I = 712).
    "odd-i": replace(QWEN3, num_experts=24, top_k=6, hidden_size=1536, intermediate_size=712),
    # gpt-oss's math in bf16: interleaved gate/up, SwiGLU with its limit, both biases.
    "gpt-oss-bf16": replace(GPT_OSS_BF16, num_experts=16, hidden_size=1024, intermediate_size=1024),
    # The same with I not a multiple of the Gluon GEMM1's 128 columns: its last gate and up boxes reach
    # into the next expert's rows, which no stored column may use.
    "gpt-oss-odd-i": replace(GPT_OSS_BF16, num_experts=24, hidden_size=1536, intermediate_size=712),
    # Top-1 with the router weight on GEMM1's input: GEMM2 applies no weight and writes out directly.
    "top1-input": replace(
        QWEN3, num_experts=16, top_k=1, router_weight_placement=RouterWeightPlacement.INPUT
    ),
    "qwen3-fp16": replace(QWEN3, num_experts=16, weight_format=WeightFormat.FP16, act_dtype=torch.float16),
}
_PREFILL = dict(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, engine=MatmulEngine.WGMMA_BF16)
CONFIGS = {
    # Alignment at 128 rows, GEMM2 tiles 256 and 128 wide.
    "m128-n256": TritonMoEConfig(block_m=128, gemm2_block_n=256, **_PREFILL),
    "m128-n128": TritonMoEConfig(block_m=128, **_PREFILL),
    # Alignment at 64 rows: GEMM2 walks `paired_blocks` (an expert's odd last block half a block).
    "m128-tail64": TritonMoEConfig(block_m=128, tail_block_m=64, gemm2_block_n=256, **_PREFILL),
    "m64": TritonMoEConfig(**{**_PREFILL, "block_n": 64, "num_warps": 4}, block_m=64, gemm2_block_n=128),
    # GEMM1 on Gluon too (a cp.async gather producer) where H is a multiple of 64, gate/up rows
    # concatenated or interleaved; "odd-dims" runs the tl.dot GEMM1 of the same config instead.
    "gluon-m128": TritonMoEConfig(block_m=128, gemm2_block_n=256, gemm1_gluon=True, **_PREFILL),
    "gluon-tail64": TritonMoEConfig(
        block_m=128, tail_block_m=64, gemm2_block_n=128, gemm1_gluon=True, **_PREFILL
    ),
}


def _run(spec: MoESpec, weights, x, routing, config, *, expert_map=None) -> torch.Tensor:
    out = torch.full((x.shape[0], spec.H), math.nan, dtype=spec.act_dtype, device=DEVICE)
    got = triton_fused_moe(x, weights, routing, spec=spec, config=config, expert_map=expert_map, out=out)
    assert got is out
    return got


def _assert_close(got, expected, spec, what):
    assert torch.isfinite(got).all(), f"non-finite output: {what}"
    err = relative_l2_error(got, expected)
    assert err <= tolerance(spec), f"rel L2 {err:.2e} > {tolerance(spec):g}: {what}"


def _tl_dot(config: TritonMoEConfig) -> TritonMoEConfig:
    return replace(config, engine=MatmulEngine.TL_DOT, gemm1_gluon=False)


@pytest.mark.parametrize("t", [1, 7, 100, 777, 3000])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference_and_the_tl_dot_engine(name, config, t):
    spec = SPECS[name]
    assert wgmma_bf16_reason(spec) is None
    weights = _gpu_weights(spec, seed=len(name))
    x, routing = _inputs(spec, t, seed=t)
    got = _run(spec, weights, x, routing, CONFIGS[config])
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, f"{name} {config} T={t}")
    # Same h (the same GEMM1), same GEMM2 sums up to the order of fp32 additions inside the MMA.
    dot = _run(spec, weights, x, routing, _tl_dot(CONFIGS[config]))
    assert relative_l2_error(got, dot) <= tolerance(spec) / 4, f"{name} {config} T={t} against tl.dot"


@pytest.mark.parametrize("config", ["m128-n256", "m128-tail64", "gluon-tail64"])
@pytest.mark.parametrize("t", [200, 3000])
def test_skewed_routing_with_empty_experts_and_odd_blocks(t, config):
    # Every token on the same 6 of 24 experts: 18 experts empty, the 6 with long runs of blocks and, at
    # a 64-row alignment, an odd last block run as half of a 128-row block.
    spec = SPECS["odd-i" if CONFIGS[config].gemm1_gluon else "odd-dims"]
    weights = _gpu_weights(spec, seed=3)
    x, routing = skewed_inputs(spec, t, [1, 4, 7, 11, 20, 23], seed=t)
    got = _run(spec, weights, x, routing, CONFIGS[config])
    _assert_close(got, fused_moe_reference(x, weights, routing, spec=spec), spec, f"skewed T={t}")


@pytest.mark.parametrize("config", ["m128-n256", "m128-tail64", "gluon-m128"])
@pytest.mark.parametrize("t", [5, 1500])
def test_expert_map(t, config):
    # This rank owns 8 of 16 experts in scrambled order; pairs routed elsewhere contribute zero.
    base = SPECS["qwen3-e16"]
    spec = replace(base, num_local_experts=8)
    expert_map = scrambled_expert_map(base.E, 8, seed=5)
    weights = _gpu_weights(spec, seed=9)
    x, routing = _inputs(base, t, seed=t)
    got = _run(spec, weights, x, routing, CONFIGS[config], expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t}")


def test_cuda_graph_capture_and_replay():
    spec = SPECS["qwen3-e16"]
    weights = _gpu_weights(spec, seed=2)
    t = 777

    def inputs(seed):
        return _inputs(spec, t, seed=seed)

    for config in ("m128-n256", "m128-tail64", "gluon-tail64"):
        replays = graph_replays(spec, weights, CONFIGS[config], inputs(1), inputs, (11, 12))
        for seed, static_out, x, routing in replays:
            expected = fused_moe_reference(x, weights, routing, spec=spec)
            _assert_close(static_out, expected, spec, f"seed {seed} {config}")


def test_full_qwen3_shape_matches_reference():
    spec = QWEN3
    weights = _gpu_weights(spec, seed=4)
    x, routing = _inputs(spec, 4096, seed=4)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    for name, config in CONFIGS.items():
        _assert_close(_run(spec, weights, x, routing, config), expected, spec, f"qwen3-30b T=4096 {name}")
