"""The MXFP4 config heuristic at shapes no tuned row covers: always usable, always in the tuning space
(so a sweep measures it), split-K only where a decode step leaves SMs idle; and `preset_at`, the way
benchmarks name such shapes."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layer_shapes import reshaped_specs
from moekit.errors import SpecError
from moekit.kernels.triton.tuning import default_config
from moekit.kernels.triton.tuning_space import tuning_space
from moekit.presets import preset, preset_at, reshaped

GPT_OSS = preset("gpt-oss-120b")
# Multiples of 64: the word packing's row rule holds for 2 * I and for H (`mxfp4_words.rows_reason`).
SHAPES = reshaped_specs(
    bases=[GPT_OSS],
    experts=[8, 16, 32, 60, 64, 128, 256],
    dims=[768, 1024, 1408, 1536, 2048, 2880, 4096, 7168, 14336],
)


@settings(max_examples=150, deadline=None)
@given(spec=SHAPES, tokens=st.integers(1, 1 << 16))
def test_default_is_usable_and_swept(spec, tokens):
    config = default_config(spec, tokens)
    assert config.reason_unusable(spec) is None
    assert config in tuning_space(spec, tokens)  # the sweep times the heuristic's own choice first
    assert tuning_space(spec, tokens)[0] == config
    if config.split_k > 1:
        # each share keeps at least two 128-wide K-steps of both GEMMs
        assert config.block_m == 16 and min(spec.H, spec.I) // (128 * config.split_k) >= 2


@settings(max_examples=100, deadline=None)
@given(spec=SHAPES, tokens=st.integers(1, 1 << 16))
def test_tiles_grow_with_tokens_per_expert(spec, tokens):
    small, large = default_config(spec, tokens), default_config(spec, tokens * 8)
    assert large.block_m >= small.block_m


def test_split_k_follows_the_program_count_not_the_model():
    # One token, four experts hit: I / 64 = 45 GEMM1 programs an expert, too few for 132 SMs.
    assert default_config(GPT_OSS, 1).split_k > 1
    # Mixtral-sized experts: a single token still has 2 x 4096 / 64 = 128 programs in GEMM2 alone ...
    wide = reshaped(GPT_OSS, "8x2x4096x14336")
    assert default_config(wide, 1).split_k > 1
    # ... while 64 tokens hit every expert and fill the SMs without splitting.
    assert default_config(wide, 64).split_k == 1
    assert default_config(GPT_OSS, 64).split_k == 1


def test_preset_at_names_another_shape():
    spec = preset_at("gpt-oss-120b@256x8x7168x2048")
    assert (spec.E, spec.K, spec.H, spec.I) == (256, 8, 7168, 2048)
    assert spec.weight_format is GPT_OSS.weight_format and spec.activation == GPT_OSS.activation
    assert preset_at("gpt-oss-20b") == preset("gpt-oss-20b")
    assert reshaped(GPT_OSS, "32,4,2880,2880") == preset("gpt-oss-20b")
    # grouped routing keeps its groups only where E still divides into them
    assert preset_at("deepseek-v3@64x6x2048x1408").routing.n_group == 8
    assert preset_at("deepseek-v3@60x6x2048x1408").routing.n_group is None


def test_preset_at_serves_a_preset_as_fp8_dynamic_checkpoints_are_served():
    from moekit.spec import ActivationQuant, Fp8Scale, WeightFormat

    spec = preset_at("qwen3-30b-a3b@64x6x2048x1408+fp8-channel")
    assert (spec.E, spec.K, spec.H, spec.I) == (64, 6, 2048, 1408)
    assert spec.weight_format is WeightFormat.FP8_E4M3 and spec.fp8_scale is Fp8Scale.PER_CHANNEL
    assert spec.act_quant is ActivationQuant.FP8_PER_TOKEN
    assert (
        spec.routing == preset("qwen3-30b-a3b").routing
        and spec.activation == preset("qwen3-30b-a3b").activation
    )
    with pytest.raises(SpecError, match="without expert biases"):
        preset_at("gpt-oss-20b+fp8-channel")
    with pytest.raises(SpecError, match="fp8-channel"):
        preset_at("qwen3-30b-a3b+fp8_channel")  # the list of choices names the suffix


@pytest.mark.parametrize(
    "bad", ["gpt-oss-120b@1x2x3", "gpt-oss-120b@0x2x64x64", "gpt-oss-120b@ax2x64x64", "nope@8x2x64x64"]
)
def test_preset_at_refuses_bad_labels(bad):
    with pytest.raises(SpecError):
        preset_at(bad)


def test_preset_at_refuses_top_k_above_experts():
    with pytest.raises(SpecError, match="top_k"):
        preset_at("gpt-oss-120b@4x8x2880x2880")


def test_split_k_follows_the_device_multiprocessors():
    from moekit.errors import DeviceError
    from moekit.kernels.base import DeviceInfo, DeviceKind, Problem
    from moekit.kernels.registry import default_registry

    kernel = default_registry().get("triton_fused")

    def split_on(sms):
        device = DeviceInfo(DeviceKind.CUDA, "a Hopper part", (9, 0), sms)
        return kernel.default_config(GPT_OSS, Problem(1, device)).split_k

    # One token of gpt-oss-120b: 4 experts x 45 GEMM1 tiles = 180 programs.
    assert split_on(78) == 1  # two programs for each of 78 SMs: no split
    assert split_on(132) == 2
    assert split_on(None) == split_on(132)  # unknown: the count the rule was measured on
    assert split_on(264) == 3
    with pytest.raises(DeviceError, match="multiprocessors"):
        DeviceInfo(DeviceKind.CUDA, "NVIDIA H200", (9, 0), 0)


@pytest.mark.parametrize("tokens", [2, 16, 256, 2048, 16384])
def test_an_expert_parallel_rank_tiles_like_the_whole_layer_at_its_token_count(tokens):
    # A rank holding 64 of 128 experts runs T tokens (gathered from every rank) whose picks spread over
    # all 128 experts: each of its experts sees T * K / E pairs, as in the whole layer at T, so the tiles
    # are the whole layer's; only the experts a decode step reaches halve, which may split K further.
    rank = replace(GPT_OSS, num_local_experts=64)
    whole, local = default_config(GPT_OSS, tokens), default_config(rank, tokens)
    assert replace(local, split_k=1, gemm2_block_n=None) == replace(whole, split_k=1, gemm2_block_n=None)
    assert local.split_k >= whole.split_k


def test_preset_at_takes_an_activation_quantization():
    from moekit.spec import ActivationQuant

    spec = preset_at("gpt-oss-120b@128x8x2048x768+fp8_per_1x128_group")
    assert spec.act_quant is ActivationQuant.FP8_PER_GROUP_128 and spec.E == 128
    with pytest.raises(SpecError, match="unknown activation quantization"):
        preset_at("gpt-oss-120b+fp9")
    with pytest.raises(SpecError, match="W4A8"):  # float weights take no FP8 activations
        preset_at("qwen3-30b-a3b+fp8_per_token")
