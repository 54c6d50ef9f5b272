"""Model level on the CPU: tiny random GPT-OSS / Mixtral / Qwen3-MoE LMs, patched vs unpatched, in fp32.

Data flow: `model_level.model_level_figures` (tests/model_level.py) at tiny dims (H=64, I=48, E=8, 2
layers), 64 teacher-forced tokens, fp32 throughout (moekit's CPU kernel) -> top-1 agreement and KL of the
next-token distributions, printed (run with -s) and bounded: both computations are fp32 and differ only in
summation order (relative 1e-7 on the MoE outputs), so the distributions agree to KL well below 1e-8 and a
top-1 flip would need two logits within ~1e-6 of each other: at most one position of 64 is allowed.
The GPU test (tests/gpu/test_model_level.py) runs the same at the real layer dimensions in bf16.
"""

import pytest
import torch

pytest.importorskip("transformers")

from model_level import CPU_DIMS, Dims, bf16_bound_violations, model_level_figures  # noqa: E402
from moekit.integrations.transformers.patch import Family  # noqa: E402


@pytest.mark.parametrize("family", list(Family), ids=[f.value for f in Family])
def test_patched_model_predicts_what_the_unpatched_one_does(family: Family) -> None:
    figures = model_level_figures(
        family, CPU_DIMS[family], tokens=64, dtype=torch.float32, device=torch.device("cpu")
    )
    print("\n" + figures.describe(f"{family.value} (cpu, fp32, tiny)"))
    assert figures.hf_vs_moekit.top1 >= 63 / 64
    assert figures.hf_vs_moekit.kl_mean <= 1e-8 and figures.hf_vs_moekit.kl_max <= 1e-7


@pytest.mark.parametrize("family", list(Family), ids=[f.value for f in Family])
def test_bf16_patched_model_is_within_bf16_noise(family: Family) -> None:
    """The GPU test's bounds (tests/gpu/test_model_level.py) on a small bf16 model, moekit's CPU kernel."""
    dims = Dims(256, 192, 8, 2, 2, 4, 2, 64, 1024)
    figures = model_level_figures(family, dims, tokens=128, dtype=torch.bfloat16, device=torch.device("cpu"))
    print("\n" + figures.describe(f"{family.value} (cpu, bf16, small)"))
    violations = bf16_bound_violations(figures, tokens=128)
    assert not violations, f"{violations}: {figures.describe(family.value)}"
