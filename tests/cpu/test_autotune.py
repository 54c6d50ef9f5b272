"""The autotuner: isolated candidates, a verified winner, progress saved row by row, resumable runs."""

import json
from dataclasses import dataclass, replace

import pytest
import torch

import moekit
from fake_kernels import SiluGeluOnlyKernel, TileConfig
from moekit.app.autotune import tune
from moekit.kernels.base import Kernel, KernelConfig, Launch, Problem
from moekit.kernels.reference import ReferenceKernel
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.planning.plan import ConfigSource, plan
from moekit.reference import fused_moe_reference

SPEC = replace(
    moekit.preset("gpt-oss-20b"), num_experts=8, hidden_size=64, intermediate_size=96, act_dtype=torch.float32
)


def _timer_by_kernel(speeds):
    """A deterministic timer: runs the candidate once (so failures surface) and reports a fixed speed."""

    def timer(fn, device):
        fn()
        chosen = fn.__defaults__[0]
        return speeds[chosen.kernel] * (1 + 0.01 * getattr(chosen.config, "block_m", 16) / 16)

    return timer


@dataclass(frozen=True)
class FlakyConfig(KernelConfig):
    crash: bool = False


class FlakyKernel(ReferenceKernel):
    """Computes correctly, but one of its configs fails the way a Triton compile error would."""

    name = "flaky"
    priority = 1
    config_type = FlakyConfig

    def default_config(self, spec, problem):
        return FlakyConfig()

    def tuning_space(self, spec, problem):
        return (FlakyConfig(crash=True), FlakyConfig(crash=False))

    def run(self, launch: Launch):
        if launch.config.crash:
            raise RuntimeError("PassManager::run failed (simulated compile error)")
        return super().run(launch)


class FastButWrongKernel(SiluGeluOnlyKernel):
    """Claims every activation and is the fastest, but computes SILU: verification must reject it."""

    name = "fast_but_wrong"
    capabilities = ReferenceKernel.capabilities


def test_tune_writes_verified_rows_the_planner_uses(tmp_path):
    table = tmp_path / "tuned.json"
    registry = KernelRegistry([ReferenceKernel(), default_registry().get("torch_grouped")])
    outcomes = tune(
        SPEC,
        tokens=(1, 8),
        device="cpu",
        table=table,
        registry=registry,
        timer=_timer_by_kernel({"reference": 2.0, "torch_grouped": 1.0}),
    )
    assert [o.winner.kernel for o in outcomes] == ["torch_grouped", "torch_grouped"]
    assert all(o.rel_l2 <= 1e-4 for o in outcomes)
    rows = json.loads(table.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 8]
    result = plan(SPEC, num_tokens=8, device="cpu", tuned=table, registry=registry, strict=True)
    assert result.source is ConfigSource.TUNED_ROW and result.kernel == "torch_grouped"


def test_a_failing_candidate_is_skipped_and_recorded(tmp_path):
    registry = KernelRegistry([FlakyKernel()])
    (outcome,) = tune(
        SPEC,
        tokens=(4,),
        device="cpu",
        table=tmp_path / "t.json",
        registry=registry,
        timer=_timer_by_kernel({"flaky": 1.0}),
    )
    errors = [c for c in outcome.candidates if c.error]
    assert len(errors) == 1 and "simulated compile error" in errors[0].error
    assert outcome.winner.config == FlakyConfig(crash=False)


def test_a_fast_wrong_winner_is_rejected_by_verification(tmp_path):
    table = tmp_path / "t.json"
    registry = KernelRegistry([FastButWrongKernel(), ReferenceKernel()])
    (outcome,) = tune(
        SPEC,
        tokens=(4,),
        device="cpu",
        table=table,
        registry=registry,
        timer=_timer_by_kernel({"fast_but_wrong": 0.1, "reference": 5.0}),
    )
    assert outcome.winner.kernel == "reference"
    assert outcome.rejected_winners and "fast_but_wrong" in outcome.rejected_winners[0]
    assert json.loads(table.read_text())["rows"][0]["kernel"] == "reference"


def test_progress_is_saved_as_it_goes_and_a_rerun_resumes(tmp_path):
    table = tmp_path / "t.json"
    registry = KernelRegistry([ReferenceKernel()])
    calls = []

    def interrupting_timer(fn, device):
        calls.append(fn.__defaults__[0].num_tokens)
        if fn.__defaults__[0].num_tokens == 8:
            raise KeyboardInterrupt  # the user stops the run during the second T
        fn()
        return 1.0

    with pytest.raises(KeyboardInterrupt):
        tune(SPEC, tokens=(1, 8), device="cpu", table=table, registry=registry, timer=interrupting_timer)
    assert [r["tokens"] for r in json.loads(table.read_text())["rows"]] == [1]  # T=1 kept
    calls.clear()
    outcomes = tune(
        SPEC,
        tokens=(1, 8),
        device="cpu",
        table=table,
        registry=registry,
        timer=_timer_by_kernel({"reference": 1.0}),
    )
    assert outcomes[0].resumed and not outcomes[1].resumed
    assert [r["tokens"] for r in json.loads(table.read_text())["rows"]] == [1, 8]


def test_tuning_spaces_only_hold_valid_configs():
    from moekit.app.cli_spec import SIMULATED_DEVICES

    for kernel in default_registry():
        for name in ("gpt-oss-120b", "deepseek-v3", "qwen3-30b-a3b"):
            spec = moekit.preset(name)
            for t in (1, 64, 4096):
                space = kernel.tuning_space(spec, Problem(t, SIMULATED_DEVICES["h200"]))
                assert space and all(kernel.validate_config(c, spec) is None for c in space), (
                    kernel.name,
                    name,
                )


def test_fake_kernel_is_really_wrong():
    # Guard for the verification test: the fake must actually differ from the reference.
    from moekit.synthetic import random_layer, random_tokens

    layer = random_layer(SPEC, seed=0)
    x = random_tokens(SPEC, 4)
    routing = moekit.route(torch.randn(4, SPEC.E), top_k=SPEC.K, spec=SPEC.routing)
    launch = Launch(
        spec=SPEC, config=TileConfig(), x=x, weights=layer.weights, routing=routing, expert_map=None
    )
    ref = fused_moe_reference(x, layer.weights, routing, spec=SPEC)
    assert moekit.reference.relative_l2_error(FastButWrongKernel().run(launch), ref) > 1e-2
    assert isinstance(FastButWrongKernel(), Kernel)


def test_a_table_that_cannot_take_the_rows_is_refused_before_any_tuning(tmp_path):
    from moekit.errors import TunedTableError

    (tmp_path / "rows5.json").write_text(json.dumps({"schema_version": 1, "rows": [5]}))
    (tmp_path / "file").write_text("")

    def timer(fn, device):
        pytest.fail("a candidate was timed")

    registry = KernelRegistry([ReferenceKernel()])
    for table, message in (
        (tmp_path, "it is a directory"),
        (tmp_path / "rows5.json", r"not a moekit tuned table .*rows5.json#row 0: a row must be an object"),
        (tmp_path / "file" / "t.json", "cannot be written: creating it under"),
    ):
        with pytest.raises(TunedTableError, match=rf"tuned table .*: {message}"):
            tune(SPEC, tokens=(1,), device="cpu", table=table, registry=registry, timer=timer)
    assert json.loads((tmp_path / "rows5.json").read_text())["rows"] == [5]  # left as it was


def test_a_row_the_planner_rejects_is_tuned_again_not_resumed(tmp_path):
    table = tmp_path / "t.json"
    registry = KernelRegistry([ReferenceKernel()])
    tune(
        SPEC,
        tokens=(1,),
        device="cpu",
        table=table,
        registry=registry,
        timer=_timer_by_kernel({"reference": 1}),
    )
    data = json.loads(table.read_text())
    data["rows"][0]["config"] = {"no_such_field": 1}  # keyed, but its config is refused by the loader
    table.write_text(json.dumps(data))
    (outcome,) = tune(
        SPEC,
        tokens=(1,),
        device="cpu",
        table=table,
        registry=registry,
        timer=_timer_by_kernel({"reference": 1}),
    )
    assert not outcome.resumed and outcome.winner is not None
    assert json.loads(table.read_text())["rows"][0]["config"] != {"no_such_field": 1}
