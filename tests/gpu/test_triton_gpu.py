"""The Triton fused-MoE path on a CUDA GPU at real model shapes, against the reference.

Data flow per case: a spec (preset or ragged shape) -> random weights drawn on the GPU in the spec's
format (codes and scales, never zeros) -> router logits -> `route` -> `triton_fused_moe` into a
NaN-poisoned `out` with the default config for T -> relative L2 error against `fused_moe_reference`.
Also: determinism, expert maps, K = 1 with router weights on the input, and CUDA-graph capture/replay.

Run in its own pytest process (the interpreter tests set TRITON_INTERPRET=1 for theirs).
"""

import math
from dataclasses import replace

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()

from moekit import (  # noqa: E402
    Activation,
    ActivationQuant,
    ActivationSpec,
    ExpertWeights,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    RoutingResult,
    RoutingSpec,
    SpecError,
    WeightFormat,
    fused_moe_reference,
    preset,
    route,
)
from moekit.app.bench import capture_graph  # noqa: E402
from moekit.formats import fp8_weight_scale_shape, mxfp4_groups, quantize_fp8_activation  # noqa: E402
from moekit.kernels.triton.config import TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.quantize import quantize_rows  # noqa: E402
from moekit.kernels.triton.tuning import default_config  # noqa: E402
from moekit.kernels.triton.tuning_space import tuning_space  # noqa: E402
from moekit.reference import relative_l2_error  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
TOKENS = [0, 1, 2, 4, 8, 16, 64, 256, 1024, 4096]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}

SPECS = {
    # name: (spec, why)
    "gpt-oss-20b": (preset("gpt-oss-20b"), "MXFP4, SWIGLU_OAI alpha/limit, INTERLEAVED, biases, H=I=2880"),
    "qwen3-30b-a3b": (preset("qwen3-30b-a3b"), "bf16, E=128, K=8, SILU, CONCAT"),
    "deepseek-v3-e16": (
        replace(preset("deepseek-v3"), num_experts=16),
        "FP8 128x128 blocks + per-1x128 W8A8, H=7168, E reduced to 16",
    ),
    "ragged-bf16": (
        MoESpec(
            num_experts=8,
            top_k=2,
            hidden_size=2880,
            intermediate_size=704,
            has_bias=True,
            activation=ActivationSpec(Activation.GELU, limit=5.0),
        ),
        "I=704 (not a multiple of 128), GELU with a clamp",
    ),
    "ragged-mxfp4": (
        MoESpec(
            num_experts=8,
            top_k=4,
            hidden_size=200,
            intermediate_size=704,
            weight_format=WeightFormat.MXFP4,
            activation=ActivationSpec.gpt_oss(),
            gate_layout=GateLayout.INTERLEAVED,
            has_bias=True,
        ),
        "H=200: ragged MXFP4 tail (200 % 32 = 8) in GEMM1",
    ),
    "gpt-oss-20b-w4a8": (
        replace(preset("gpt-oss-20b"), act_quant=ActivationQuant.FP8_PER_GROUP_128),
        "W4A8: MXFP4 codes as FP8 on the FP8 tensor cores, per-1x128 activation scales",
    ),
    "ragged-fp8-token": (
        MoESpec(
            num_experts=8,
            top_k=2,
            hidden_size=704,
            intermediate_size=200,
            weight_format=WeightFormat.FP8_E4M3,
            fp8_scale=Fp8Scale.PER_CHANNEL,
            act_quant=ActivationQuant.FP8_PER_TOKEN,
            activation=ActivationSpec(Activation.SILU),
        ),
        "I=200, per-channel FP8 weights with per-token activations",
    ),
}
SPECS["ragged-w4a8"] = (  # the ragged MXFP4 layer with FP8 activations
    replace(SPECS["ragged-mxfp4"][0], act_quant=ActivationQuant.FP8_PER_TOKEN),
    "W4A8 with per-token activation scales and a ragged MXFP4 tail (H = 200)",
)


def _gpu_weights(spec: MoESpec, *, seed: int, std: float = 0.02) -> ExpertWeights:
    """Random weights drawn on the GPU directly in the spec's format (a CPU draw of 1 GB is slow)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    e, h, i = spec.E_local, spec.H, spec.I
    bias = {}
    if spec.has_bias:
        bias = dict(
            b13=(0.05 * torch.randn(e, 2 * i, generator=gen, device=DEVICE)).to(spec.act_dtype),
            b2=(0.05 * torch.randn(e, h, generator=gen, device=DEVICE)).to(spec.act_dtype),
        )
    common = dict(format=spec.weight_format, gate_layout=spec.gate_layout, **bias)

    def mxfp4(n, k):
        groups = mxfp4_groups(k)
        blocks = torch.randint(0, 256, (e, n, groups, 16), generator=gen, device=DEVICE, dtype=torch.uint8)
        if k % 32:  # the padded tail of the last group holds zero codes, as a quantizer writes it
            blocks[:, :, -1, (k % 32) // 2 :] = 0
        center = 127 + round(math.log2(std / 2.73))  # 2.73 = RMS of the E2M1 values
        scales = torch.randint(center - 1, center + 2, (e, n, groups), generator=gen, device=DEVICE)
        return blocks, scales.to(torch.uint8)

    def fp8(n, k):
        data = 64 * torch.randn(e, n, k, generator=gen, device=DEVICE)
        data = data.clamp(-448, 448).to(torch.float8_e4m3fn)
        shape = fp8_weight_scale_shape(lead=(e,), n=n, k=k, granularity=spec.fp8_scale)
        return data, (std / 64) * (0.75 + 0.5 * torch.rand(shape, generator=gen, device=DEVICE))

    if spec.weight_format is WeightFormat.MXFP4:
        (w13, s13), (w2, s2) = mxfp4(2 * i, h), mxfp4(h, i)
        return ExpertWeights(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, hidden_size=h, **common)
    if spec.weight_format is WeightFormat.FP8_E4M3:
        (w13, s13), (w2, s2) = fp8(2 * i, h), fp8(h, i)
        return ExpertWeights(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, fp8_scale=spec.fp8_scale, **common)
    dtype = spec.weight_format.float_dtype
    w13 = (std * torch.randn(e, 2 * i, h, generator=gen, device=DEVICE)).to(dtype)
    w2 = (std * torch.randn(e, h, i, generator=gen, device=DEVICE)).to(dtype)
    return ExpertWeights(w13=w13, w2=w2, **common)


_WEIGHTS: dict[str, ExpertWeights] = {}


def _weights(name: str) -> ExpertWeights:
    if name not in _WEIGHTS:
        _WEIGHTS.clear()  # one model's weights on the GPU at a time
        _WEIGHTS[name] = _gpu_weights(SPECS[name][0], seed=len(name))
    return _WEIGHTS[name]


def scrambled_expert_map(num_experts: int, owned: int, *, seed: int) -> torch.Tensor:
    """int32 [E]: `owned` random experts mapped to local ids in scrambled order, the rest -1."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    chosen = torch.randperm(num_experts, generator=gen, device=DEVICE)[:owned]
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=DEVICE)
    expert_map[chosen] = torch.randperm(owned, generator=gen, device=DEVICE).to(torch.int32)
    return expert_map


def _inputs(spec: MoESpec, t: int, *, seed: int) -> tuple[torch.Tensor, RoutingResult]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(t, spec.H, generator=gen, device=DEVICE).to(spec.act_dtype)
    logits = torch.randn(t, spec.E, generator=gen, device=DEVICE)
    bias = None
    if spec.routing.has_correction_bias:
        bias = 0.1 * torch.randn(spec.E, generator=gen, device=DEVICE)
    return x, route(logits, top_k=spec.K, spec=spec.routing, correction_bias=bias)


def skewed_inputs(
    spec: MoESpec, t: int, hot_experts: list[int], *, seed: int
) -> tuple[torch.Tensor, RoutingResult]:
    """Every token routed to the same K experts `hot_experts`, each in its own order, with random router
    weights: the other experts get no pair, the hot ones t pairs each (full blocks and a ragged last)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(t, spec.H, generator=gen, device=DEVICE).to(spec.act_dtype)
    hot = torch.tensor(hot_experts, device=DEVICE)
    order = torch.rand(t, spec.K, generator=gen, device=DEVICE).argsort(dim=1)
    weights = torch.rand(t, spec.K, generator=gen, device=DEVICE)
    return x, RoutingResult(weights=weights, ids=hot[order].to(torch.int32))


def graph_replays(spec: MoESpec, weights, config, first, inputs, seeds):
    """(seed, output, x, routing) for each of `seeds`: `triton_fused_moe` captured once in a CUDA graph on
    static copies of `first` (x, routing), compiled outside the capture, then replayed on `inputs(seed)`
    copied into those buffers, the output poisoned with NaN before each replay. The layer must neither sync
    (capture would fail) nor keep anything from the captured data."""
    x, routing = first
    static_x, static_w, static_ids = x.clone(), routing.weights.clone(), routing.ids.clone()
    static_out = torch.empty(x.shape[0], spec.H, dtype=spec.act_dtype, device=DEVICE)

    def layer():
        static_routing = RoutingResult(weights=static_w, ids=static_ids)
        triton_fused_moe(static_x, weights, static_routing, spec=spec, config=config, out=static_out)

    graph, _ = capture_graph(layer, DEVICE)
    for seed in seeds:
        x, routing = inputs(seed)
        static_x.copy_(x)
        static_w.copy_(routing.weights)
        static_ids.copy_(routing.ids)
        static_out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        yield seed, static_out, x, routing


def peak_bytes(call):
    """(`call()`'s result, the device memory it allocated at its peak beyond what was held before it), of
    its second run: the first compiles (and a layer packs its weights)."""
    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base


def _run(spec, weights, x, routing, *, expert_map=None, config=None):
    out = torch.full((x.shape[0], spec.H), math.nan, dtype=spec.act_dtype, device=DEVICE)
    config = config or default_config(spec, x.shape[0])
    got = triton_fused_moe(x, weights, routing, spec=spec, config=config, expert_map=expert_map, out=out)
    assert got is out
    return got


def _assert_close(got, expected, spec, what):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.isfinite(got).all(), f"non-finite output: {what}"
    err = relative_l2_error(got, expected)
    assert err <= TOLERANCE[spec.act_dtype], f"rel L2 {err:.2e} > {TOLERANCE[spec.act_dtype]:g}: {what}"


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, t):
    spec = SPECS[name][0]
    weights = _weights(name)
    x, routing = _inputs(spec, t, seed=t)
    got = _run(spec, weights, x, routing)
    if t == 0:
        assert got.shape == (0, spec.H)
        return
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"{name} T={t}")


@pytest.mark.parametrize("t", [1, 4, 33])
@pytest.mark.parametrize("name", list(SPECS))
def test_split_k_matches_reference(name, t):
    """split_k = 3 on every spec (each format's K loop in three shares, the last ragged or empty)."""
    spec = SPECS[name][0]
    config = replace(default_config(spec, t), split_k=3)
    weights = _weights(name)
    x, routing = _inputs(spec, t, seed=300 + t)
    got = _run(spec, weights, x, routing, config=config)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"{name} T={t} split_k=3")


@pytest.mark.parametrize("quant", [ActivationQuant.FP8_PER_TOKEN, ActivationQuant.FP8_PER_GROUP_128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_activation_quantization_is_bit_exact(quant, dtype):
    # The GPU's division, rounding and fp8 conversion against moekit.formats (the reference's quantizer).
    # Both must compute scale = amax / 448 with an IEEE division: torch on CUDA turns `tensor / 448.0`
    # into `tensor * fp32(1/448)`, which differs in the last bit for about half of all amax values.
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    magnitudes = torch.logspace(-6, 4, 300, device=DEVICE)[:, None]
    x = torch.randn(300, 2880 + 72, generator=gen, device=DEVICE) * magnitudes
    x[0] = 0.0
    x = x.to(dtype)
    data, scale = quantize_rows(x, quant=quant)
    ref = quantize_fp8_activation(x, quant=quant)
    bad = scale != ref.scale
    assert not bad.any(), f"{int(bad.sum())} scales differ, first at {bad.nonzero()[0].tolist()}"
    bad = data.view(torch.uint8) != ref.data.view(torch.uint8)
    if bad.any():
        i, j = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(bad.sum())} codes differ; first x[{i}, {j}] = {float(x[i, j])!r}: "
            f"{float(data[i, j].float())} vs {float(ref.data[i, j].float())}"
        )


def test_deterministic():
    spec = SPECS["qwen3-30b-a3b"][0]
    weights = _weights("qwen3-30b-a3b")
    x, routing = _inputs(spec, 256, seed=7)
    first = _run(spec, weights, x, routing)
    assert torch.equal(first, _run(spec, weights, x, routing))


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_expert_map(t):
    # This rank owns 16 of gpt-oss-20b's 32 experts, in scrambled order; the rest contribute zero.
    base = SPECS["gpt-oss-20b"][0]
    spec = replace(base, num_local_experts=16)
    expert_map = scrambled_expert_map(base.E, 16, seed=3)
    weights = _gpu_weights(spec, seed=11)
    x, routing = _inputs(spec, t, seed=t)
    got = _run(spec, weights, x, routing, expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    _assert_close(got, expected, spec, f"expert map T={t}")


@pytest.mark.parametrize("t", [1, 300])
def test_k1_router_weight_on_input(t):
    spec = MoESpec(
        num_experts=16,
        top_k=1,
        hidden_size=2048,
        intermediate_size=704,
        router_weight_placement=RouterWeightPlacement.INPUT,
        routing=RoutingSpec(),
        activation=ActivationSpec(Activation.SILU),
    )
    weights = _gpu_weights(spec, seed=5)
    x, routing = _inputs(spec, t, seed=t)
    _assert_close(
        _run(spec, weights, x, routing),
        fused_moe_reference(x, weights, routing, spec=spec),
        spec,
        f"K=1 INPUT T={t}",
    )


GRAPH_CASES = [(name, t, False) for name in ("gpt-oss-20b", "deepseek-v3-e16") for t in (1, 8, 64, 256)]
GRAPH_CASES += [("gpt-oss-20b", 1024, True), ("deepseek-v3-e16", 1024, True)]  # + the tail-block launches


@pytest.mark.parametrize(("name", "t", "tail"), GRAPH_CASES)
def test_cuda_graph_capture_and_replay(name, t, tail):
    spec = SPECS[name][0]
    weights = _weights(name)
    config = default_config(spec, t)
    if tail:  # the block-list program and both GEMMs' second launch inside the graph
        config = replace(config, tail_block_m=config.block_m // 2)
    first = _inputs(spec, t, seed=100 + t)
    seeds = (200 + t, 300 + t)
    replays = graph_replays(spec, weights, config, first, lambda seed: _inputs(spec, t, seed=seed), seeds)
    for seed, static_out, x, routing in replays:
        expected = fused_moe_reference(x, weights, routing, spec=spec)
        _assert_close(static_out, expected, spec, f"{name} graph replay T={t} seed={seed}")


# Tile shapes and orientations off the default path: swap-AB (weights on the MMA's M side) at decode and
# prefill tiles, and the unswapped orientation, so a tuned row of either kind is known to be correct.
ORIENTATIONS = {
    "swap-decode": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, swap_ab=True),
    "swap-prefill": dict(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, swap_ab=True),
    "plain": dict(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, swap_ab=False),
}


@pytest.mark.parametrize("t", [1, 64, 1024])
@pytest.mark.parametrize("orientation", list(ORIENTATIONS))
@pytest.mark.parametrize("name", list(SPECS))
def test_orientations_match_reference(name, orientation, t):
    spec = SPECS[name][0]
    config = TritonMoEConfig(**ORIENTATIONS[orientation])
    if spec.weight_format is WeightFormat.MXFP4 and spec.act_quant is not ActivationQuant.NONE:
        config = replace(config, block_k=32)  # W4A8: one MX scale group a K-step (reason_unusable)
    from moekit.kernels.triton.config import words_reason

    if spec.weight_format is WeightFormat.MXFP4 and config.num_warps > 4 and words_reason(spec) is None:
        # Specs that may take the MXFP4 word path refuse 8 warps (intermittently wrong results were
        # measured there on an H200), whichever packing the weights end up in: the launch must refuse.
        assert "num_warps=4" in config.reason_unusable(spec)
        with pytest.raises(SpecError, match="num_warps=4"):
            _run(spec, _weights(name), *_inputs(spec, t, seed=100 + t), config=config)
        return
    assert config.reason_unusable(spec) is None
    weights = _weights(name)
    x, routing = _inputs(spec, t, seed=100 + t)
    got = _run(spec, weights, x, routing, config=config)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"{name} T={t} {orientation}")


@pytest.mark.parametrize("tail", [False, True], ids=["one-launch", "tail-launch"])
def test_gemm1_quantizing_h_itself_is_bitwise_the_separate_pass(tail, monkeypatch):
    """DeepSeek-V3's W8A8 (E capped at 16) with the 8-warp prefill tiles whose GEMM1 tile is one whole
    1x128 group of h: GEMM1 then writes GEMM2's FP8 input itself (`launch.fuses_h_quantization`); on the
    GPU too that must equal, bit for bit, h in fp32 quantized by the separate pass."""
    from moekit.kernels.triton import launch

    spec = SPECS["deepseek-v3-e16"][0]
    weights = _weights("deepseek-v3-e16")
    x, routing = _inputs(spec, 1024, seed=7)
    for block_m in (64, 128):
        config = TritonMoEConfig(
            block_m=block_m,
            block_n=128,
            block_k=128,
            group_m=8,
            num_warps=8,
            num_stages=3,
            gemm2_block_n=128,
            tail_block_m=block_m // 2 if tail else None,
        )
        assert launch.fuses_h_quantization(spec, config)
        fused = _run(spec, weights, x, routing, config=config)
        with monkeypatch.context() as patch:
            patch.setattr(launch, "fuses_h_quantization", lambda spec, config: False)
            separate = _run(spec, weights, x, routing, config=config)
        assert torch.equal(fused, separate), f"block_m {block_m}"
        _assert_close(fused, fused_moe_reference(x, weights, routing, spec=spec), spec, f"block_m {block_m}")


W4A8_SPECS = [
    name
    for name, (spec, _) in SPECS.items()
    if spec.act_quant is not ActivationQuant.NONE and spec.weight_format is WeightFormat.MXFP4
]


@pytest.mark.parametrize("t", [1, 64, 1024, 4096])
@pytest.mark.parametrize("name", W4A8_SPECS)
def test_w4a8_tuning_space_matches_reference(name, t):
    """Every W4A8 candidate (block_k 32: a group a step; 128: four groups folded into one FP8 step;
    8-warp tiles) on the GPU's FP8 tensor cores, against the reference."""
    spec = SPECS[name][0]
    weights = _weights(name)
    x, routing = _inputs(spec, t, seed=500 + t)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    for config in tuning_space(spec, t):
        got = _run(spec, weights, x, routing, config=config)
        _assert_close(got, expected, spec, f"{name} T={t} {config.as_dict()}")


WORD_CONFIGS = {
    "default": None,
    "bk128": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),  # 2880 % 128 != 0
    "bm128": dict(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3),
    "bm64-bk128": dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3),
    "regs96": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, max_registers=96),
    # 64 rows of w13 a tile (GEMM2 on 128 / 64 rows), as the tables plan gpt-oss at T >= 512
    "bn32": dict(block_m=128, block_n=32, block_k=64, group_m=8, num_stages=3, gemm2_block_n=128),
    "bm256-bn32": dict(block_m=256, block_n=32, block_k=64, group_m=8, num_stages=3, gemm2_block_n=64),
    "split4": dict(block_m=16, block_n=64, block_k=128, num_stages=3, gemm2_block_n=128, split_k=4),
    # 128-row blocks and each expert's odd last 64 rows as a 64-row block, in a second launch
    "tail64": dict(
        block_m=128, block_n=64, block_k=64, group_m=8, num_stages=4, gemm2_block_n=128, tail_block_m=64
    ),
}


@pytest.mark.parametrize("t", [1, 8, 64, 1024, 4096])
@pytest.mark.parametrize("which", list(WORD_CONFIGS))
def test_mxfp4_mma_words_match_reference(which, t):
    """gpt-oss-20b through prepare_weights: MXFP4_MMA_WORDS, decoded with bf16x2 PTX into wgmma's
    register operand."""
    from moekit.kernels.triton.kernel import TritonFusedKernel
    from moekit.weights import WeightPacking

    spec = SPECS["gpt-oss-20b"][0]
    weights = _weights("gpt-oss-20b")
    prepared = TritonFusedKernel().prepare_weights(weights, spec)
    assert prepared.packing is WeightPacking.MXFP4_MMA_WORDS
    config = TritonMoEConfig(**WORD_CONFIGS[which]) if WORD_CONFIGS[which] else None
    x, routing = _inputs(spec, t, seed=200 + t)
    got = _run(spec, prepared, x, routing, config=config)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    _assert_close(got, expected, spec, f"gpt-oss-20b words T={t} {which}")


@pytest.mark.parametrize(("e", "k"), [(64, 6), (128, 4), (512, 10)], ids=["E64-K6", "E128-K4", "E512-K10"])
@pytest.mark.parametrize("block_m", [16, 128])
@pytest.mark.parametrize("t", [1, 200, 256, 1024, 16384])
def test_align_methods_agree_on_the_gpu(t, block_m, e, k):
    """The align kernels against the torch specification, bit for bit, at E = 64, K = 6, gpt-oss's E =
    128, K = 4 and E = 512, K = 10 (the one-program sort up to its limit, the chunked counting sort
    everywhere: up to 1024 chunks, one-hot and pairwise steps), with an expert map."""
    from moekit.kernels.triton.align import (
        ONE_PROGRAM_MAX_PAIRS,
        AlignMethod,
        align_routing,
        paired_blocks,
        split_tail_blocks,
    )

    gen = torch.Generator(device=DEVICE).manual_seed(t)
    ids = torch.rand(t, e, generator=gen, device=DEVICE).topk(k, dim=1).indices.to(torch.int32)
    expert_map = torch.full((e,), -1, dtype=torch.int32, device=DEVICE)
    expert_map[torch.randperm(e, generator=gen, device=DEVICE)[: e * 3 // 8]] = torch.arange(
        e * 3 // 8, dtype=torch.int32, device=DEVICE
    )
    for emap, local in ((None, e), (expert_map, e * 3 // 8)):
        methods = [
            m for m in AlignMethod if m is not AlignMethod.ONE_PROGRAM or t * k <= ONE_PROGRAM_MAX_PAIRS
        ]
        got = [
            align_routing(ids, num_local_experts=local, block_m=block_m, expert_map=emap, method=m)
            for m in methods
        ]
        for other, method in zip(got[1:], methods[1:], strict=True):
            for name in (
                "sorted_pair_ids",
                "block_expert",
                "num_valid_blocks",
                "expert_offsets",
                "pair_expert",
            ):
                assert torch.equal(getattr(got[0], name), getattr(other, name)), (method, name)
            assert torch.equal(got[0].expert_counts, other.expert_counts), method
        # Tail-block and paired-block lists: the Triton programs against the torch specification, on
        # every alignment.
        spec_lists = (
            *split_tail_blocks(got[0], method=AlignMethod.TORCH),
            paired_blocks(got[0], method=AlignMethod.TORCH),
        )
        for aligned in got:
            for mine, spec in zip(
                (*split_tail_blocks(aligned), paired_blocks(aligned)), spec_lists, strict=True
            ):
                n = int(spec.num_valid_blocks)
                assert int(mine.num_valid_blocks) == n and mine.max_blocks == spec.max_blocks
                assert torch.equal(mine.block_start[:n], spec.block_start[:n])
                assert torch.equal(mine.block_expert[:n], spec.block_expert[:n])
