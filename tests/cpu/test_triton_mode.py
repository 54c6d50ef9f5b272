"""Where a process decides whether Triton interprets: tests/conftest.py alone, before Triton is imported.

Triton reads TRITON_INTERPRET when a kernel is decorated, so a test module that sets it while pytest
collects would make every Triton module imported after it interpreted, in the same process as the
compiled GPU tests (on a CUDA machine `pytest -m gpu tests` collects tests/interpret/ too).
"""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SETS_IT = re.compile(r"environ(\.setdefault\(|\[)\s*[\"']TRITON_INTERPRET[\"']")


def test_only_conftest_sets_triton_interpret():
    setters = sorted(
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if SETS_IT.search(path.read_text()) and path.name != "conftest.py"
    )
    assert setters == [], f"these test files set TRITON_INTERPRET; leave it to tests/conftest.py: {setters}"


def test_conftest_sets_it_only_without_cuda():
    text = (TESTS / "conftest.py").read_text()
    assert SETS_IT.search(text) and "if not torch.cuda.is_available():" in text
