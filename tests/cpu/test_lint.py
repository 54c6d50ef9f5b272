"""The code base stays ruff-clean (style rule of the guide, §4)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    # `python -m ruff`: the test extra installs ruff into this interpreter, whatever PATH says.
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks", "tools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
