"""Session set-up: where Triton kernels run, and how many pytest workers share the machine.

Data flow: pytest (and each pytest-xdist worker, which imports this file before collecting any test)
-> TRITON_INTERPRET decided here, before Triton is first imported (moekit's registry imports it).

- Without CUDA, Triton kernels can only run in its interpreter: TRITON_INTERPRET=1 is set for the whole
  CPU session, so tests/interpret/ runs in the same processes as everything else. On a GPU machine it is
  left alone so the GPU tests compile real kernels; tests/gpu/test_interpreter_suite.py then runs
  tests/interpret/ in a child pytest with CUDA hidden, so one `pytest -m gpu` covers both.
- `-n auto` (pyproject addopts) asks `pytest_xdist_auto_num_workers`: one worker per CPU for the CPU
  suite, none on a CUDA machine, where the GPU tests measure peak memory and capture CUDA graphs and
  must not share the device with another worker.
- Workers share the CPUs out: OMP_NUM_THREADS (torch's and OpenBLAS's pools) is set to CPUs / workers
  before they start. With more threads than cores, every small torch op waits at an OpenMP barrier for a
  thread that is not running: measured on a busy 2-core machine, the coverage matrix's reference layers
  ran 45x slower with 2 threads than with 1.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    return 0 if torch.cuda.is_available() else _cpus()


def pytest_configure(config) -> None:
    workers = getattr(config.option, "numprocesses", None)  # an int once xdist has resolved `auto`
    if isinstance(workers, int) and workers > 1 and "PYTEST_XDIST_WORKER" not in os.environ:
        threads = str(max(1, _cpus() // workers))
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, threads)  # the workers, started after this, inherit it


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the summaries that tests running a child pytest attached (`record_property`)."""
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            for name, text in getattr(report, "user_properties", ()):
                if name == "child session summary":
                    terminalreporter.write_sep("-", f"{report.nodeid}: the child session's summary")
                    terminalreporter.write_line(text)
