"""The WGMMA_FP8 engine's rules on the CPU: which specs and configs it takes, when the planner picks it,
its tuned-table form, the refusal off sm_90, and its Gluon kernels compiled for sm_90 (no GPU needed).
Its numbers against the reference are GPU tests (tests/gpu/test_wgmma_fp8_gpu.py)."""

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from compiled_json import compiled_json  # noqa: E402
from layer_shapes import reshaped_specs  # noqa: E402
from moekit import (  # noqa: E402
    Activation,
    ActivationQuant,
    ActivationSpec,
    DeviceError,
    Fp8Scale,
    GateLayout,
    RouterWeightPlacement,
    SpecError,
    TunedTableError,
    preset,
)
from moekit.kernels.base import config_from_dict  # noqa: E402
from moekit.kernels.triton.config import WGMMA_FP8_TILES, MatmulEngine, TritonMoEConfig  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.tuning import (  # noqa: E402
    WGMMA_FP8_CHANNEL_MIN_TOKENS_PER_EXPERT,
    WGMMA_FP8_DEFAULT,
    WGMMA_FP8_TALL,
    WGMMA_FP8_TALL_MIN_TOKENS_PER_EXPERT,
    WGMMA_MIN_TOKENS_PER_EXPERT,
    default_config,
)
from moekit.kernels.triton.tuning_space import tuning_space  # noqa: E402
from moekit.kernels.triton.wgmma_fp8 import wgmma_fp8_reason  # noqa: E402
from moekit.presets import fp8_channel  # noqa: E402
from moekit.synthetic import random_batch, random_layer  # noqa: E402

DEEPSEEK = preset("deepseek-v3")


def test_takes_block_128_w8a8_and_refuses_other_math_with_the_reason():
    assert wgmma_fp8_reason(DEEPSEEK) is None
    assert WGMMA_FP8_DEFAULT.reason_unusable(DEEPSEEK) is None
    refusals = {
        "W8A8 path": preset("qwen3-30b-a3b"),
        "got PER_CHANNEL weight scales with act_quant=NONE": replace(
            fp8_channel(preset("qwen3-30b-a3b")), act_quant=ActivationQuant.NONE
        ),
        "plain SiLU": replace(DEEPSEEK, activation=ActivationSpec(Activation.SILU, limit=7.0)),
        "bf16 activations": replace(DEEPSEEK, act_dtype=torch.float16),
        "SiLU(gate) * up": replace(DEEPSEEK, activation=ActivationSpec(Activation.GELU)),
        "router weight": replace(DEEPSEEK, top_k=1, router_weight_placement=RouterWeightPlacement.INPUT),
        "I must be a multiple of 256": replace(DEEPSEEK, intermediate_size=1920),
        "H must be a multiple of 256": replace(DEEPSEEK, hidden_size=7296),
        "1x128 activation": replace(DEEPSEEK, act_quant=ActivationQuant.FP8_PER_TOKEN),
    }
    for words, spec in refusals.items():
        reason = WGMMA_FP8_DEFAULT.reason_unusable(spec)
        assert reason is not None and words in reason, (words, reason)


@pytest.mark.parametrize(
    "change",
    [
        dict(block_m=64),
        dict(tail_block_m=None),
        dict(block_n=64),
        dict(split_k=2, tail_block_m=None),
        dict(gemm2_block_n=256),
        dict(swap_ab=True),
        dict(num_warps=8),
        dict(gemm1_block_m=64),
        dict(gemm1_block_m=256),
    ],
)
def test_refuses_any_other_tiling(change):
    with pytest.raises(SpecError):  # the engine's rule, or a field rule that comes first
        replace(WGMMA_FP8_DEFAULT, **change)


@pytest.mark.parametrize("rows, too_deep", [(None, 5), (128, 6)])
def test_gemm1_ring_depth_is_refused_outside_what_runs(rows, too_deep):
    # One stage would wait on itself (two K-steps' wgmma are held before a stage is handed back); one
    # past the deepest does not fit sm_90's shared memory (the compile test below builds the deepest).
    config = replace(WGMMA_FP8_DEFAULT, gemm1_block_m=rows, num_stages=2)
    assert replace(config, num_stages=too_deep - 1).num_stages == too_deep - 1
    for bad in (1, too_deep):
        with pytest.raises(SpecError, match=f"ring depth: 2 to {too_deep - 1} with gemm1_block_m={rows}"):
            replace(config, num_stages=bad)
    default = WGMMA_FP8_TALL if rows else WGMMA_FP8_DEFAULT  # each GEMM1's deepest ring
    assert default.num_stages == too_deep - 1


def test_gemm1_block_m_is_the_wgmma_fp8_engines_choice_alone():
    assert WGMMA_FP8_TALL.gemm1_block_m == WGMMA_FP8_TALL.block_m == 128
    with pytest.raises(SpecError, match="gemm1_block_m.*engine=TL_DOT"):
        TritonMoEConfig(block_m=128, gemm1_block_m=128)
    with pytest.raises(SpecError, match="gemm1_block_m"):
        TritonMoEConfig(block_m=128, gemm1_block_m=128, engine=MatmulEngine.WGMMA_WORDS)


def test_engine_must_be_the_enum():
    with pytest.raises(SpecError, match="MatmulEngine"):
        TritonMoEConfig(engine="WGMMA_FP8")


def test_tuned_table_form_round_trips_and_bad_names_are_refused():
    raw = json.loads(json.dumps(WGMMA_FP8_DEFAULT.as_dict()))
    assert raw["engine"] == "WGMMA_FP8"
    assert config_from_dict(TritonMoEConfig, raw, kernel="triton_fused") == WGMMA_FP8_DEFAULT
    tall = json.loads(json.dumps(WGMMA_FP8_TALL.as_dict()))
    assert config_from_dict(TritonMoEConfig, tall, kernel="triton_fused") == WGMMA_FP8_TALL
    # Rows written before the field existed still read, as GEMM1 on the 64-row blocks.
    older = {k: v for k, v in raw.items() if k != "gemm1_block_m"}
    assert config_from_dict(TritonMoEConfig, older, kernel="triton_fused") == WGMMA_FP8_DEFAULT
    with pytest.raises(TunedTableError, match="gemm1_block_m"):
        config_from_dict(TritonMoEConfig, {**raw, "gemm1_block_m": 64}, kernel="triton_fused")
    old_row = {k: v for k, v in TritonMoEConfig().as_dict().items() if k != "engine"}
    assert config_from_dict(TritonMoEConfig, old_row, kernel="triton_fused").engine is MatmulEngine.TL_DOT
    for bad in ("wgmma", 3, None):
        with pytest.raises(TunedTableError, match="engine must be one of"):
            config_from_dict(TritonMoEConfig, {**raw, "engine": bad}, kernel="triton_fused")


@settings(max_examples=60, deadline=None)
@given(
    spec=reshaped_specs([DEEPSEEK], experts=[16, 64, 256], dims=[256, 512, 1408, 2048, 2880, 7168]),
    tokens=st.integers(1, 40000),
    hopper=st.booleans(),
)
def test_default_takes_the_engine_only_on_hopper_for_prefill_and_only_where_it_computes(spec, tokens, hopper):
    config = default_config(spec, tokens, 132, hopper=hopper)
    assert config.reason_unusable(spec) is None
    per_expert = tokens * spec.K / spec.E
    wanted = hopper and per_expert >= WGMMA_MIN_TOKENS_PER_EXPERT and wgmma_fp8_reason(spec) is None
    assert (config.engine is MatmulEngine.WGMMA_FP8) == wanted
    tall = wanted and per_expert >= WGMMA_FP8_TALL_MIN_TOKENS_PER_EXPERT
    assert config == WGMMA_FP8_TALL if tall else config.gemm1_block_m is None
    space = tuning_space(spec, tokens, 132, hopper=hopper)
    assert all(c.reason_unusable(spec) is None for c in space)
    if not hopper:
        assert all(c.engine is MatmulEngine.TL_DOT for c in space)
    swept_rows = {c.gemm1_block_m for c in space if c.engine is MatmulEngine.WGMMA_FP8}
    if wanted:  # both GEMM1 tilings are swept
        assert swept_rows == {None, 128}
    elif per_expert < WGMMA_MIN_TOKENS_PER_EXPERT:  # an expert's one odd block would idle half a program
        assert 128 not in swept_rows


def test_off_sm90_the_launch_refuses_before_any_kernel():
    layer = random_layer(replace(DEEPSEEK, num_experts=16, hidden_size=256, intermediate_size=256))
    spec = layer.spec
    x, _, routing = random_batch(spec, 3, correction_bias=layer.correction_bias, seed=0)
    with pytest.raises(DeviceError, match="sm_90"):
        triton_fused_moe(x, layer.weights, routing, spec=spec, config=WGMMA_FP8_DEFAULT)


_COMPILE = """
import json, hopper_compile as c, sass_report as r
out = {}
for gemm, rows, channel in ((1, 64, 0), (1, 128, 0), (2, 128, 0), (1, 128, 1), (2, 128, 1)):
    kernel = c.compile_wgmma_fp8_for_hopper(gemm, gemm1_rows=rows, per_channel=bool(channel))
    instructions = r.all_instructions(kernel)
    loops = r.mma_loops(instructions)
    out[f"{gemm}/{rows}" + ("/channel" if channel else "")] = {
        **r.kernel_facts(kernel, instructions),
        "k_loop_spills": r.k_loop_spills(instructions),
        "k_loop_lengths": [len(loop) for loop in loops],
        "waits": sorted(set(r.wgmma_waits(instructions))),
        "fp8_wgmma": sum(1 for _, t in instructions if r.unpredicated(t).startswith("QGMMA")),
        "shared": kernel.metadata.shared,
    }
print(json.dumps(out))
"""


def test_gluon_kernels_compile_for_sm90_without_spills_and_keep_one_mma_in_flight():
    # What the engine's speed rests on: no spill, the whole ring in shared memory (232,448 bytes on
    # sm_90), and a wait that leaves one wgmma group in flight (DEPBAR.LE gsb0, 0x1) while the retired
    # product is scaled; waits for 0 only are the tl.dot schedule this engine replaces.
    facts = compiled_json(["-c", _COMPILE])
    for name, fact in facts.items():
        assert fact["local_bytes"] == 0, (name, fact)
        # The 128-row GEMM1 keeps a few values on the stack (10 local memory instructions in all): stored
        # before its register budget is raised, and reloaded by its second math warpgroup, two a window
        # of two K-steps (an L1 hit against 8 wgmma). The per-channel GEMM1 keeps one (stored before the
        # register budget is raised, reloaded outside the K-loop). The others have none.
        tall = name == "1/128"
        allowed = {"1/128": 10, "1/128/channel": 2}.get(name, 0)
        assert fact["local_memory_ops"] <= allowed, (name, fact)
        assert max(fact["k_loop_spills"]) <= (2 if tall else 0), (name, fact)
        assert fact["shared"] <= 232448, (name, fact)
        assert 1 in fact["waits"], (name, fact)
        assert fact["fp8_wgmma"] > 0, (name, fact)


def test_engine_tiles_are_the_documented_ones():
    assert {k: getattr(WGMMA_FP8_DEFAULT, k) for k in WGMMA_FP8_TILES} == WGMMA_FP8_TILES
    assert WGMMA_FP8_DEFAULT.engine is MatmulEngine.WGMMA_FP8


def test_batch_invariant_plans_keep_to_the_tl_dot_engine():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    kernel = TritonFusedKernel()
    assert kernel.batch_invariant_config(WGMMA_FP8_DEFAULT, DEEPSEEK) is None
    dot = default_config(DEEPSEEK, 1024, 132, hopper=True)  # the batch-invariant anchor: 32 an expert
    assert dot.engine is MatmulEngine.TL_DOT and kernel.batch_invariant_config(dot, DEEPSEEK) is not None


def test_workspace_counts_the_sorted_rows():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    pairs = 16384 * DEEPSEEK.K
    got = TritonFusedKernel().workspace_bytes(DEEPSEEK, 16384, WGMMA_FP8_DEFAULT)
    # at least the sorted x and h codes of every pair, and y
    assert got >= pairs * (DEEPSEEK.H + DEEPSEEK.I) + pairs * DEEPSEEK.H * 2
    assert (
        got
        < 1.2 * (pairs + 64 * DEEPSEEK.E) * (DEEPSEEK.H + DEEPSEEK.I) * 1.04
        + pairs * DEEPSEEK.H * 2
        + 64 * pairs
    )


MIXTRAL_CHANNEL = fp8_channel(preset("mixtral-8x7b"))


@pytest.mark.parametrize("scale", [Fp8Scale.PER_CHANNEL, Fp8Scale.PER_TENSOR])
def test_takes_per_channel_w8a8_on_128_row_gemm1_blocks_only(scale):
    spec = replace(MIXTRAL_CHANNEL, fp8_scale=scale)
    assert wgmma_fp8_reason(spec) is None
    assert WGMMA_FP8_TALL.reason_unusable(spec) is None
    assert replace(WGMMA_FP8_TALL, num_stages=2, group_m=1).reason_unusable(spec) is None
    reason = WGMMA_FP8_DEFAULT.reason_unusable(spec)  # GEMM1 on the 64-row blocks: block-128 only
    assert reason is not None and "gemm1_block_m must be 128, got None" in reason
    # Every gated activation, clamped or not, goes through its GEMM1 epilogue.
    clamped = replace(spec, activation=ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0))
    assert wgmma_fp8_reason(clamped) is None
    refusals = {
        "concatenated gate/up rows": replace(spec, gate_layout=GateLayout.INTERLEAVED),
        "multiple of 256": replace(spec, intermediate_size=14336 + 128),
        "bf16 activations": replace(spec, act_dtype=torch.float16),
    }
    for words, bad in refusals.items():
        reason = WGMMA_FP8_TALL.reason_unusable(bad)
        assert reason is not None and words in reason, (words, reason)


@settings(max_examples=40, deadline=None)
@given(
    spec=reshaped_specs([MIXTRAL_CHANNEL], experts=[8, 64, 128], dims=[256, 768, 1536, 4096, 14336]),
    tokens=st.integers(1, 40000),
    hopper=st.booleans(),
)
def test_default_takes_the_per_channel_form_on_hopper_by_tokens_an_expert(spec, tokens, hopper):
    config = default_config(spec, tokens, 132, hopper=hopper)
    assert config.reason_unusable(spec) is None
    per_expert = tokens * spec.K / spec.E
    wanted = (
        hopper and per_expert >= WGMMA_FP8_CHANNEL_MIN_TOKENS_PER_EXPERT and wgmma_fp8_reason(spec) is None
    )
    assert (config == WGMMA_FP8_TALL) == wanted
    engine = [c for c in tuning_space(spec, tokens, 132, hopper=hopper) if c.engine is MatmulEngine.WGMMA_FP8]
    assert all(c.gemm1_block_m == 128 for c in engine)
    if wanted:
        assert WGMMA_FP8_TALL in engine


def test_per_channel_workspace_counts_h_in_fp32():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    kernel = TritonFusedKernel()
    spec = MIXTRAL_CHANNEL
    block_like = replace(spec, fp8_scale=Fp8Scale.BLOCK_128, act_quant=ActivationQuant.FP8_PER_GROUP_128)
    extra = kernel.workspace_bytes(spec, 4096, WGMMA_FP8_TALL) - kernel.workspace_bytes(
        block_like, 4096, WGMMA_FP8_TALL
    )
    assert extra >= 4 * 4096 * spec.K * spec.I
