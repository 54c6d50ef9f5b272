"""The WGMMA_WORDS engine's rules on the CPU: which specs and configs it takes, when the planner picks it,
its tuned-table form and the refusal off sm_90. Its kernels compiled for sm_90 are checked in
tests/cpu/test_sass_report.py; its numbers against the reference are GPU tests
(tests/gpu/test_wgmma_words_gpu.py)."""

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from layer_shapes import reshaped_specs  # noqa: E402
from moekit import (  # noqa: E402
    Activation,
    ActivationQuant,
    ActivationSpec,
    DeviceError,
    GateLayout,
    LayoutMismatchError,
    RouterWeightPlacement,
    SpecError,
    WeightFormat,
    preset,
)
from moekit.kernels.base import config_from_dict  # noqa: E402
from moekit.kernels.triton.config import (  # noqa: E402
    MXFP4_PREFILL_TILES,
    WGMMA_WORDS_TILES,
    MatmulEngine,
    TritonMoEConfig,
)
from moekit.kernels.triton.kernel import TritonFusedKernel  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.tuning import (  # noqa: E402
    WGMMA_WORDS_MIN_K,
    WGMMA_WORDS_MIN_TOKENS_PER_EXPERT,
    WGMMA_WORDS_WIDE_FROM,
    default_config,
)
from moekit.kernels.triton.tuning_space import tuning_space  # noqa: E402
from moekit.kernels.triton.wgmma_words import (  # noqa: E402
    HALF_WIDE_MIN_SHARE,
    half_full_share,
    runs_half_wide,
    wgmma_words_reason,
)
from moekit.presets import preset_at  # noqa: E402
from moekit.synthetic import random_batch, random_layer  # noqa: E402
from moekit.weights import WeightPacking  # noqa: E402

GPT_OSS = preset("gpt-oss-120b")
MIXTRAL_LIKE = preset_at("gpt-oss-120b@8x2x4096x14336")  # GPT-OSS's math at Mixtral's shape
ENGINE = TritonMoEConfig(
    **WGMMA_WORDS_TILES, block_m=128, group_m=8, num_stages=4, engine=MatmulEngine.WGMMA_WORDS
)


def test_takes_mxfp4_w4a16_word_path_and_refuses_other_math_with_the_reason():
    assert wgmma_words_reason(GPT_OSS) is None and wgmma_words_reason(MIXTRAL_LIKE) is None
    assert ENGINE.reason_unusable(GPT_OSS) is None
    refusals = {
        "W4A16": preset("qwen3-30b-a3b"),
        "bf16 MMA operands": replace(GPT_OSS, act_dtype=torch.float16),
        "router weight": replace(GPT_OSS, top_k=1, router_weight_placement=RouterWeightPlacement.INPUT),
        "H must be a multiple of 64": replace(GPT_OSS, hidden_size=2880 + 16),
        "I must be a multiple of 64": replace(GPT_OSS, intermediate_size=2880 + 32),
        "MXFP4_MMA_WORDS": replace(GPT_OSS, intermediate_size=2880 + 4),
    }
    for words, spec in refusals.items():
        reason = ENGINE.reason_unusable(spec)
        assert reason is not None and words in reason, (words, reason)
    w4a8 = replace(GPT_OSS, act_quant=ActivationQuant.FP8_PER_TOKEN)
    assert "W4A16" in wgmma_words_reason(w4a8)
    assert wgmma_words_reason(replace(GPT_OSS, activation=ActivationSpec(Activation.GELU))) is None
    assert wgmma_words_reason(replace(GPT_OSS, gate_layout=GateLayout.CONCAT)) is None


@pytest.mark.parametrize(
    "change",
    [
        dict(block_m=64),
        dict(block_n=128),
        dict(block_k=128),
        dict(num_warps=4),
        dict(gemm2_block_n=None),
        dict(num_stages=2),
        dict(max_registers=128),
        dict(tail_block_m=64),
        dict(split_k=2),
        dict(swap_ab=True),
    ],
)
def test_refuses_any_other_tiling(change):
    with pytest.raises(SpecError):  # the engine's rule, or a field rule that comes first
        replace(ENGINE, **change)


def test_free_knobs_are_free():
    for change in (dict(block_m=256), dict(num_stages=3), dict(group_m=1)):
        assert replace(ENGINE, **change).engine is MatmulEngine.WGMMA_WORDS


def test_tuned_table_form_round_trips():
    raw = json.loads(json.dumps(replace(ENGINE, block_m=256).as_dict()))
    assert raw["engine"] == "WGMMA_WORDS"
    assert config_from_dict(TritonMoEConfig, raw, kernel="triton_fused") == replace(ENGINE, block_m=256)


@settings(max_examples=80, deadline=None)
@given(
    spec=reshaped_specs([GPT_OSS], experts=[8, 32, 128], dims=[768, 2880, 4096, 7168, 14336]),
    tokens=st.integers(1, 40000),
    hopper=st.booleans(),
)
def test_default_takes_the_engine_only_on_hopper_for_prefill(spec, tokens, hopper):
    config = default_config(spec, tokens, 132, hopper=hopper)
    assert config.reason_unusable(spec) is None
    per_expert = tokens * spec.K / spec.E
    wanted = (
        hopper
        and per_expert >= WGMMA_WORDS_MIN_TOKENS_PER_EXPERT
        and min(spec.H, spec.I) >= WGMMA_WORDS_MIN_K
        and wgmma_words_reason(spec) is None
    )
    assert (config.engine is MatmulEngine.WGMMA_WORDS) == wanted, (spec.describe(), tokens)
    if wanted:
        assert config.block_m == (256 if per_expert >= WGMMA_WORDS_WIDE_FROM else 128)
    space = tuning_space(spec, tokens, 132, hopper=hopper)
    assert space[0] == config and all(c.reason_unusable(spec) is None for c in space)
    engines = {c.engine for c in space}
    if not hopper:
        assert engines == {MatmulEngine.TL_DOT}
    elif per_expert >= 64 and wgmma_words_reason(spec) is None:
        assert MatmulEngine.WGMMA_WORDS in engines  # tuned rows may take it where the default does not


def test_off_sm90_the_launch_refuses_before_any_kernel():
    spec = preset_at("gpt-oss-120b@8x2x256x256")
    layer = random_layer(spec)
    weights = TritonFusedKernel().prepare_weights(layer.weights, spec)
    x, _, routing = random_batch(spec, 3, correction_bias=layer.correction_bias, seed=0)
    with pytest.raises(DeviceError, match="sm_90"):
        triton_fused_moe(x, weights, routing, spec=spec, config=ENGINE)


def test_words_fallback_is_the_mxfp4_prefill_tiling_of_tl_dot():
    # What a WGMMA_WORDS plan runs when the scale bytes kept CHECKPOINT packing: the heuristic's tl.dot
    # prefill tiles, usable for any MXFP4 W4A16 spec.
    assert MXFP4_PREFILL_TILES.engine is MatmulEngine.TL_DOT
    assert default_config(GPT_OSS, 8192, 132, hopper=False) == MXFP4_PREFILL_TILES
    assert MXFP4_PREFILL_TILES.reason_unusable(replace(GPT_OSS, intermediate_size=2880 + 4)) is None
    assert GPT_OSS.weight_format is WeightFormat.MXFP4


def test_plan_on_an_h200_takes_the_engine_where_no_tuned_row_decides():
    from moekit.kernels.base import DeviceInfo, DeviceKind
    from moekit.planning.plan import plan

    h200 = DeviceInfo(DeviceKind.CUDA, "NVIDIA H200", (9, 0), 132)
    prefill = plan(MIXTRAL_LIKE, num_tokens=4096, device=h200)
    assert prefill.kernel == "triton_fused" and prefill.config.engine is MatmulEngine.WGMMA_WORDS
    assert "'engine': 'WGMMA_WORDS'" in prefill.explain() and "kernel default" in prefill.explain()
    # A tuned row outranks the default: gpt-oss-20b's at T = 2048 is a measured tl.dot tile, gpt-oss-120b's
    # at T = 8192 the engine.
    tuned = plan(preset("gpt-oss-20b"), num_tokens=2048, device=h200)
    assert tuned.config.engine is MatmulEngine.TL_DOT and "tuned" in tuned.explain()
    tuned = plan(GPT_OSS, num_tokens=8192, device=h200)
    assert tuned.config.engine is MatmulEngine.WGMMA_WORDS and "tuned" in tuned.explain()


def _simulated_share(num_pairs: int, num_experts: int, block_m: int, trials: int = 200) -> float:
    """The share `half_full_share` predicts, counted over uniformly routed random pairs: M-blocks at
    most half full over all M-blocks."""
    generator = torch.Generator().manual_seed(num_pairs + num_experts)
    counts = torch.stack(
        [torch.bincount(torch.randint(num_experts, (num_pairs,), generator=generator), minlength=num_experts)
         for _ in range(trials)]
    )  # fmt: skip
    last = counts % block_m
    half_full = ((last >= 1) & (last <= block_m // 2)).sum()
    return (half_full / (counts + block_m - 1).div(block_m, rounding_mode="floor").sum()).item()


@pytest.mark.parametrize(
    "pairs, experts, block_m",
    [(8192, 128, 128), (6144, 64, 128), (3072, 64, 128), (16384, 128, 128), (32768, 128, 256), (40, 16, 128),
     (2048, 8, 128)],
)  # fmt: skip
def test_half_full_share_is_the_binomial_expectation(pairs, experts, block_m):
    # 64, 96, 48 and 128 tokens an expert at 128 pairs a block, 256 at 256, a decode-sized batch, and 256
    # at 128 (experts of two or three blocks).
    assert half_full_share(pairs, experts, block_m) == pytest.approx(
        _simulated_share(pairs, experts, block_m), abs=0.03
    )


def test_half_wide_follows_the_tokens_an_expert_not_the_model():
    """The rule reads T * K / E against BLOCK_M: any model at 48, 64 or 128 tokens an expert with 128 pairs
    a block (a third to all of the blocks at most half full) takes the half-wide kernels; at 96 (every last
    block more than half full) or 256 (one block in five) it does not."""
    for spec in (GPT_OSS, MIXTRAL_LIKE, preset_at("gpt-oss-120b@64x6x2048x1408")):
        for per_expert, expected in ((48, True), (64, True), (128, True), (96, False), (256, False)):
            tokens = per_expert * spec.E // spec.K
            assert runs_half_wide(spec, tokens, 128, spec.H) is expected, (spec.describe(), per_expert)
        assert runs_half_wide(spec, 256 * spec.E // spec.K, 256, spec.H)  # 256 at 256 pairs a block
    assert half_full_share(80 * 128, 128, 128) < HALF_WIDE_MIN_SHARE  # 80 an expert: 4 % of last blocks


def test_half_wide_needs_int32_row_offsets():
    """Its kernels compute activation row offsets in int32: T x row stride and T x K x I must stay
    below 2^31, else the one-loop kernels (64-bit row pointers) run."""
    spec = preset_at("gpt-oss-120b@16x4x2880x2880")
    tokens = 16 * 64 // 4  # 64 tokens an expert
    assert runs_half_wide(spec, tokens, 128, spec.H)
    assert not runs_half_wide(spec, tokens, 128, 2**31 // tokens)  # a strided x whose rows lie far apart
    big = preset_at("gpt-oss-120b@16x4x2880x2880")
    big_tokens = 2**31 // (big.K * big.I) + 1  # T x K x I just past 2^31 (h's offsets)
    assert big_tokens * big.H < 2**31 and not runs_half_wide(big, big_tokens, 128, big.H)


@pytest.mark.parametrize("layout", [GateLayout.CONCAT, GateLayout.INTERLEAVED], ids=["concat", "interleaved"])
def test_words_packed_weights_are_refused_for_a_layer_whose_halves_split_a_block(layout) -> None:
    # Word-packed weights handed straight to a spec with I % 16 = 8: the up half of CONCAT rows would start
    # inside a 16-row block. `prepare_weights` keeps such layers in CHECKPOINT packing; `validate` refuses
    # words built for another I (2I = 80 rows still counts whole blocks, so the shapes alone would pass).
    from moekit.synthetic import random_layer

    spec = replace(
        preset("gpt-oss-20b"), num_experts=4, hidden_size=64, intermediate_size=48, gate_layout=layout
    )
    words = TritonFusedKernel().prepare_weights(random_layer(spec, seed=3).weights, spec)
    assert words.packing is WeightPacking.MXFP4_MMA_WORDS
    words.validate(spec)
    with pytest.raises(LayoutMismatchError, match=r"w13 \(each gate/up half of I rows\): rows \(40\)"):
        words.validate(replace(spec, intermediate_size=40))
