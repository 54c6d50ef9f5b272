"""Offline compiles for sm_90 from CPU tests: a script run in a subprocess, compiled for the GPU target."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiled_json(args: list[str], *, timeout: int = 900):
    """Run `python args` from the repository root, compiled (no TRITON_INTERPRET: conftest sets it for the
    test process, and interpreted kernels cannot be compiled) with src and tools importable, and return
    the JSON of its last output line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tools"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
