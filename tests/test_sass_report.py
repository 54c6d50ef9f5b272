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

ROOT = Path(__file__).resolve().parents[1]


def _report(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import sass_report as s; "
        f"print(json.dumps(s.loop_report(s.compile_gemm({', '.join(args)}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mxfp4_words_feed_wgmma_from_registers_without_spills():
    report = _report("2", "'words'", "(16, 64, 64)", "4", "4")
    ops = dict(report["opcodes"])
    assert report["local_bytes"] == 0, report  # no spills
    assert ops.get("HGMMA.64x16x16.F32.BF16") == 4  # one wgmma per 16-column chunk, weights in registers
    assert ops.get("LDS.128") == 1 and "LDS.U8" not in ops  # one 16-byte fragment load per thread
    assert ops.get("HMUL2.BF16_V2") == 16  # the scale: one bf16x2 multiply per decoded pair
    assert ops.get("PRMT", 0) <= 6  # no byte shuffling of weights: the few left extract scale bytes
    assert report["loop_instructions"] <= 175, report  # 167 since the bit placement of session 4 (was 179)
