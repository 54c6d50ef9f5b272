"""The command line as a new user meets it: help, the main job, explain, and errors as one clear line."""

import json
import subprocess
import sys

import pytest
import torch

from moekit.app.cli import main


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for command in ("run", "explain"):
        assert command in text


def test_main_job_runs_default_layer_and_self_checks():
    # The README's main job, in a fresh process, as a user runs it (gpt-oss-20b shapes on this CPU).
    proc = subprocess.run(
        [sys.executable, "-m", "moekit.app.cli", "run", "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["spec"].startswith("E=32 K=4 H=2880 I=2880 MXFP4")
    assert report["check_passed"] and report["check_rel_l2"] <= 1e-2
    assert report["num_tokens"] == 4 and report["seconds"] > 0


def test_explain_gpt_oss_120b_for_a_simulated_h200(capsys):
    assert main(["explain", "--preset", "gpt-oss-120b", "--tokens", "1", "--device", "h200"]) == 0
    text = capsys.readouterr().out
    assert "E=128 K=4 H=2880 I=2880 MXFP4" in text
    assert "chosen:" in text and "source:" in text and "refused candidates" in text


def test_explain_json_shows_refusals_on_cpu(capsys):
    assert main(["explain", "--preset", "gpt-oss-120b", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernel"] != "triton_fused"
    refused = {r["kernel"]: r["reason"] for r in data["refused"]}
    if "triton_fused" in refused:  # present wherever Triton imports
        assert "CUDA" in refused["triton_fused"]


def test_explain_spec_flags_override_the_preset(capsys):
    assert (
        main(
            [
                "explain",
                "--preset",
                "gpt-oss-20b",
                "--layout",
                "concat",
                "--activation",
                "silu",
                "--no-limit",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    assert "SILU no clamp CONCAT" in json.loads(capsys.readouterr().out)["spec"]


def test_errors_print_one_clear_line_on_stderr(capsys):
    # A spec flag out of range is a usage error (2); a strict plan that falls back fails the job (1).
    assert main(["explain", "--preset", "gpt-oss-20b", "--top-k", "64"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("moekit: SpecError: top_k K=64 cannot exceed num_experts E=32")
    assert main(["explain", "--preset", "gpt-oss-20b", "--device", "cpu", "--strict"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("moekit: PlanFallbackError: strict planning")


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert err.startswith("moekit: "), err
    return err


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", "--tokens", "-1"], "--tokens must be >= 1, got -1"),
        (["run", "--tokens", "0"], "--tokens must be >= 1, got 0"),  # was "self-check PASS on 0 tokens"
        (["run", "--tokens", "abc"], "argument --tokens: invalid int value: 'abc'"),
        (["run", "--device", "tpu"], "DeviceError: --device 'tpu' is not a device"),
        (["run", "--device", "cuda:banana"], "--device 'cuda:banana' is not a device"),
        (["run", "--device", "h200"], "only `moekit explain` can plan for"),
        pytest.param(["run", "--device", "cuda"], "no CUDA device here", marks=NO_CUDA),
        (["run", "--layer", "3"], "--layer 3 picks a layer of --checkpoint and would be ignored"),
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["run", "--checkpoint", "ckpt", "--preset", "mixtral-8x7b"],
            "--preset mixtral-8x7b picks random-weight shapes and would be ignored with --checkpoint",
        ),
        (["explain", "--limit", "3", "--no-limit"], "--limit 3 and --no-limit contradict each other"),
        (["check", "--all", "--preset", "mixtral-8x7b"], "--preset mixtral-8x7b checks one preset and would"),
        (["explain", "--tokens", "-2"], "--tokens must be >= 0, got -2"),
        (["explain", "--device", "tpu"], "or a simulated GPU"),
        pytest.param(["explain", "--device", "cuda:0"], "plan for a simulated GPU", marks=NO_CUDA),
        (["explain", "--experts", "2.5"], "argument --experts: invalid int value"),
        (
            ["explain", "--alpha", "nan"],
            "SpecError: ActivationSpec.alpha must be None or a finite number > 0",
        ),
        (["explain", "--table", "/no/such/table.json"], "--table /no/such/table.json: no such file"),
        (["check", "--tokens", "1,x"], "--tokens must be comma-separated counts >= 0"),
        (["check", "--max-experts", "0"], "--max-experts must be >= 1, got 0"),
        (["check", "--device", "tpu"], "is not a device"),
        (["tune", "--tokens", "0"], "--tokens must be comma-separated counts >= 1"),
        (["tune", "--max-experts", "-4"], "--max-experts must be >= 1"),
        pytest.param(["bench"], "needs a CUDA device", marks=NO_CUDA),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line_on_stderr_and_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and fragment in _one_error_line(err)


@pytest.mark.parametrize(
    "argv, kind",
    [
        (["run", "--tokens", "0", "--json"], "UsageError"),
        (["run", "--tokens", "abc", "--json"], "UsageError"),
        (["run", "--device", "tpu", "--json"], "DeviceError"),
        (["explain", "--top-k", "64", "--json"], "SpecError"),
        (["check", "--tokens", "-1", "--json"], "UsageError"),
    ],
)
def test_json_usage_errors_are_json_on_stdout(capsys, argv, kind):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]  # stdout holds JSON only
    assert error["type"] == kind and error["usage"] and error["exit_status"] == 2
    assert error["message"] in _one_error_line(err)


def test_json_errors_while_running_are_json_and_exit_1(capsys):
    assert main(["explain", "--device", "cpu", "--strict", "--json"]) == 1
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["type"] == "PlanFallbackError" and not error["usage"] and error["exit_status"] == 1
    assert "\n" not in error["message"] and "torch_grouped" in error["message"]
    _one_error_line(err)


def test_a_usage_error_in_a_fresh_process_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "moekit.app.cli", "run", "--tokens", "abc"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "invalid int value: 'abc'" in _one_error_line(proc.stderr)


def test_run_job_refuses_zero_tokens():
    from moekit.app.run import run_job
    from moekit.errors import ShapeError

    with pytest.raises(ShapeError, match=r"run_job\(num_tokens\) must be a positive int, got 0"):
        run_job(num_tokens=0, device="cpu")


def test_check_runs_every_capable_kernel_and_lists_refusals(capsys):
    assert (
        main(
            [
                "check",
                "--preset",
                "qwen3-30b-a3b",
                "--tokens",
                "0,3",
                "--max-experts",
                "4",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    records = json.loads(capsys.readouterr().out)
    ran = {(r["kernel"], r["tokens"]) for r in records if r["refused"] is None}
    assert {("reference", 3), ("torch_grouped", 3), ("torch_grouped", 0)} <= ran
    assert all(r["passed"] for r in records)
    assert all(r["rel_l2"] <= r["tolerance"] for r in records if r["refused"] is None and r["tokens"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA prints")
@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ("folder", "it is a directory; give a file path"),
        ("rows5.json", "not a moekit tuned table tune can merge into: "),
        ("not_a_folder/x.json", "cannot be written: creating it under"),
    ],
)
def test_tune_refuses_a_table_it_cannot_write_before_tuning(tmp_path, capsys, monkeypatch, table, fragment):
    import moekit.app.autotune

    (tmp_path / "folder").mkdir()
    (tmp_path / "rows5.json").write_text(json.dumps({"schema_version": 1, "rows": [5]}))
    (tmp_path / "not_a_folder").write_text("a file where a folder would have to be")
    monkeypatch.setattr(moekit.app.autotune, "_tune_one", lambda *a: pytest.fail("tuning ran"))
    argv = ["tune", "--preset", "mixtral-8x7b", "--max-experts", "4", "--tokens", "1", "--device", "cpu"]
    assert main([*argv, "--table", str(tmp_path / table)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"UsageError: --table {tmp_path / table}: {fragment}" in _one_error_line(err)
    assert "row 0: a row must be an object, got int" in err or table != "rows5.json"


def test_bench_needs_a_gpu_and_says_so(capsys):
    assert main(["bench", "--preset", "gpt-oss-20b", "--tokens", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_bench_plot_writes_a_png(tmp_path):
    from moekit.app.bench import BenchRecord, plot_records

    records = [
        BenchRecord(
            preset="p",
            kernel=k,
            config={},
            tokens=t,
            experts_hit=1,
            us=10.0 * t,
            weight_bytes=1,
            flops=1.0,
            roofline_us=5.0,
            pct_roofline=50.0,
            tb_per_s=1.0,
            tflops=1.0,
            rel_l2=1e-3,
            ok=True,
        )
        for k in ("a", "b")
        for t in (1, 2, 4)
    ]
    path = tmp_path / "bench.png"
    plot_records(records, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("naming", ["OPENAI", "HF"])
def test_run_a_checkpoint_layer(tmp_path, capsys, naming):
    # `moekit run --checkpoint DIR --layer N` on a small GPT-OSS-style file written by moekit's own writer.
    from dataclasses import replace

    import moekit
    from moekit.checkpoint import CheckpointNaming, GptOssLayer, save_gpt_oss_layer
    from moekit.synthetic import random_layer

    spec = replace(moekit.preset("gpt-oss-20b"), num_experts=8, hidden_size=64, intermediate_size=96)
    synthetic = random_layer(spec, seed=5)
    layer = GptOssLayer(
        weights=synthetic.weights,
        router_weight=synthetic.router_weight,
        router_bias=torch.randn(spec.E).to(spec.act_dtype),
        naming=CheckpointNaming[naming],
        layer=3,
    )
    save_gpt_oss_layer(tmp_path / "model.safetensors", layer, layer=3, naming=CheckpointNaming[naming])
    assert main(["run", "--checkpoint", str(tmp_path), "--layer", "3", "--tokens", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert f"layer 3 ({naming} naming)" in report["source"]
    assert report["spec"].startswith("E=8 K=4 H=64 I=96 MXFP4") and report["check_passed"]
    # A layer the checkpoint lacks is found while running: one clear line, exit 1, not a trace.
    assert main(["run", "--checkpoint", str(tmp_path), "--layer", "4"]) == 1
    assert "CheckpointError" in _one_error_line(capsys.readouterr().err)


def test_bench_records_a_failing_kernel_instead_of_dying():
    import math
    from dataclasses import replace

    import moekit
    from moekit.app.bench import Ceilings, baseline_spec, make_record
    from moekit.app.cli_spec import SIMULATED_DEVICES
    from moekit.planning.plan import plan

    ds = moekit.preset("deepseek-v3")
    assert baseline_spec(ds).act_quant is moekit.ActivationQuant.NONE  # W8A8 -> W8A16 for the baseline
    assert replace(baseline_spec(ds), act_quant=ds.act_quant) == ds
    chosen = plan(ds, num_tokens=1, device=SIMULATED_DEVICES["h200"])
    rec = make_record("deepseek-v3", ds, chosen, 1, 8, math.nan, math.inf, Ceilings(4e12, 7e14), error="OOM")
    assert not rec.ok and rec.error == "OOM" and math.isnan(rec.us)
    # W8A8 layers are held to the FP8 matmul rate when it was measured, the bf16 rate otherwise.
    assert Ceilings(4e12, 7e14, 1.4e15).matmul_rate(ds) == 1.4e15
    assert Ceilings(4e12, 7e14).matmul_rate(ds) == 7e14
    assert Ceilings(4e12, 7e14, 1.4e15).matmul_rate(moekit.preset("gpt-oss-120b")) == 7e14
    sustained = Ceilings(4e12, 7e14, 1.4e15, 6e14, 1.2e15)  # the rates under sustained load, if measured
    assert sustained.matmul_rate(ds, sustained=True) == 1.2e15
    assert sustained.matmul_rate(moekit.preset("gpt-oss-120b"), sustained=True) == 6e14
    assert Ceilings(4e12, 7e14).matmul_rate(ds, sustained=True) is None
    assert sustained.summary() == (
        "copy 4.00 TB/s, bf16 700 TFLOP/s (600 TFLOP/s sustained), FP8 1400 TFLOP/s (1200 TFLOP/s sustained)"
    )
    assert "FP8 not measured (not measured sustained)" in Ceilings(4e12, 7e14).summary()
