"""tests/interpret/ on a CUDA machine: the Triton interpreter tests, run in a child pytest with CUDA hidden.

Data flow: this process compiles real kernels, and TRITON_INTERPRET is read when Triton is imported, so
the interpreter cannot run here -> `python -m pytest tests/interpret -m "not gpu"` with
CUDA_VISIBLE_DEVICES="" (tests/conftest.py then sets TRITON_INTERPRET=1 before Triton is imported, as on a
CPU machine) -> its JUnit report: every selected test passed, none skipped; its closing summary is
attached to this test's report and printed at the end of this session (tests/conftest.py).
Tests of tests/interpret/ marked `gpu` need CUDA and run in this process instead.
On a machine without CUDA the interpreter tests run in the main session itself, so this test skips there.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)
def test_interpreter_tests_pass_in_a_child_process_without_cuda(tmp_path, record_property):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here: tests/interpret/ runs in this pytest session itself")
    report = tmp_path / "interpret.xml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
        + [f"--junitxml={report}", str(TESTS / "interpret")],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    lines = done.stdout.strip().splitlines()
    start = next((i for i, ln in enumerate(lines) if "short test summary" in ln), len(lines) - 1)
    record_property("child session summary", "\n".join(lines[start:]))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts
