"""FP8 and float config regimes at shapes no tuned row covers: the default follows tokens per expert (and
FP8's scale layout), never a preset's name, is usable and is in the tuning space that sweeps refine it
from."""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from layer_shapes import reshaped_specs
from moekit.kernels.triton.tuning import FP8_LONG_K_MIN_I, default_config
from moekit.kernels.triton.tuning_space import tuning_space
from moekit.presets import preset, reshaped
from moekit.spec import ActivationQuant, Fp8Scale

DEEPSEEK = preset("deepseek-v3")
PER_CHANNEL = replace(DEEPSEEK, fp8_scale=Fp8Scale.PER_CHANNEL, act_quant=ActivationQuant.FP8_PER_TOKEN)
W8A16_PER_CHANNEL = replace(PER_CHANNEL, act_quant=ActivationQuant.NONE)  # bf16 dots: no W8A8 tile rule
FP8_SHAPES = reshaped_specs(
    bases=[DEEPSEEK, PER_CHANNEL, W8A16_PER_CHANNEL],
    experts=[8, 16, 64, 128, 256],
    dims=[768, 1024, 1536, 2048, 4096, 7168],
)


@settings(max_examples=100, deadline=None)
@given(spec=FP8_SHAPES, tokens=st.integers(1, 1 << 15))
def test_fp8_prefill_default_follows_tokens_per_expert_and_scale_layout(spec, tokens):
    config = default_config(spec, tokens)
    assert config.reason_unusable(spec) is None
    assert config in tuning_space(spec, tokens)
    per_expert = tokens * spec.K / spec.E
    prefill = per_expert > 32
    w8a8 = spec.act_quant is not ActivationQuant.NONE
    if prefill and spec.scales_per_128_of_k:  # promoted every K-step: 128 x 64 on 8 warps, tail blocks
        assert (config.block_m, config.block_n, config.num_warps, config.tail_block_m) == (128, 64, 8, 64)
    elif prefill and w8a8 and spec.I >= FP8_LONG_K_MIN_I:  # per-channel, GEMM2's K-loop long: 8 warps
        assert (config.block_m, config.block_n, config.block_k, config.num_warps) == (128, 64, 128, 8)
        assert config.num_stages == 4 and config.tail_block_m is None
    elif 8 < per_expert <= 16 and (spec.scales_per_128_of_k or w8a8):  # one 64-row block an expert
        assert (config.block_m, config.block_k, config.num_warps, config.num_stages) == (64, 128, 8, 4)
    else:
        assert config.num_warps == 4 and config.tail_block_m is None
        assert config.block_m == 64 if prefill else config.block_m <= 64


FLOAT_SHAPES = reshaped_specs(
    bases=[preset("qwen3-30b-a3b"), preset("mixtral-8x7b")],
    experts=[8, 16, 64, 128, 256, 512],
    dims=[384, 512, 768, 1280, 2048, 2880, 4096, 7168, 14336],
)


@settings(max_examples=100, deadline=None)
@given(spec=FLOAT_SHAPES, tokens=st.integers(1, 1 << 15))
def test_float_default_follows_tokens_per_expert(spec, tokens):
    """Decode puts the weight rows on the MMA's M side; up to 48 tokens an expert one 64-row M-block an
    expert (128 rows would be mostly padding); beyond, 128 x 128 on 8 warps with GEMM2 on 256 rows."""
    config = default_config(spec, tokens)
    assert config.reason_unusable(spec) is None
    assert config in tuning_space(spec, tokens)
    per_expert = tokens * spec.K / spec.E
    if per_expert <= 8:
        assert config.swap_ab and config.block_m == 16
    elif per_expert <= 48:
        assert (config.block_m, config.num_warps, config.block_n_gemm2) == (64, 4, 128)
    else:
        assert (config.block_m, config.block_n, config.num_warps, config.block_n_gemm2) == (128, 128, 8, 256)


def test_only_float_8_warp_tiles_try_gemm2_on_256_rows():
    bf16 = preset("mixtral-8x7b")
    for spec in (bf16, reshaped(bf16, "64x6x2048x1408")):
        space = tuning_space(spec, 256)
        assert any(c.num_warps == 8 and c.block_n_gemm2 == 256 for c in space)
        assert all(c.num_warps == 8 for c in space if c.block_n_gemm2 == 256)
    for t in (256, 4096, 16384):
        assert all(c.block_n_gemm2 <= 128 for c in tuning_space(DEEPSEEK, t))


def test_w8a8_dots_are_promoted_at_least_every_128_of_k():
    """Per-channel W8A8 has no scale group along K, but its K-steps are still promoted into fp32 (the
    wgmma's FP8 sums are reduced-precision): a 256-wide K-step is refused, as for block scales and W4A8."""
    for tokens in (1, 4096):
        config = default_config(PER_CHANNEL, tokens)
        assert config.block_k <= 128
        assert "at most 128" in replace(config, block_k=256).reason_unusable(PER_CHANNEL)
        assert all(c.block_k <= 128 for c in tuning_space(PER_CHANNEL, tokens))
