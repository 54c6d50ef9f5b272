"""The code base stays ruff-clean (style rule of the guide, §4)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is a test dependency (pip install -e '.[test]') and must be on PATH")
    proc = subprocess.run([ruff, "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
