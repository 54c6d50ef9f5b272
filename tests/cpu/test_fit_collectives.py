"""The cost model's constants: the shipped table, malformed tables refused by field, the fitting tool.

Data flow: the shipped JSON -> `load_collectives` -> `predict_us(..., constants=...)`; hand-broken copies
-> `CollectiveTableError` naming the field; `benchmarks/fit_collectives.py` under torchrun with 2 gloo
ranks on this CPU (sizes up to 1 MB, about 10 s) -> a table the loader accepts.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moekit.ep.constants import (
    Collective,
    CollectiveTable,
    CollectiveTableError,
    collectives_as_dict,
    load_collectives,
    parse_collectives,
)
from moekit.ep.cost import LOCAL_COPY_GBPS, bytes_moved, engine_calls, local_copy_bytes, predict_us
from moekit.ep.engines import AllGatherReduceScatter, EpEngine
from moekit.errors import ArgumentError, MoekitError

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(tokens_per_rank=64, H=2880, K=4, E=128, world=2, act_bytes=2)


def test_shipped_table_loads_with_its_source():
    table = load_collectives()
    assert set(table.constants) == set(Collective)
    assert "fit_collectives.py" in table.source.description and table.world_size == 2  # measured, not quoted
    for kind in Collective:  # the fit agrees with the largest measured size it was fitted from
        constants = table.of(kind)
        largest = max(constants.samples, key=lambda sample: sample.bytes)
        assert 0.8 <= largest.bus_bandwidth_GBps / constants.bus_bandwidth_GBps <= 1.25, kind
        assert 1 <= constants.latency_us <= 1000, kind
    assert parse_collectives(collectives_as_dict(table)) == table  # the written format reads back


def test_predict_us_per_collective_constants():
    table = load_collectives()
    for engine in EpEngine:
        calls = engine_calls(engine, **SHAPE)
        expected = sum(
            table.of(c.kind).latency_us + c.bytes_sent / (table.of(c.kind).bus_bandwidth_GBps * 1e3)
            for c in calls
        ) + local_copy_bytes(engine, **SHAPE) / (LOCAL_COPY_GBPS * 1e3)
        assert predict_us(engine, constants=table, **SHAPE) == pytest.approx(expected)
        assert sum(c.bytes_sent for c in calls) == bytes_moved(engine, **SHAPE)
    # The all-to-all engine exchanges counts first: four calls, four latencies.
    assert [c.what for c in engine_calls(EpEngine.ALL_TO_ALL, **SHAPE)][0].startswith("counts")
    # Keywords still work and equal a uniform table.
    uniform = CollectiveTable.uniform(latency_us=70.0, bandwidth_GBps=200.0)
    assert predict_us(AllGatherReduceScatter(), latency_us=70.0, bandwidth_GBps=200.0, **SHAPE) == predict_us(
        AllGatherReduceScatter(), constants=uniform, **SHAPE
    )
    # Not static: the layer's all-reduce of T is one more call.
    assert (
        len(engine_calls(EpEngine.ALLGATHER_REDUCESCATTER, static=False, **SHAPE)) == 3
    )  # max T, packed x + routing, outputs


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(latency_us=70.0), dict(latency_us=70.0, bandwidth_GBps=1.0, constants="table")]
)
def test_predict_us_refuses_a_mix(kwargs):
    if kwargs.get("constants") == "table":
        kwargs["constants"] = load_collectives()
    with pytest.raises(ArgumentError, match="constants"):
        predict_us(EpEngine.ALL_TO_ALL, **SHAPE, **kwargs)


def _broken(edit):
    data = collectives_as_dict(load_collectives())
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(format="v0"), "format"),
        (lambda d: d.update(world_size=1), "world_size"),
        (lambda d: d["source"].pop("description"), "source.description"),
        (lambda d: d["collectives"].pop("all_reduce"), "collectives"),
        (lambda d: d["collectives"].update(broadcast={}), "collectives"),
        (lambda d: d["collectives"]["all_to_all"].update(latency_us=-1), "collectives.all_to_all.latency_us"),
        (
            lambda d: d["collectives"]["all_gather"].update(bus_bandwidth_GBps="fast"),
            "all_gather.bus_bandwidth",
        ),
        (lambda d: d["collectives"]["all_to_all"]["samples"][0].update(bytes=0), "samples[0].bytes"),
    ],
)
def test_malformed_tables_name_the_field_and_the_fix(edit, field):
    with pytest.raises(CollectiveTableError) as info:
        parse_collectives(_broken(edit), origin="t.json")
    assert isinstance(info.value, MoekitError) and field in str(info.value)
    assert "t.json" in str(info.value) and "fit_collectives.py" in str(info.value)


def test_unreadable_table(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CollectiveTableError, match="not JSON"):
        load_collectives(tmp_path / "bad.json")
    with pytest.raises(CollectiveTableError, match="cannot read"):
        load_collectives(tmp_path / "missing.json")
    assert copy.deepcopy(load_collectives()) == load_collectives()


def test_fit_collectives_under_torchrun_on_gloo(tmp_path):
    out = tmp_path / "collectives.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "benchmarks" / "fit_collectives.py"),
            "--backend", "gloo", "--device", "cpu", "--max-bytes", "1MB", "--factor", "8", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = load_collectives(out)
    assert table.world_size == 2 and table.source.backend == "gloo" and "torchrun" in table.source.command
    for kind in Collective:
        c = table.of(kind)
        assert c.latency_us > 0 and c.bus_bandwidth_GBps > 0 and len(c.samples) == 4  # 8K, 64K, 512K, 1M
        assert f"fit {kind.value}" in proc.stdout
    assert json.loads(out.read_text())["format"] == "moekit-collectives/1"
