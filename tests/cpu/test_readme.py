"""The README's two commands are the contract with a new user; CI must run exactly the test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ci_command() -> str:
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in ln]
    assert len(lines) == 1, lines
    return lines[0].strip()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert _ci_command() in readme


def test_readme_main_job_command_runs_moekit_run():
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install torch==2.13.0 && python3 -m pip install -e . && moekit run" in readme


def test_readme_first_python_example_runs_and_matches_its_reference():
    import re

    import torch

    from moekit.reference import relative_l2_error, tolerance

    readme = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)  # the example as a new user would paste it
    out, ref, spec = scope["out"], scope["ref"], scope["spec"]
    assert out.shape == ref.shape == (4, spec.H) and torch.isfinite(out).all()
    assert relative_l2_error(out, ref) <= tolerance(spec)
