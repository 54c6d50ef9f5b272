"""`moekit bench --parallel ep|tp` under torchrun with 2 gloo ranks on this CPU (a tiny spec, seconds each).

Data flow: torchrun -m moekit.app.cli bench --parallel ... --device cpu --json PATH -> every rank builds the
same random layer, parallel and 1-rank -> rank 0 prints the table and writes the records -> the test reads
them: times > 0, the per-GPU ratio is their quotient, and the parallel output matches the 1-rank layer
on the global batch within the reference tolerance. Flag refusals need no ranks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moekit.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--preset", "qwen3-30b-a3b", "--experts", "8", "--hidden", "64", "--intermediate", "64"]


def _torchrun(tmp_path, *argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "records.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "moekit.app.cli", "bench", *argv, "--device", "cpu", "--tokens", "1,16", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.parametrize(
    ("argv", "engine"),
    [
        (["--parallel", "ep", "--engine", "all_to_all", *TINY], "all_to_all"),
        (["--parallel", "tp", *TINY], "tensor_allreduce"),
    ],
)
def test_bench_parallel_on_two_gloo_ranks(tmp_path, argv, engine):
    stdout, data = _torchrun(tmp_path, *argv)
    assert "E=8 K=8 H=64 I=64" in data["spec"] and "model, not a measurement" in stdout
    records = data["records"]
    assert [r["tokens_per_rank"] for r in records] == [1, 16]
    for r in records:
        assert r["engine"] == engine and r["world_size"] == 2 and r["ok"]
        assert r["parallel_us"] > 0 and r["one_rank_us"] > 0 and r["model_comm_us"] > 0
        ratio = r["one_rank_us"] / r["parallel_us"] / (2 if engine == "tensor_allreduce" else 1)
        assert r["per_gpu_ratio"] == pytest.approx(ratio)
        assert r["rel_l2"] <= r["tolerance"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--engine", "all_to_all"], "only for --parallel"),
        (["--parallel", "ep"], "torchrun --nproc-per-node N"),
        (["--parallel", "tp", "--engine", "all_to_all"], None),  # refused under torchrun; see below
    ],
)
def test_bench_parallel_flag_refusals(capsys, monkeypatch, argv, needle):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if needle is None:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        needle = "tensor parallelism moves no tokens"
    assert main(["bench", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert needle in line


def test_bench_parallel_refuses_plot_which_it_would_ignore(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["bench", "--parallel", "ep", "--plot", "p.png"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--plot p.png draws the single-GPU sweep and would be ignored with --parallel" in line
