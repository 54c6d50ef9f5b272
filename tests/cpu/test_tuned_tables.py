"""Tuned tables: per-row validation, precedence of sources, atomic writes under a crash-safe lock."""

import json
import multiprocessing
import os
import signal
import time
from dataclasses import replace

import filelock
import pytest

import moekit
from fake_kernels import SiluGeluOnlyKernel
from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.planning.plan import ConfigSource, plan
from moekit.planning.tuned import ENV_VAR, load_tables, row_to_json, token_bucket, triton_version, write_rows

REGISTRY = default_registry().with_kernels(SiluGeluOnlyKernel())
SPEC = replace(moekit.preset("gpt-oss-20b"), num_experts=4, hidden_size=64, intermediate_size=32)
CONFIG = default_registry().get("torch_grouped").default_config(SPEC, Problem(1, DeviceInfo.of("cpu")))


def _row(tokens=1, kernel="torch_grouped", config=None, spec=SPEC, device="cpu"):
    row = row_to_json(
        spec=spec, device=device, triton=triton_version(), tokens=tokens, kernel=kernel, config=CONFIG
    )
    if config is not None:
        row["config"] = config
    return row


def _write(path, rows):
    path.write_text(json.dumps({"schema_version": 1, "rows": rows}))
    return path


def test_token_buckets():
    assert [token_bucket(t) for t in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1,
        1,
        2,
        4,
        4,
        8,
        1024,
        1024,
        2048,
    ]


def test_each_bad_row_is_reported_once_by_name_and_the_rest_loads(tmp_path):
    missing_field = _row(tokens=2)
    del missing_field["kernel"]
    bad_spec = _row(tokens=4)
    bad_spec["spec"]["activation"] = "relu"
    rows = [
        _row(tokens=1),  # good
        _row(tokens=8, kernel="no_such_kernel"),
        _row(tokens=16, config={"use_grouped_mm": "yes"}),  # wrong type
        _row(tokens=32, config={"block_m": 64}),  # a field another kernel has
        _row(tokens=64, kernel="silu_gelu_only", config={}),  # cannot compute SWIGLU_OAI
        missing_field,
        bad_spec,
        "not a row",
        _row(tokens=128),
        _row(tokens=128),  # duplicate key: ambiguous, neither used
        _row(tokens=256),  # good
    ]
    tables = load_tables([_write(tmp_path / "t.json", rows)], registry=REGISTRY)
    assert sorted(k.bucket for k in tables.rows) == [1, 256]
    origins = [r.origin.rsplit("#", 1)[1] for r in tables.rejected]
    assert origins == ["row 1", "row 2", "row 3", "row 4", "row 5", "row 6", "row 7", "row 8", "row 9"]
    reasons = " | ".join(r.reason for r in tables.rejected)
    for fragment in (
        "unknown kernel 'no_such_kernel'",
        "use_grouped_mm must be a bool",
        "unknown fields ['block_m']",
        "activation SWIGLU_OAI not in GELU/SILU",
        "missing fields ['kernel']",
        "spec.activation must be one of",
        "a row must be an object",
        "duplicate key",
    ):
        assert fragment in reasons


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "unreadable table"),
        (json.dumps({"schema_version": 99, "rows": []}), "schema_version=99"),
        (json.dumps([1, 2]), "the top level is a list"),
    ],
)
def test_malformed_files_are_reported_and_other_tables_still_load(tmp_path, text, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    good = _write(tmp_path / "good.json", [_row()])
    tables = load_tables([bad, good], registry=REGISTRY)
    assert len(tables.rows) == 1
    assert len(tables.rejected) == 1 and fragment in tables.rejected[0].reason
    assert tables.rejected[0].origin == str(bad)


def test_precedence_shipped_then_env_then_argument(tmp_path, monkeypatch):
    env_table = _write(
        tmp_path / "env.json",
        [_row(tokens=1, config={"use_grouped_mm": True}), _row(tokens=2, config={"use_grouped_mm": True})],
    )
    arg_table = _write(tmp_path / "arg.json", [_row(tokens=1, kernel="reference", config={})])
    monkeypatch.setenv(ENV_VAR, str(env_table))
    p1 = plan(SPEC, num_tokens=1, device="cpu", tuned=arg_table)
    p2 = plan(SPEC, num_tokens=2, device="cpu", tuned=arg_table)
    assert (p1.kernel, p1.row_origin) == ("reference", f"{arg_table}#row 0")  # argument overrides env
    assert (p2.kernel, p2.config.use_grouped_mm) == ("torch_grouped", True)  # env row still merges in
    assert p1.table_sources[-2:] == (str(env_table), str(arg_table))
    assert p1.table_sources[0].endswith("h200.json")  # shipped first, lowest precedence
    text = p1.explain()
    assert "lowest precedence first" in text and str(env_table) in text


def test_stale_triton_version_rows_do_not_match(tmp_path):
    row = _row(tokens=1, kernel="reference", config={})
    row["triton"] = "0.0.1"
    result = plan(SPEC, num_tokens=1, device="cpu", tuned=_write(tmp_path / "t.json", [row]))
    assert result.source is ConfigSource.DEFAULT


def test_write_rows_merges_and_replaces(tmp_path):
    path = tmp_path / "sub" / "table.json"
    write_rows(path, [_row(tokens=1), _row(tokens=2)])
    write_rows(path, [_row(tokens=2, kernel="reference", config={})])
    rows = json.loads(path.read_text())["rows"]
    assert [(r["tokens"], r["kernel"]) for r in rows] == [(1, "torch_grouped"), (2, "reference")]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def _writer(path, worker, count):
    for i in range(count):  # a token bucket of its own per write: each row adds one, none replaces
        write_rows(path, [_row(tokens=2 ** (worker * count + i))])


def test_concurrent_writers_never_expose_a_half_written_table(tmp_path):
    path = tmp_path / "table.json"
    write_rows(path, [])
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w, 15)) for w in range(3)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):
        data = json.loads(path.read_text())  # must always parse: readers see whole tables only
        assert data["schema_version"] == 1
        reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reads > 0
    assert len(json.loads(path.read_text())["rows"]) == 45  # no lost update under the lock


def _hold_lock_forever(path):
    lock = filelock.FileLock(str(path) + ".lock")
    lock.acquire()
    time.sleep(600)


def test_a_crashed_writer_leaves_no_lock_behind(tmp_path):
    path = tmp_path / "table.json"
    ctx = multiprocessing.get_context("fork")
    holder = ctx.Process(target=_hold_lock_forever, args=(path,))
    holder.start()
    deadline = time.time() + 10
    while not os.path.exists(str(path) + ".lock") and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    with pytest.raises(filelock.Timeout):
        write_rows(path, [_row()], lock_timeout_s=0.3)  # held by a live process
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    write_rows(path, [_row()], lock_timeout_s=5)  # the OS released the dead process's lock
    assert len(json.loads(path.read_text())["rows"]) == 1


def test_register_caps_round_trip_and_rows_without_them_still_load(tmp_path):
    """`max_registers` and `split_k` came after the first tables: rows written without them read as
    their defaults (no cap, one share)."""
    from moekit.app.cli_spec import SIMULATED_DEVICES
    from moekit.kernels.triton.config import TritonMoEConfig

    h200 = SIMULATED_DEVICES["h200"]
    mx = replace(moekit.preset("gpt-oss-20b"), num_experts=4)
    capped = TritonMoEConfig(block_m=16, block_n=64, block_k=128, max_registers=96, split_k=3)
    rows = [
        row_to_json(
            spec=mx, device=h200.name, triton=triton_version(), tokens=t, kernel="triton_fused", config=c
        )
        for t, c in ((1, capped), (64, TritonMoEConfig(block_m=32)))
    ]
    del rows[1]["config"]["max_registers"]  # as a table from before the field
    del rows[1]["config"]["split_k"]  # likewise (split_k came after max_registers)
    path = _write(tmp_path / "t.json", rows)
    for t, want in ((1, capped), (64, TritonMoEConfig(block_m=32))):
        result = plan(mx, num_tokens=t, device=h200, tuned=path)
        assert result.source is ConfigSource.TUNED_ROW and result.kernel == "triton_fused"
        assert result.config == want


def test_an_eight_warp_row_for_the_mxfp4_word_path_is_rejected_with_the_reason(tmp_path):
    """Tables written before the word path refused 8 warps: the row is rejected at load, and the plan
    falls back to the kernel default rather than run a config nobody has verified."""
    from moekit.app.cli_spec import SIMULATED_DEVICES
    from moekit.kernels.triton.config import TritonMoEConfig

    h200 = SIMULATED_DEVICES["h200"]
    mx = replace(moekit.preset("gpt-oss-20b"), num_experts=4)
    eight = TritonMoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8)
    row = row_to_json(
        spec=mx, device=h200.name, triton=triton_version(), tokens=64, kernel="triton_fused", config=eight
    )
    path = _write(tmp_path / "t.json", [row])
    tables = load_tables([path], registry=default_registry())
    assert not tables.rows and "num_warps=4" in tables.rejected[0].reason
    result = plan(mx, num_tokens=64, device=h200, tuned=path)
    assert result.kernel == "triton_fused" and result.source is ConfigSource.DEFAULT
    kernel = default_registry().get("triton_fused")
    assert result.config == kernel.default_config(mx, Problem(num_tokens=64, device=h200)) != eight
