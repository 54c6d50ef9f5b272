"""The WGMMA_BF16 engine's rules on the CPU: which specs and configs it takes, its tuned-table form, where
the tuning space offers it, the refusal off sm_90, and its Gluon GEMM2 compiled for sm_90 (no GPU
needed). Its numbers against the reference are GPU tests (tests/gpu/test_wgmma_bf16_gpu.py)."""

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from compiled_json import compiled_json  # noqa: E402
from layer_shapes import reshaped_specs  # noqa: E402
from moekit import DeviceError, SpecError, TunedTableError, preset  # noqa: E402
from moekit.kernels.base import config_from_dict  # noqa: E402
from moekit.kernels.triton.config import MatmulEngine, TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.tuning_space import tuning_space  # noqa: E402
from moekit.kernels.triton.wgmma_bf16 import (  # noqa: E402
    ALIGNMENT_ROWS,
    GEMM2_BLOCK_NS,
    gluon_gemm1_reason,
    wgmma_bf16_reason,
)
from moekit.spec import WeightFormat  # noqa: E402
from moekit.synthetic import random_batch, random_layer  # noqa: E402

QWEN3 = preset("qwen3-30b-a3b")
ENGINE = TritonMoEConfig(
    block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, gemm2_block_n=256,
    engine=MatmulEngine.WGMMA_BF16,
)  # fmt: skip


def test_takes_16_bit_float_specs_and_refuses_the_others_with_the_reason():
    gpt_oss_bf16 = replace(preset("gpt-oss-120b"), weight_format=WeightFormat.BF16)
    fp16 = replace(QWEN3, weight_format=WeightFormat.FP16, act_dtype=torch.float16)
    for spec in (QWEN3, gpt_oss_bf16, fp16, preset("mixtral-8x7b")):
        assert wgmma_bf16_reason(spec) is None, spec.describe()
        assert ENGINE.reason_unusable(spec) is None
    refusals = {
        "bf16 or fp16 weights": preset("deepseek-v3"),
        "got mxfp4": preset("gpt-oss-120b"),
        "activations of the weights' dtype": replace(QWEN3, act_dtype=torch.float32),
        "multiple of 8": replace(QWEN3, intermediate_size=766),
    }
    for words, spec in refusals.items():
        reason = ENGINE.reason_unusable(spec)
        assert reason is not None and words in reason, (words, reason)


@pytest.mark.parametrize(
    "change",
    [
        dict(split_k=2),
        dict(swap_ab=True),
        dict(block_m=32),  # an alignment of 32 rows
        dict(block_m=256, tail_block_m=None),
        dict(gemm2_block_n=64),
        dict(gemm2_block_n=None, block_n=64),  # GEMM2 tile = block_n = 64
    ],
)
def test_refuses_tilings_its_gemm2_cannot_walk(change):
    with pytest.raises(SpecError):
        replace(ENGINE, **change)


def test_gemm1_gluon_is_the_engines_choice_alone_and_tells_where_its_kernel_cannot_run():
    assert replace(ENGINE, gemm1_gluon=True).gemm1_gluon
    with pytest.raises(SpecError, match="gemm1_gluon.*engine=WGMMA_BF16"):
        TritonMoEConfig(block_m=128, gemm1_gluon=True)
    with pytest.raises(SpecError, match="gemm1_gluon"):
        replace(ENGINE, gemm1_gluon=1)
    assert gluon_gemm1_reason(QWEN3) is None
    assert gluon_gemm1_reason(replace(preset("gpt-oss-120b"), weight_format=WeightFormat.BF16)) is None
    assert "multiple of 64" in gluon_gemm1_reason(replace(QWEN3, hidden_size=1440))
    raw = json.loads(json.dumps(replace(ENGINE, gemm1_gluon=True).as_dict()))
    assert raw["gemm1_gluon"] is True
    assert config_from_dict(TritonMoEConfig, raw, kernel="triton_fused").gemm1_gluon
    older = {k: v for k, v in raw.items() if k != "gemm1_gluon"}  # rows written before the field
    assert config_from_dict(TritonMoEConfig, older, kernel="triton_fused") == ENGINE


def test_takes_every_alignment_and_width_it_names():
    for rows in ALIGNMENT_ROWS:
        for width in GEMM2_BLOCK_NS:
            tail = {"block_m": 128, "tail_block_m": 64} if rows == 64 else {"block_m": 128}
            assert replace(ENGINE, **tail, gemm2_block_n=width).engine is MatmulEngine.WGMMA_BF16
    assert replace(ENGINE, block_m=64, gemm2_block_n=128).block_n_gemm2 == 128


def test_tuned_table_form_round_trips_and_bad_names_are_refused():
    raw = json.loads(json.dumps(ENGINE.as_dict()))
    assert raw["engine"] == "WGMMA_BF16"
    assert config_from_dict(TritonMoEConfig, raw, kernel="triton_fused") == ENGINE
    with pytest.raises(TunedTableError, match="engine must be one of"):
        config_from_dict(TritonMoEConfig, {**raw, "engine": "WGMMA_B16"}, kernel="triton_fused")
    with pytest.raises(TunedTableError):
        config_from_dict(TritonMoEConfig, {**raw, "gemm2_block_n": 64}, kernel="triton_fused")


@settings(max_examples=40, deadline=None)
@given(
    spec=reshaped_specs([QWEN3, preset("mixtral-8x7b")], experts=[8, 64, 512], dims=[512, 768, 2048, 2880]),
    tokens=st.integers(1, 40000),
    hopper=st.booleans(),
)
def test_the_tuning_space_offers_it_on_hopper_for_prefill_only(spec, tokens, hopper):
    space = tuning_space(spec, tokens, 132, hopper=hopper)
    engine = [c for c in space if c.engine is MatmulEngine.WGMMA_BF16]
    assert all(c.reason_unusable(spec) is None for c in space)
    if engine:
        assert hopper and tokens * spec.K / spec.E > 32
        assert {c.block_n_gemm2 for c in engine} == set(GEMM2_BLOCK_NS)
        gluon = {(c.block_m, c.tail_block_m, c.block_n_gemm2) for c in engine if c.gemm1_gluon}
        if gluon_gemm1_reason(spec) is None:  # its fixed tiles at both alignments and widths
            assert gluon == {(128, tail, n) for tail in (None, 64) for n in GEMM2_BLOCK_NS}
        else:
            assert not gluon
    elif hopper and tokens * spec.K / spec.E > 32:
        pytest.fail(f"no WGMMA_BF16 candidate for {spec.describe()} at T={tokens}")


def test_off_sm90_the_launch_refuses_before_any_kernel():
    layer = random_layer(replace(QWEN3, num_experts=16, hidden_size=256, intermediate_size=256))
    x, _, routing = random_batch(layer.spec, 3, correction_bias=layer.correction_bias, seed=0)
    with pytest.raises(DeviceError, match="sm_90"):
        triton_fused_moe(x, layer.weights, routing, spec=layer.spec, config=ENGINE)


_COMPILE = """
import json, hopper_compile as c, sass_report as r
out = {}
# GEMM2 at both widths (the wider over paired blocks with b2), GEMM1 over paired blocks with b13
# GEMM1 with gpt-oss's interleaved gate/up rows ("1i")
for width, paired in ((128, False), (256, True), (1, True), ("1i", True)):
    if width == "1i":
        kernel = c.compile_wgmma_bf16_gemm1_for_hopper(
            paired=paired, bias=True, interleaved=True, hidden=2880, inter=2880
        )
    elif width == 1:  # GEMM1
        kernel = c.compile_wgmma_bf16_gemm1_for_hopper(paired=paired, bias=paired)
    else:
        kernel = c.compile_wgmma_bf16_for_hopper(block_n=width, paired=paired, bias=paired)
    instructions = r.all_instructions(kernel)
    out[f"{width}/{paired}"] = {
        **r.kernel_facts(kernel, instructions),
        "k_loop_spills": r.k_loop_spills(instructions),
        "waits": sorted(set(r.wgmma_waits(instructions))),
        "bf16_wgmma": sum(1 for _, t in instructions if r.unpredicated(t).startswith("HGMMA")),
        "shared": kernel.metadata.shared,
    }
print(json.dumps(out))
"""


def test_gluon_gemms_compile_for_sm90_without_spills_and_keep_mma_in_flight():
    # What the engine's speed rests on: no spill, the ring and the epilogue's re-layout in shared memory
    # (232,448 bytes on sm_90), and a wait that leaves the step's wgmma in flight while the next stage is
    # waited for (DEPBAR.LE gsb0, 0x1 in GEMM2; 0x2 in GEMM1, whose step is a gate and an up wgmma).
    facts = compiled_json(["-c", _COMPILE])
    assert len(facts) == 4
    for name, fact in facts.items():
        assert fact["local_bytes"] == 0 and fact["local_memory_ops"] == 0, (name, fact)
        assert fact["k_loop_spills"] and max(fact["k_loop_spills"]) == 0, (name, fact)
        assert fact["shared"] <= 232448, (name, fact)
        assert (2 if name.split("/")[0] in ("1", "1i") else 1) in fact["waits"], (name, fact)
        assert fact["bf16_wgmma"] > 0, (name, fact)


def test_workspace_counts_h_in_the_padded_sorted_rows_and_batch_invariance_keeps_to_tl_dot():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    kernel = TritonFusedKernel()
    for tokens in (1, 300, 16384):
        pairs = tokens * QWEN3.K
        dot = kernel.workspace_bytes(QWEN3, tokens, replace(ENGINE, engine=MatmulEngine.TL_DOT))
        got = kernel.workspace_bytes(QWEN3, tokens, ENGINE)
        # every expert may pad up to one 128-row block more than its pairs (at most P + E * 127 rows)
        padded = min(pairs, -(-pairs // 128) + QWEN3.E) * 128
        assert got - dot == (padded - pairs) * QWEN3.I * 2, tokens
    assert kernel.batch_invariant_config(ENGINE, QWEN3) is None


@settings(max_examples=40, deadline=None)
@given(
    spec=reshaped_specs([QWEN3, preset("mixtral-8x7b")], experts=[8, 64, 512], dims=[512, 766, 2048, 2880]),
    tokens=st.integers(1, 40000),
    hopper=st.booleans(),
)
def test_the_default_takes_it_for_prefill_on_hopper_where_it_computes(spec, tokens, hopper):
    from moekit.kernels.triton.tuning import FLOAT_PREFILL_TILES, WGMMA_BF16_DEFAULT, default_config

    config = default_config(spec, tokens, 132, hopper=hopper)
    assert config.reason_unusable(spec) is None
    prefill = tokens * spec.K / spec.E > 48
    wanted = hopper and tokens * spec.K / spec.E >= 128 and wgmma_bf16_reason(spec) is None
    assert (config.engine is MatmulEngine.WGMMA_BF16) == wanted
    if prefill:  # the same GEMM1 tiles either way
        assert replace(config, engine=MatmulEngine.TL_DOT, gemm1_gluon=False) == FLOAT_PREFILL_TILES
        assert WGMMA_BF16_DEFAULT == replace(FLOAT_PREFILL_TILES, engine=MatmulEngine.WGMMA_BF16)
    gluon = wanted and tokens * spec.K / spec.E >= 512 and gluon_gemm1_reason(spec) is None
    assert config.gemm1_gluon == gluon


def test_the_gluon_gemm1_declines_x_rows_cp_async_cannot_copy_16_bytes_at_a_time():
    from moekit.kernels.triton.wgmma_bf16 import gluon_gemm1_runs

    wide = torch.zeros(4, QWEN3.H + 8, dtype=torch.bfloat16)
    for x in (wide[:, : QWEN3.H], wide[:, 8:]):  # a row stride of H + 8 elements; an address 16 bytes in
        runs = gluon_gemm1_runs(QWEN3, x)
        assert runs is False  # the tl.dot GEMM1 runs instead


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_the_gluon_gemm1_descriptors_give_each_box_consecutive_gate_or_up_rows(layout):
    # The kernel reads gate rows [r, r + 128) of one descriptor and up rows [u, u + 128) of the other, with
    # r = e * rows_per_expert + n and u = r (+ I when concatenated): each descriptor row must be exactly
    # that gate (or up) row of w13, whichever layout w13 has.
    from moekit.kernels.triton.wgmma_bf16 import GEMM1_BLOCK_N, TILE_K, _gate_up_descriptors
    from moekit.spec import GateLayout

    experts, inter, hidden = 3, 40, 64
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).to(torch.bfloat16)  # every row distinct
    gate, up = _gate_up_descriptors(w13, GateLayout(layout))
    assert gate.block_shape == up.block_shape == [GEMM1_BLOCK_N, TILE_K]
    for desc in (gate, up):
        assert list(desc.strides) == [desc.base.stride(0), 1] and desc.shape[1] == hidden

    def row(desc, r):  # descriptor row r where TMA addresses it: its base + r row strides
        offset = (desc.base.data_ptr() - w13.data_ptr()) // w13.element_size() + r * desc.strides[0]
        return w13.view(-1)[offset : offset + hidden]

    gate_rows = w13[:, :inter] if layout == "concat" else w13[:, 0::2]
    up_rows = w13[:, inter:] if layout == "concat" else w13[:, 1::2]
    per_expert = 2 * inter if layout == "concat" else inter
    up_offset = inter if layout == "concat" else 0
    for e in range(experts):
        for j in (0, 1, inter - 1):
            assert torch.equal(row(gate, e * per_expert + j), gate_rows[e, j])
            assert torch.equal(row(up, e * per_expert + up_offset + j), up_rows[e, j])
    assert gate.shape[0] == experts * per_expert
