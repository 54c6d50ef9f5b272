"""The planner: never an incapable kernel, whatever the tuned tables say.

The regression suite replays the failure that motivated moekit on the gpt-oss-120b spec (MXFP4,
SWIGLU_OAI alpha=1.702 L=7, INTERLEAVED, biases): each bad table state must resolve to a capable
kernel with identical numerics, show the bad row in `explain`, and raise under `strict=True`.
"""

import json
import sys
from dataclasses import replace

import pytest
import torch

import moekit
from fake_kernels import ConcatOnlyKernel, CudaOnlyGroupedKernel, SiluGeluOnlyKernel, TileConfig
from moekit import MoESpec, PlanFallbackError, UnsupportedSpecError
from moekit.app.cli_spec import SIMULATED_DEVICES
from moekit.kernels.registry import default_registry
from moekit.ops import fused_moe, prepare_weights
from moekit.planning.plan import ConfigSource, plan
from moekit.planning.tuned import row_to_json, triton_version
from moekit.synthetic import random_layer, random_tokens
from moekit.weights import WeightPacking

REGISTRY = default_registry().with_kernels(SiluGeluOnlyKernel(), ConcatOnlyKernel())
H200 = SIMULATED_DEVICES["h200"]
GPT_OSS_120B = moekit.preset("gpt-oss-120b")
# The same math at a size the CPU runs in milliseconds (fp32 activations for exact comparisons).
SMALL_120B = replace(
    GPT_OSS_120B, num_experts=8, hidden_size=64, intermediate_size=96, act_dtype=torch.float32
)


def _row(spec, *, kernel, config, device, tokens=1):
    row = row_to_json(
        spec=spec, device=device, triton=triton_version(), tokens=tokens, kernel=kernel, config=TileConfig()
    )
    row["config"] = config
    return row


@pytest.fixture(autouse=True)
def _no_shipped_tables(monkeypatch):
    """These tests pin the planner's table semantics on the tables they write; the shipped H200 rows
    (gpt-oss-120b among them) would answer first. `test_shipped_h200_rows_are_valid` covers those."""
    monkeypatch.setattr(sys.modules["moekit.planning.plan"], "shipped_table_paths", lambda: [])


def test_shipped_h200_rows_are_valid(monkeypatch):
    monkeypatch.undo()  # the real shipped tables
    from moekit.planning.plan import resolve_tables
    from moekit.planning.tuned import shipped_table_paths

    tables = resolve_tables(None, REGISTRY)
    assert shipped_table_paths() and not tables.rejected, tables.rejected
    for t in (1, 64, 4096):
        chosen = plan(GPT_OSS_120B, num_tokens=t, device=H200, registry=REGISTRY)
        # Rows are keyed by the Triton version they were tuned with (the test extra pins 3.6.0).
        if triton_version() == "3.6.0":
            assert chosen.source is ConfigSource.TUNED_ROW, chosen.explain()
            assert chosen.kernel == "triton_fused"
            rank = plan(
                replace(GPT_OSS_120B, num_local_experts=64), num_tokens=t, device=H200, registry=REGISTRY
            )
            assert rank.source is ConfigSource.WHOLE_LAYER_ROW and rank.config == chosen.config, (
                rank.explain()
            )


def _table(tmp_path, rows, name="user.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"schema_version": 1, "rows": rows}))
    return path


BAD_TABLES = {
    "a_no_row": lambda spec, dev: [],
    "b_kernel_lacks_swiglu_oai": lambda spec, dev: [
        _row(spec, kernel="silu_gelu_only", config={}, device=dev)
    ],
    "c_kernel_reads_concat_only": lambda spec, dev: [_row(spec, kernel="concat_only", config={}, device=dev)],
    "d_kernel_does_not_exist": lambda spec, dev: [_row(spec, kernel="vllm_fused_moe", config={}, device=dev)],
    "e_config_invalid_for_kernel": lambda spec, dev: [
        _row(spec, kernel="torch_grouped", config={"block_m": 16}, device=dev)
    ],
    "f_malformed_file": None,
    # JSON types a hand-edited table gets wrong: reported like any bad row, never a crash, never used.
    "g_kernel_named_by_a_list": lambda spec, dev: [
        _row(spec, kernel=["silu_gelu_only"], config={}, device=dev)
    ],
    "h_has_bias_as_a_string": lambda spec, dev: [
        _spec_field(_row(spec, kernel="reference", config={}, device=dev), has_bias="no")
    ],
    "i_deeply_nested_file": None,
}


def _spec_field(row, **fields):
    row["spec"].update(fields)
    return row


def _write_case(tmp_path, case, spec, device_name):
    if case == "f_malformed_file":
        path = tmp_path / "user.json"
        path.write_text('{"schema_version": 1, "rows": [ {"device": ')  # truncated mid-write
        return path
    if case == "i_deeply_nested_file":
        path = tmp_path / "user.json"
        path.write_text("[" * 100_000 + "]" * 100_000)  # past json's recursion limit
        return path
    return _table(tmp_path, BAD_TABLES[case](spec, device_name))


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_gpt_oss_120b_bad_tables_resolve_to_capable_kernel(tmp_path, case):
    table = _write_case(tmp_path, case, GPT_OSS_120B, H200.name)
    result = plan(GPT_OSS_120B, num_tokens=1, device=H200, tuned=table, registry=REGISTRY)
    kernel = REGISTRY.get(result.kernel)
    assert kernel.supports(GPT_OSS_120B, moekit.kernels.base.Problem(1, H200)) is None
    assert result.kernel not in ("silu_gelu_only", "concat_only")
    assert result.source is ConfigSource.DEFAULT
    text = result.explain()
    # Both incapable kernels are refused with the reason a user needs.
    assert "silu_gelu_only: activation SWIGLU_OAI not in GELU/SILU" in text
    assert "concat_only: reads gate layout CONCAT, not INTERLEAVED" in text
    if case != "a_no_row":
        assert str(table) in text, text  # the bad row (or file) is named in explain
    expected_reason = {
        "b_kernel_lacks_swiglu_oai": "activation SWIGLU_OAI",
        "c_kernel_reads_concat_only": "gate layout CONCAT",
        "d_kernel_does_not_exist": "unknown kernel 'vllm_fused_moe'",
        "e_config_invalid_for_kernel": "unknown fields ['block_m']",
        "f_malformed_file": "unreadable table",
        "g_kernel_named_by_a_list": "kernel must be a non-empty string, got ['silu_gelu_only']",
        "h_has_bias_as_a_string": "spec.has_bias must be true or false, got 'no'",
        "i_deeply_nested_file": "unreadable table: JSON nested too deeply",
    }.get(case)
    if expected_reason:
        assert expected_reason in text
    with pytest.raises(PlanFallbackError, match="strict planning refused a fallback"):
        plan(GPT_OSS_120B, num_tokens=1, device=H200, tuned=table, registry=REGISTRY, strict=True)


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_bad_tables_keep_identical_numerics(tmp_path, case):
    spec = SMALL_120B
    layer = random_layer(spec, seed=3)
    x = random_tokens(spec, 7, seed=4)
    routing = moekit.route(x @ layer.router_weight.T, top_k=spec.K, spec=spec.routing)
    clean = plan(
        spec, num_tokens=7, device="cpu", tuned=_table(tmp_path, [], "empty.json"), registry=REGISTRY
    )
    expected = fused_moe(
        x, prepare_weights(layer.weights, clean, registry=REGISTRY), routing, plan=clean, registry=REGISTRY
    )
    reference = moekit.fused_moe_reference(x, layer.weights, routing, spec=spec)
    torch.testing.assert_close(expected, reference, rtol=2e-5, atol=2e-6)  # fp32: a capable kernel
    result = plan(
        spec, num_tokens=7, device="cpu", tuned=_write_case(tmp_path, case, spec, "cpu"), registry=REGISTRY
    )
    out = fused_moe(
        x, prepare_weights(layer.weights, result, registry=REGISTRY), routing, plan=result, registry=REGISTRY
    )
    assert result.kernel == clean.kernel
    assert torch.equal(out, expected)


def test_incapable_kernels_would_have_been_wrong():
    # Proof that the fakes are real hazards: forced onto the spec, they give different numbers.
    spec = SMALL_120B
    layer = random_layer(spec, seed=3)
    x = random_tokens(spec, 7, seed=4)
    routing = moekit.route(x @ layer.router_weight.T, top_k=spec.K, spec=spec.routing)
    reference = moekit.fused_moe_reference(x, layer.weights, routing, spec=spec)
    for kernel in (SiluGeluOnlyKernel(), ConcatOnlyKernel()):
        launch = moekit.kernels.base.Launch(
            spec=spec, config=TileConfig(), x=x, weights=layer.weights, routing=routing, expert_map=None
        )
        assert moekit.reference.relative_l2_error(kernel.run(launch), reference) > 0.05


def test_good_row_is_used_and_strict_accepts_it(tmp_path):
    table = _table(tmp_path, [_row(GPT_OSS_120B, kernel="reference", config={}, device=H200.name)])
    result = plan(GPT_OSS_120B, num_tokens=1, device=H200, tuned=table, registry=REGISTRY, strict=True)
    assert result.kernel == "reference" and result.source is ConfigSource.TUNED_ROW
    assert f"{table}#row 0" in result.explain()


def test_nearest_bucket_is_a_visible_fallback(tmp_path):
    table = _table(
        tmp_path,
        [
            _row(GPT_OSS_120B, kernel="reference", config={}, device=H200.name, tokens=8),
            _row(
                GPT_OSS_120B,
                kernel="torch_grouped",
                config={"use_grouped_mm": True},
                device=H200.name,
                tokens=128,
            ),
        ],
    )
    result = plan(GPT_OSS_120B, num_tokens=20, device=H200, tuned=table, registry=REGISTRY)
    assert result.bucket == 32 and result.kernel == "reference"  # log2 distance 2 beats 2 (tie: smaller)
    assert result.source is ConfigSource.NEAREST_BUCKET
    assert (
        plan(GPT_OSS_120B, num_tokens=100, device=H200, tuned=table, registry=REGISTRY).kernel
        == "torch_grouped"
    )
    with pytest.raises(PlanFallbackError, match="nearest token bucket"):
        plan(GPT_OSS_120B, num_tokens=20, device=H200, tuned=table, registry=REGISTRY, strict=True)


def test_nearest_row_of_another_tiling_regime_is_not_used(tmp_path):
    """A row speaks for the regime it was tuned in: DeepSeek-V3's FP8 row at T = 512 (16 tokens an expert,
    decode-like tiles) must not tile T = 1024 (32 an expert, where the kernel's own rule grows the M tile);
    within one regime (T = 4096 -> 8192, both prefill) the nearest row still refines the rule."""
    spec = moekit.preset("deepseek-v3")
    registry = default_registry()
    kernel = registry.get("triton_fused")
    decode_tile = {
        "block_m": 16,
        "block_n": 64,
        "block_k": 128,
        "group_m": 1,
        "num_warps": 4,
        "num_stages": 5,
    }
    prefill_tile = {
        "block_m": 64,
        "block_n": 64,
        "block_k": 128,
        "group_m": 4,
        "num_warps": 4,
        "num_stages": 4,
    }
    table = _table(
        tmp_path,
        [
            _row(spec, kernel="triton_fused", config=decode_tile, device=H200.name, tokens=512),
            _row(spec, kernel="triton_fused", config=prefill_tile, device=H200.name, tokens=4096),
        ],
    )
    at = {t: plan(spec, num_tokens=t, device=H200, tuned=table, registry=registry) for t in (300, 1024, 8192)}
    assert (
        at[300].source is ConfigSource.TUNED_ROW and at[300].config.as_dict()["num_stages"] == 5
    )  # bucket 512
    other = at[1024]
    assert other.source is ConfigSource.REGIME_DEFAULT, other.explain()
    assert other.config == kernel.default_config(spec, moekit.kernels.base.Problem(1024, H200))
    assert other.config.as_dict()["block_m"] > 16 and "#row 0" in other.explain()  # names the row it skipped
    assert at[8192].source is ConfigSource.NEAREST_BUCKET and at[8192].config.as_dict()["group_m"] == 4
    with pytest.raises(PlanFallbackError, match="another"):
        plan(spec, num_tokens=1024, device=H200, tuned=table, registry=registry, strict=True)


def test_row_for_a_kernel_refused_on_this_device_is_rejected_at_plan_time(tmp_path):
    # A row valid for the spec, but its kernel cannot run on this device (here: the CPU).
    spec = replace(SMALL_120B, activation=moekit.ActivationSpec(moekit.Activation.SILU))
    table = _table(
        tmp_path, [_row(spec, kernel="torch_grouped", config={"use_grouped_mm": False}, device="cpu")]
    )
    registry = default_registry().without("torch_grouped").with_kernels(CudaOnlyGroupedKernel())
    result = plan(spec, num_tokens=1, device="cpu", tuned=table, registry=registry)
    assert result.kernel == "reference" and result.source is ConfigSource.DEFAULT
    assert "kernel 'torch_grouped' cannot run here: runs on CUDA, not CPU" in result.explain()


def test_unsupported_spec_names_every_candidate_and_the_nearest_alternative():
    registry = moekit.kernels.registry.KernelRegistry([ConcatOnlyKernel(), SiluGeluOnlyKernel()])
    spec = replace(SMALL_120B, activation=moekit.ActivationSpec(moekit.Activation.GELU_TANH))
    with pytest.raises(UnsupportedSpecError) as info:
        plan(spec, num_tokens=1, device="cpu", registry=registry, tuned=None)
    message = str(info.value)
    assert "concat_only: reads gate layout CONCAT, not INTERLEAVED" in message
    assert "nearest supported alternative: convert w13 to CONCAT layout" in message
    assert "kernel concat_only supports it" in message
    with pytest.raises(UnsupportedSpecError, match="allow the reference kernel"):
        plan(
            SMALL_120B,
            num_tokens=1,
            device="cpu",
            registry=registry.without("concat_only"),
            allow_reference=False,
        )


def test_packing_mismatch_is_an_error_not_a_reinterpretation():
    spec = replace(SMALL_120B)
    layer = random_layer(spec, seed=0)
    x = random_tokens(spec, 3)
    routing = moekit.route(x @ layer.router_weight.T, top_k=spec.K, spec=spec.routing)
    result = plan(spec, num_tokens=3, device="cpu", registry=default_registry())
    assert result.kernel == "torch_grouped"
    with pytest.raises(moekit.LayoutMismatchError, match="prepare_weights"):
        fused_moe(x, layer.weights, routing, plan=result)
    prepared = prepare_weights(layer.weights, result)
    assert prepared.packing is WeightPacking.DEQUANTIZED
    with pytest.raises(moekit.LayoutMismatchError, match="CONCAT gate layout but the spec says INTERLEAVED"):
        fused_moe(x, prepared.to_layout(moekit.GateLayout.CONCAT), routing, plan=result)


def test_spec_is_checked_before_planning():
    with pytest.raises(moekit.SpecError):
        plan(MoESpec(num_experts=2, top_k=4, hidden_size=8, intermediate_size=8), num_tokens=1, device="cpu")


def test_an_expert_parallel_rank_plans_with_the_whole_layers_rows(tmp_path):
    """A rank's layer (an expert map) without rows of its own takes the whole layer's row for the same
    bucket, visibly; a row of its own wins; strict planning counts the borrowed row as a fallback."""
    local = replace(GPT_OSS_120B, num_local_experts=64)
    whole_row = _row(GPT_OSS_120B, kernel="reference", config={}, device=H200.name, tokens=64)
    table = _table(tmp_path, [whole_row])
    got = plan(local, num_tokens=64, device=H200, tuned=table, registry=REGISTRY)
    assert got.kernel == "reference" and got.source is ConfigSource.WHOLE_LAYER_ROW, got.explain()
    assert "whole layer" in got.explain()
    own_row = _row(
        local, kernel="torch_grouped", config={"use_grouped_mm": True}, device=H200.name, tokens=64
    )
    own = _table(tmp_path, [whole_row, own_row], name="own.json")
    mine = plan(local, num_tokens=64, device=H200, tuned=own, registry=REGISTRY)
    assert mine.kernel == "torch_grouped" and mine.source is ConfigSource.TUNED_ROW, mine.explain()
    with pytest.raises(PlanFallbackError, match="whole layer"):
        plan(local, num_tokens=64, device=H200, tuned=table, registry=REGISTRY, strict=True)
