"""A CPU slice of the fuzz harness (tools/fuzz.py): random specs x random T on the reference and
torch_grouped kernels, each refused at plan time or within tolerance of the reference.

Data flow: `random_cases` (seeded, a pool of 6 specs of small shapes, T log-uniform in [0, 64]) ->
`run_fuzz` on the CPU -> no crash, no mismatch, and something ran. The GPU run (tests/gpu/test_fuzz.py)
takes 500 cases.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import torch  # noqa: E402
from fuzz import FuzzCase, random_cases, run_case, run_fuzz  # noqa: E402


def test_a_slice_of_random_cases_is_refused_at_plan_time_or_matches_the_reference() -> None:
    cases = random_cases(20, seed=1, pool=6, max_tokens=64, shapes="cpu")
    summary = run_fuzz(cases, torch.device("cpu"))
    print("\n" + summary.describe())
    failures = [r.line() for r in summary.results if r.outcome in ("mismatch", "crash")]
    assert not failures, "\n".join(failures)
    assert summary.count("passed") >= 10


def test_cases_replay_from_their_seeds() -> None:
    case = random_cases(1, seed=3, pool=2, max_tokens=16, shapes="cpu")[0]
    assert FuzzCase.parse(case.tag()) == case
    first, again = (
        run_case(case, torch.device("cpu")),
        run_case(FuzzCase.parse(case.tag()), torch.device("cpu")),
    )
    assert (first.outcome, first.rel_l2, first.spec) == (again.outcome, again.rel_l2, again.spec)
