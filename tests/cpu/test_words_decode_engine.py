"""The MMA_WORDS_DECODE engine's rules on the CPU: which specs and configs it takes (the shared-memory rule
of its activation shares, GEMM2's split), its tuned-table form, the refusal off sm_90 and the fallback on
checkpoint-packed weights. Its kernel compiled for sm_90 is checked in tests/cpu/test_sass_report.py; its
numbers against the reference are GPU tests (tests/gpu/test_words_decode_gpu.py)."""

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from layer_shapes import reshaped_specs  # noqa: E402
from moekit import ActivationQuant, DeviceError, SpecError, preset  # noqa: E402
from moekit.kernels.base import config_from_dict  # noqa: E402
from moekit.kernels.triton.config import (  # noqa: E402
    MMA_WORDS_DECODE_TILES,
    MXFP4_DECODE_TILES,
    MatmulEngine,
    TritonMoEConfig,
)
from moekit.kernels.triton.kernel import TritonFusedKernel  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.words_decode import (  # noqa: E402
    K_STEP,
    MAX_SHARE_BYTES,
    ROWS,
    gemm2_split,
    share_bytes,
    share_reason,
    words_decode_reason,
)
from moekit.presets import preset_at  # noqa: E402
from moekit.synthetic import random_batch, random_layer  # noqa: E402

GPT_OSS = preset("gpt-oss-120b")
ENGINE = TritonMoEConfig(
    **MMA_WORDS_DECODE_TILES, block_m=16, split_k=2, num_stages=3, engine=MatmulEngine.MMA_WORDS_DECODE
)


def test_takes_mxfp4_w4a16_words_and_refuses_other_math_with_the_reason():
    assert words_decode_reason(GPT_OSS) is None and ENGINE.reason_unusable(GPT_OSS) is None
    refusals = {
        "W4A16": preset("qwen3-30b-a3b"),
        "bf16 MMA operands": replace(GPT_OSS, act_dtype=torch.float16),
        "MXFP4_MMA_WORDS": replace(GPT_OSS, intermediate_size=2880 + 4),
    }
    for words, spec in refusals.items():
        reason = ENGINE.reason_unusable(spec)
        assert reason is not None and words in reason, (words, reason)
    assert "W4A16" in words_decode_reason(replace(GPT_OSS, act_quant=ActivationQuant.FP8_PER_TOKEN))
    # K need not be a multiple of the 128-wide step (the words pad their last run): H = 800, I = 1056.
    assert words_decode_reason(preset_at("gpt-oss-120b@32x4x800x1056")) is None


@pytest.mark.parametrize(
    "change",
    [
        dict(block_m=64),
        dict(block_n=64),
        dict(block_k=64),
        dict(num_warps=8),
        dict(gemm2_block_n=128),
        dict(num_stages=2),
        dict(num_stages=5),
        dict(max_registers=128),
        dict(swap_ab=True),
        dict(group_m=8),
    ],
)
def test_refuses_any_other_tiling(change):
    with pytest.raises(SpecError):
        replace(ENGINE, **change)


def test_free_knobs_are_free():
    for change in (dict(block_m=32), dict(num_stages=4), dict(split_k=1), dict(split_k=16)):
        assert replace(ENGINE, **change).engine is MatmulEngine.MMA_WORDS_DECODE


def test_tuned_table_form_round_trips():
    raw = json.loads(json.dumps(replace(ENGINE, split_k=3, num_stages=4).as_dict()))
    assert raw["engine"] == "MMA_WORDS_DECODE"
    assert config_from_dict(TritonMoEConfig, raw, kernel="triton_fused") == replace(
        ENGINE, split_k=3, num_stages=4
    )


def test_share_bytes_are_whole_rounds_of_the_queue():
    # H = 2880: 23 K-steps; split 2 -> 12 a share, whole rounds of 3 (12) or of 4 (12); split 4 -> 6 -> 8.
    assert share_bytes(2880, split_k=2, depth=3, n_tile=16) == 12 * 16 * K_STEP * 2
    assert share_bytes(2880, split_k=4, depth=4, n_tile=8) == 8 * 8 * K_STEP * 2
    assert share_bytes(2880, split_k=1, depth=3, n_tile=16) == 24 * 16 * K_STEP * 2 <= MAX_SHARE_BYTES


@settings(max_examples=60, deadline=None)
@given(
    spec=reshaped_specs([GPT_OSS], experts=[8, 32, 128, 256], dims=[768, 2048, 2880, 4096, 7168, 14336]),
    split_k=st.integers(1, 16),
    depth=st.sampled_from([3, 4]),
    block_m=st.sampled_from([16, 32]),
)
def test_a_config_is_refused_exactly_when_a_share_outgrows_shared_memory(spec, split_k, depth, block_m):
    config = replace(ENGINE, split_k=split_k, num_stages=depth, block_m=block_m)
    split2 = gemm2_split(spec, split_k)
    too_big = (
        max(
            share_bytes(spec.H, split_k=split_k, depth=depth, n_tile=block_m),
            share_bytes(spec.I, split_k=split2, depth=depth, n_tile=block_m),
        )
        > MAX_SHARE_BYTES
    )
    reason = config.reason_unusable(spec)
    assert (reason is not None) == too_big, (spec.describe(), split_k, reason)
    if too_big:
        assert "raise split_k" in reason
    assert share_reason(spec, block_m=block_m, split_k=split_k, depth=depth) == (
        None if reason is None else reason.split(": ", 1)[1]
    )


def test_gemm2_split_matches_gemm1s_programs_within_its_k_steps():
    assert gemm2_split(GPT_OSS, 2) == 4  # 90 w13 tiles x 2 = 45 w2 tiles x 4
    mixtral_like = preset_at("gpt-oss-120b@8x2x4096x14336")  # 448 w13 tiles, 64 w2 tiles
    assert gemm2_split(mixtral_like, 1) == 7 and gemm2_split(mixtral_like, 4) == 16
    small_i = preset_at("gpt-oss-120b@64x8x4096x256")  # I = 256: two K-steps of GEMM2
    assert gemm2_split(small_i, 16) == 2
    assert -(-2 * GPT_OSS.I // ROWS) == 90


def test_off_sm90_the_launch_refuses_before_any_kernel():
    spec = preset_at("gpt-oss-120b@8x2x256x256")
    layer = random_layer(spec)
    weights = TritonFusedKernel().prepare_weights(layer.weights, spec)
    x, _, routing = random_batch(spec, 1, correction_bias=layer.correction_bias, seed=0)
    with pytest.raises(DeviceError, match="sm_90"):
        triton_fused_moe(x, weights, routing, spec=spec, config=ENGINE)


def test_checkpoint_packing_fallback_is_a_tl_dot_decode_tiling():
    # What a plan of this engine runs when the scale bytes kept CHECKPOINT packing: tl.dot decode tiles
    # (the plan's split kept), usable for any MXFP4 W4A16 spec.
    assert MXFP4_DECODE_TILES.engine is MatmulEngine.TL_DOT and MXFP4_DECODE_TILES.block_m == 16
    for split in (1, 2, 4):
        fallback = replace(MXFP4_DECODE_TILES, split_k=split)
        assert fallback.reason_unusable(GPT_OSS) is None
        assert fallback.reason_unusable(replace(GPT_OSS, intermediate_size=2880 + 4)) is None


def test_workspace_counts_both_gemms_shares_even_unsplit():
    # The engine always writes fp32 shares: GEMM1's split_k of 2I columns, GEMM2's gemm2_split of H.
    kernel, pairs = TritonFusedKernel(), 1 * GPT_OSS.K
    unsplit_dot = kernel.workspace_bytes(GPT_OSS, 1, MXFP4_DECODE_TILES)
    for split in (1, 3):
        engine = kernel.workspace_bytes(GPT_OSS, 1, replace(ENGINE, split_k=split))
        shares = split * 2 * GPT_OSS.I + gemm2_split(GPT_OSS, split) * GPT_OSS.H
        assert engine - unsplit_dot == 4 * pairs * shares
