"""`moekit explain --ep N / --tp N`: a layer planned for N ranks on paper, as text and JSON; bad N refused.

Every figure is a model: the text says so and names the constants' source. Per-rank shares come from the
layer's own sharding rules (E/N with the uneven split, I/N on block boundaries), so a refused N is the
same refusal `FusedMoE(parallel=...)` gives, printed as one line with exit status 2.
"""

import json

import pytest

from moekit.app.cli import main
from moekit.app.explain_parallel import DEFAULT_RANK_TOKENS, meta_weights, weight_bytes
from moekit.ep.constants import load_collectives
from moekit.ep.cost import predict_us
from moekit.ep.engines import EpEngine
from moekit.presets import preset


def _json(capsys, *argv) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("world", [2, 8, 64])
def test_ep_json_per_rank_experts_bytes_and_model(capsys, world):
    data = _json(capsys, "--preset", "deepseek-v3", "--ep", str(world))
    assert data["mode"] == "expert" and data["world_size"] == world and data["model_not_measurement"]
    assert data["constants_source"]["description"] == load_collectives().source.description
    shares = data["per_rank"]
    assert sum((s["last"] - s["first"] + 1) * s["experts"] for s in shares) == 256  # every expert once
    full = data["one_rank_weight_bytes"]
    assert full == weight_bytes(meta_weights(preset("deepseek-v3")))
    assert all(s["weight_bytes"] == pytest.approx(full * s["experts"] / 256) for s in shares)
    assert [row["tokens_per_rank"] for row in data["tokens"]] == list(DEFAULT_RANK_TOKENS)
    table = load_collectives()
    for row in data["tokens"]:
        engines = {e["engine"]: e for e in row["engines"]}
        assert set(engines) == {e.value for e in EpEngine}
        for engine in EpEngine:
            us = predict_us(
                engine, tokens_per_rank=row["tokens_per_rank"], H=7168, K=8, E=256, world=world,
                act_bytes=2, constants=table, static=False,
            )  # fmt: skip
            assert engines[engine.value]["predicted_us"] == pytest.approx(us)
        assert row["model_pick"] == min(engines.values(), key=lambda e: e["predicted_us"])["engine"]


def test_ep_uneven_split_text(capsys):
    # E=8 over 3 ranks: ranks 0-1 hold 3 experts, rank 2 holds 2 (moekit.ep.ownership).
    assert main(["explain", "--preset", "mixtral-8x7b", "--ep", "3", "--rank-tokens", "1,4096"]) == 0
    text = capsys.readouterr().out
    assert "ranks 0-1:" in text and "E_local=3" in text and "rank 2:" in text and "E_local=2" in text
    assert "(0.375 of 1 rank)" in text and "(0.250 of 1 rank)" in text
    assert "model, not a measurement" in text and load_collectives().source.description in text
    assert "N=3 is an extrapolation" in text
    assert "all_to_all[counts (host sync)]" in text  # the count exchange is in the model
    assert "   4096 " in text and "  16384 " not in text


@pytest.mark.parametrize("world", [2, 8, 64])
def test_tp_json_one_allreduce_and_i_over_n(capsys, world):
    data = _json(capsys, "--preset", "qwen3-30b-a3b", "--tp", str(world), "--intermediate", str(64 * world))
    (share,) = data["per_rank"]
    assert (
        share["intermediate"] == 64
        and share["experts"] == 128
        and (share["first"], share["last"])
        == (
            0,
            world - 1,
        )
    )
    assert share["fraction_of_one_rank"] == pytest.approx(1 / world)
    for row in data["tokens"]:
        (engine,) = row["engines"]
        (call,) = engine["calls"]
        assert call["kind"] == "all_reduce"
        assert call["bytes"] == pytest.approx(2 * (world - 1) / world * row["tokens_per_rank"] * 2048 * 2)


def test_tp_text(capsys):
    assert main(["explain", "--preset", "gpt-oss-120b", "--tp", "2", "--rank-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert "I=1440" in text and "(0.500 of 1 rank)" in text and "tensor_allreduce" in text
    assert "model, not a measurement" in text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--ep", "0"], "--ep must be >= 2 ranks, got 0"),
        (["--ep", "-1"], "--ep must be >= 2 ranks, got -1"),
        (["--tp", "1"], "--tp must be >= 2 ranks, got 1"),
        (["--ep", "1.5"], "argument --ep: invalid int value: '1.5'"),
        (["--ep", "129"], "--ep 129: expert parallelism needs at least one expert per rank"),
        (["--ep", "2", "--tp", "2"], "one parallel mode at a time"),
        (["--ep", "2", "--rank-tokens", "0,8"], "--rank-tokens must be"),
        (["--rank-tokens", "8"], "add --ep N or --tp N"),
        (["--ep", "2", "--constants", "/no/such.json"], "cannot read"),
        # gpt-oss-120b: I=2880, I/8 = 360 is not a multiple of MXFP4's 32-element blocks.
        (["--tp", "8"], "I/N = 2880/8 must be a multiple of 32"),
        # Flags of a plan for one device would be silently dropped by a plan for N ranks.
        (["--ep", "2", "--tokens", "8"], "--tokens would be ignored with --ep 2: they plan one device"),
        (["--tp", "2", "--device", "h200", "--strict"], "--device, --strict would be ignored with --tp 2"),
        (["--ep", "2", "--table", "t.json"], "--table would be ignored with --ep 2"),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_n_is_one_line_exit_2(capsys, argv, needle, as_json):
    assert main(["explain", "--preset", "gpt-oss-120b", *argv, *(["--json"] if as_json else [])]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("moekit: ") and needle in line
    if as_json:
        error = json.loads(captured.out)["error"]
        assert error["exit_status"] == 2 and needle in error["message"]
    else:
        assert captured.out == ""


def test_tp_refusal_names_the_fix(capsys):
    assert main(["explain", "--preset", "gpt-oss-120b", "--tp", "64"]) == 2
    line = capsys.readouterr().err.strip()
    assert "UnsupportedSpecError" in line and "use a group of N in" in line and "expert parallelism" in line


def test_constants_from_a_file(capsys, tmp_path):
    from moekit.ep.constants import collectives_as_dict

    data = collectives_as_dict(load_collectives())
    data["source"]["description"] = "my own run"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert main(["explain", "--ep", "2", "--constants", str(path), "--rank-tokens", "1"]) == 0
    assert "constants from my own run" in capsys.readouterr().out
