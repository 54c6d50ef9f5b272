"""Model level on a CUDA GPU: random HF GPT-OSS (gpt-oss-20b's layer dimensions, 3 layers), Mixtral and
Qwen3-MoE (2 layers each) LMs in bf16, patched (moekit's Triton kernel) vs unpatched (Hugging Face's).

Data flow: `model_level.model_level_figures` (tests/model_level.py): the fp32 model, then cast to bf16, then
patched, each teacher-forced over the same 256 random tokens -> top-1 agreement and KL(P || Q) of the
next-token distributions, printed (run with -s: the closing note quotes them) and bounded against bf16's own
noise, which the unpatched bf16 model's distance from the fp32 model measures (`bf16_bound_violations`):
- moekit is no further from the fp32 model than Hugging Face's bf16 path, within 5x + 1e-4 nats of mean KL:
  moekit accumulates in fp32 and rounds each GEMM's output once to bf16, Hugging Face's bf16 path rounds as
  often or more. The slack is wide because the mean over 256 positions is dominated by the few where a
  near-tie in a router's top-k picks another expert (KL max ~1e-2 where the mean is ~1e-4: measured on a
  small bf16 model on the CPU), so the ratio of two such means is noisy; a real error (a wrong activation,
  a dropped bias, a misrouted expert) moves every position and gives KL orders of magnitude larger.
- patched vs unpatched: two perturbations of one fp32 model (KL ~ Var_p(delta) / 2, and
  Var(d1 - d2) <= 2 (Var d1 + Var d2)): mean KL within the same 5x + 1e-4 of HF's own.
- top-1: flips come only from near-ties; moekit may flip at most 2x as many positions (against fp32) as HF's
  bf16 path plus 3 of 256, and patched vs unpatched agree on at least 90 % of positions.
Expected runtime on an H200: about 60 s (model init on the GPU, three Triton compiles per family).
"""

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu

skip_unless_compiled_gpu()
pytest.importorskip("transformers")

from model_level import GPU_DIMS, bf16_bound_violations, model_level_figures  # noqa: E402
from moekit.integrations.transformers.patch import Family  # noqa: E402

pytestmark = pytest.mark.gpu
TOKENS = 256


@pytest.mark.parametrize("family", list(Family), ids=[f.value for f in Family])
def test_patched_model_predicts_what_the_unpatched_one_does(family: Family) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    figures = model_level_figures(
        family, GPU_DIMS[family], tokens=TOKENS, dtype=torch.bfloat16, device=device
    )
    print(
        "\n" + figures.describe(f"{family.value} ({torch.cuda.get_device_name()}, bf16, {GPU_DIMS[family]})")
    )
    violations = bf16_bound_violations(figures, tokens=TOKENS)
    assert not violations, f"{violations}: {figures.describe(family.value)}"
