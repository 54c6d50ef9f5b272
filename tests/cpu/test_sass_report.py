"""Offline Hopper code checks: the MXFP4 GEMMs compiled for sm_90 on this CPU (no GPU needed).

Runs `benchmarks/sass_report.py` in a subprocess without TRITON_INTERPRET (conftest sets it for this
process, and interpreted kernels cannot be compiled). Asserts what the H200 speed of the MXFP4 path
rests on, so a change that breaks it fails here before any device time is spent.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _compiled_json(args: list[str], *, timeout: int = 600):
    """Run `python args` from the repository root, compiled (no TRITON_INTERPRET) with src and
    benchmarks importable, and return the JSON of its last output line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(*args: str) -> dict:
    code = (
        f"import json, sass_report as s; print(json.dumps(s.loop_report(s.compile_gemm({', '.join(args)}))))"
    )
    return _compiled_json(["-c", code])


def test_mxfp4_words_feed_wgmma_from_registers_without_spills():
    report = _report("2", "'words'", "(16, 64, 64)", "4", "4")
    ops = dict(report["opcodes"])
    assert report["local_bytes"] == 0, report  # no spills
    assert ops.get("HGMMA.64x16x16.F32.BF16") == 4  # one wgmma per 16-column chunk, weights in registers
    assert ops.get("LDS.128") == 1 and "LDS.U8" not in ops  # one 16-byte fragment load per thread
    assert ops.get("HMUL2.BF16_V2") == 16  # the scale: one bf16x2 multiply per decoded pair
    assert ops.get("SHF.L.W.U32.HI") == 16  # the placement: four rotations a word (PAIR_ROTATIONS)
    assert ops.get("PRMT", 0) <= 6  # no byte shuffling of weights: the few left extract scale bytes
    assert report["loop_instructions"] <= 155, report  # 146 measured (179 with nibbles; RESULTS.md, s8)


def test_no_shipped_word_config_overwrites_registers_an_mma_still_reads():
    """Every MXFP4 word-path tile of the shipped H200 table, both GEMMs: `wgmma_hazard.py` finds no write
    to an A register of a wgmma that may still be in flight (Triton 3.6's pipelined waits allowed that;
    `_jit._wait_for_mma` completes each K-step's MMAs first — wrong results on the H200 without it,
    benchmarks/RESULTS.md session 5)."""
    code = """
import json
import sass_report, wgmma_hazard
rows = json.load(open('src/moekit/tables/h200.json'))['rows']
tiles = set()
for row in rows:
    c = row['config']
    if row['spec']['weight_format'] == 'mxfp4' and row['kernel'] == 'triton_fused':
        split = c.get('split_k') or 1
        tail = c.get('tail_block_m')  # then both launches, block_m and tail, read block-start lists
        n2 = c['gemm2_block_n'] or c['block_n']
        for m in (c['block_m'], tail) if tail else (c['block_m'],):
            tiles.add((1, m, c['block_n'], c['block_k'], c['num_warps'], c['num_stages'], split, bool(tail)))
            tiles.add((2, m, n2, c['block_k'], c['num_warps'], c['num_stages'], split, bool(tail)))
out = []
for g, m, n, k, w, s, split, starts in sorted(tiles):
    kernel = sass_report.compile_gemm(g, 'words', (m, n, k), w, s, split, block_starts=starts)
    r = wgmma_hazard.simulate(kernel)
    out.append([g, m, n, k, w, s, split, starts, r['wait_depths'], len(r['writes'])])
print(json.dumps(out))
"""
    tiles = _compiled_json(["-c", code], timeout=900)
    assert len(tiles) >= 6, tiles  # the table covers gpt-oss-20b and -120b from 1 to 16384 tokens
    unsafe = [t for t in tiles if t[-1] != 0]
    fields = "(gemm, block_m, block_n, block_k, warps, stages, split_k, block starts, wait depths, writes)"
    assert not unsafe, f"{fields}: {unsafe}"


def test_hazard_simulation_finds_the_writes_without_the_wait(tmp_path):
    """The control for the test above: with `_jit._wait_for_mma` replaced by a no-op, Triton 3.6's own
    waits leave MMAs in flight while the next K-step decodes into their A registers, and the
    simulation must list those writes (18 for this tile when written)."""
    script = tmp_path / "no_wait.py"  # @triton.jit needs its source in a file
    script.write_text(
        """
import json
import triton
import sass_report, wgmma_hazard
from moekit.kernels.triton._details import gemm as _jit

@triton.jit
def _no_wait(acc):
    return acc

_jit._wait_for_mma = _no_wait
r = wgmma_hazard.simulate(sass_report.compile_gemm(1, "words", (128, 64, 64), 4, 4))
print(json.dumps([r["wait_depths"], len(r["writes"])]))
"""
    )
    depths, writes = _compiled_json([str(script)])
    assert max(depths) > 0 and writes > 0, (depths, writes)
