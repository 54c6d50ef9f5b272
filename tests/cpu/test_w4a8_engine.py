"""The WGMMA_W4A8 engine's CPU-checkable parts: the MXFP4_W4A8 packing (`moekit.formats.mxfp4_w4a8`: exact
round trip, flushed groups, the padded shapes ExpertWeights validates), the specs and configs the engine
takes or refuses, and its Gluon GEMM compiled for sm_90 without a spill. The kernels run in
tests/gpu/test_wgmma_w4a8_gpu.py."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from compiled_json import compiled_json
from moekit.errors import ShapeError, SpecError
from moekit.formats import dequantize_mxfp4
from moekit.formats import mxfp4_w4a8 as fmt
from moekit.kernels.triton.config import WGMMA_W4A8_TILES, MatmulEngine, TritonMoEConfig
from moekit.kernels.triton.wgmma_w4a8 import pack_weights, wgmma_w4a8_reason
from moekit.presets import preset_at
from moekit.spec import ActivationQuant, GateLayout, RouterWeightPlacement
from moekit.synthetic import random_layer
from moekit.weights import WeightPacking

FP8_TOKENS = ActivationQuant.FP8_PER_TOKEN
# H = 208: two K-steps, the last 48 columns of zeros; 2I = 640: five 128-row programs; H rows padded to 256
W4A8 = replace(preset_at("gpt-oss-20b@4x2x208x320"), act_quant=FP8_TOKENS)


def _checkpoint(e: int, n: int, k: int, *, low: int, high: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    g = -(-k // 32)
    blocks = torch.randint(0, 256, (e, n, g, 16), generator=gen, dtype=torch.uint8)
    return blocks, torch.randint(low, high, (e, n, g), generator=gen, dtype=torch.uint8)


@pytest.mark.parametrize("n, k", [(128, 256), (200, 300), (16, 2880)])
def test_packing_round_trips_exactly_within_the_exact_drops(n, k):
    blocks, scales = _checkpoint(2, n, k, low=118, high=128)
    words, drops = fmt.pack_w4a8(blocks, scales, in_dim=k)
    assert words.shape == (2, fmt.padded_rows(n) // 16, fmt.steps(k), 32, 8)
    assert drops.shape == (2, fmt.padded_rows(n), fmt.steps(k) + fmt.references(k))
    back_blocks, back_scales = fmt.unpack_w4a8(words, drops, rows=n, in_dim=k)
    assert fmt.flushed_groups(scales) == 0
    want = dequantize_mxfp4(blocks, scales, in_dim=k, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(back_blocks, back_scales, in_dim=k, dtype=torch.float32), want)


def test_groups_far_below_their_reference_are_flushed():
    blocks, scales = _checkpoint(1, 16, 256, low=120, high=121)
    blocks |= 0x11  # no zero codes: a flushed group must read zero
    scales[0, 3, 5] = 120 - 12  # 12 binades below the reference of groups 0 - 7
    scales[0, 4, 6] = 120 - 11  # the last exact drop
    assert fmt.flushed_groups(scales) == 1
    back_blocks, back_scales = fmt.unpack_w4a8(
        *fmt.pack_w4a8(blocks, scales, in_dim=256), rows=16, in_dim=256
    )
    assert not back_blocks[0, 3, 5].any() and back_blocks[0, 4, 6].all()
    keep = torch.ones_like(scales, dtype=torch.bool)
    keep[0, 3, 5] = False
    assert torch.equal(back_blocks[keep], blocks[keep]) and torch.equal(back_scales[keep], scales[keep])


def test_word_bits_decode_through_the_table_model():
    # Each word's bit placement against the prmt table model (tools/w4a8_lut.py): codes in K order.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import w4a8_lut

    assert w4a8_lut.check(words=2000) == 0


@pytest.mark.parametrize("layout", [GateLayout.INTERLEAVED, GateLayout.CONCAT])
def test_expert_weights_carry_the_packing_and_unpack_to_the_checkpoint(layout):
    spec = replace(W4A8, gate_layout=layout)
    raw = random_layer(spec, seed=1).weights
    packed = pack_weights(raw)
    assert packed.packing is WeightPacking.MXFP4_W4A8 and (packed.H, packed.I) == (raw.H, raw.I)
    packed.validate(spec)
    back = packed.unpacked()
    for name in ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2"):
        assert torch.equal(getattr(back, name), getattr(raw, name)), name
    assert torch.equal(packed.dequantize_w13(2), raw.dequantize_w13(2))
    assert torch.equal(packed.dequantize_w2(3), raw.dequantize_w2(3))
    with pytest.raises(ShapeError, match="MXFP4_W4A8 w2_scale"):
        replace(packed, w2_scale=packed.w2_scale[:, :-1])


def test_engine_reasons_name_what_it_cannot_compute():
    assert wgmma_w4a8_reason(W4A8) is None
    cases = {
        "FP8_PER_TOKEN": replace(W4A8, act_quant=ActivationQuant.FP8_PER_GROUP_128),
        "W4A8 path": replace(W4A8, act_quant=ActivationQuant.NONE),
        "OUTPUT placement": replace(W4A8, router_weight_placement=RouterWeightPlacement.INPUT, top_k=1),
        "2I must be a multiple of 128": replace(preset_at("gpt-oss-20b@4x2x256x200"), act_quant=FP8_TOKENS),
        "H must be a multiple of 16": replace(preset_at("gpt-oss-20b@4x2x200x320"), act_quant=FP8_TOKENS),
    }
    for why, spec in cases.items():
        assert why in wgmma_w4a8_reason(spec), why


def test_engine_configs_are_checked_at_construction():
    config = TritonMoEConfig(engine=MatmulEngine.WGMMA_W4A8, block_m=128, num_stages=4, **WGMMA_W4A8_TILES)
    assert config.reason_unusable(W4A8) is None
    assert "WGMMA_W4A8 engine cannot" in config.reason_unusable(replace(W4A8, act_quant=ActivationQuant.NONE))
    for bad in (dict(block_m=64), dict(num_stages=7), dict(num_warps=8)):
        with pytest.raises(SpecError, match="WGMMA_W4A8 engine runs"):
            replace(config, **bad)


def test_gemms_compile_for_hopper_without_spills():
    pytest.importorskip("triton.experimental.gluon")
    # gpt-oss's shapes (23 K-steps, GEMM2's rows padded to 2944) at the deepest ring the tuning space takes
    facts = compiled_json(["-c", _COMPILE])
    for gemm in ("1", "2"):
        assert facts[gemm]["local_memory_ops"] == 0 and facts[gemm]["local_bytes"] == 0, facts
        assert facts[gemm]["shared"] <= 232448, facts


def test_decode_after_the_wait_keeps_each_pairs_wgmmas_pipelined():
    pytest.importorskip("triton.experimental.gluon")
    # DECODE_UNDER_MMA off: every K-loop (three widths, two math partitions) waits once a pair of steps,
    # after its 8 wgmma instructions, with no spill. (On, Triton 3.6's ptxas waits after each of the 8,
    # C7513.)
    facts = compiled_json(["-c", _COMPILE_ORDER])
    assert facts["waits"] == [[0]] * 6 and facts["local_memory_ops"] == 0, facts


_COMPILE = """
import json
import hopper_compile, sass_report
facts = {}
for gemm in (1, 2):
    kernel = hopper_compile.compile_wgmma_w4a8_for_hopper(gemm, hidden=2880, inter=2880, stages=6)
    facts[gemm] = dict(sass_report.kernel_facts(kernel), shared=kernel.metadata.shared)
print(json.dumps(facts))
"""


_COMPILE_ORDER = """
import json
import hopper_compile, sass_report
kernel = hopper_compile.compile_wgmma_w4a8_for_hopper(
    1, hidden=2880, inter=2880, stages=5, decode_under_mma=False
)
loops = sass_report.mma_loops(sass_report.all_instructions(kernel))
waits = [sass_report.wgmma_waits(loop) for loop in loops]
print(json.dumps(dict(sass_report.kernel_facts(kernel), waits=waits)))
"""
