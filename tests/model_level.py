"""What the model-level tests share: a random HF MoE causal LM, teacher-forced three ways, and the figures.

Data flow: (family, dims, layers) -> a GPT-OSS / Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 causal LM
from its config in fp32 (the last two: `hf_tiny.shared_expert_config`), its MoE weights redrawn so that
the blocks matter (expert weights of unit gain, gate/up at 3x so GPT-OSS's clamp fires, decisive
routers, DeepSeek-V3's correction biases nonzero) -> one random sequence, teacher-forced: the fp32
model (the exact answer), the same model cast to `dtype` (Hugging Face's own kernels) and then patched
(`patch_model`: moekit's) -> next-token distributions compared: top-1 agreement and KL(P || Q), mean and
max over positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_tiny import randomize_correction_biases, routed_only_config, shared_expert_config
from moekit.integrations.transformers.patch import Family, patch_model, unpatch


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


# gpt-oss-20b's layer dimensions; Mixtral and Qwen3-MoE at qwen3-30b-a3b's expert shapes, fewer experts for
# Mixtral's 8; Qwen2-MoE at Qwen1.5-MoE-A2.7B's (60 experts, top 4); DeepSeek-V3 at its own I and K with
# H and E cut (7168 and 256 would not fit fp32 on one GPU), grouped 4 ways; Qwen3-Next at its own expert
# shapes (512 experts of I 512, top 10); GLM-4.5 at its own I and K with H and E cut as DeepSeek-V3's;
# DeepSeek-V2-Lite (H 2048, I 1408, 64 experts, top 6) and OLMoE-1B-7B (H 2048, I 1024, 64, top 8) at their
# own shapes; MiniMax-M2 at its config class's H 3072, I 1536, top 8 with E cut to 64; dots.llm1 (I 1408,
# top 6) and GLM-4.7-Flash (its config class's I 1536, top 4) with H and E cut as DeepSeek-V3's.
GPU_DIMS = {
    Family.GPT_OSS: Dims(2880, 2880, 32, 4, 3, 64, 8, 64, 8192),
    Family.MIXTRAL: Dims(1024, 3584, 8, 2, 2, 16, 4, 64, 8192),
    Family.QWEN3_MOE: Dims(2048, 768, 128, 8, 2, 32, 4, 64, 8192),
    Family.QWEN2_MOE: Dims(2048, 1408, 60, 4, 2, 16, 16, 128, 8192),
    Family.DEEPSEEK_V3: Dims(2048, 2048, 64, 8, 2, 16, 16, 128, 8192),
    Family.QWEN3_NEXT: Dims(2048, 512, 512, 10, 2, 16, 2, 128, 8192),
    Family.GLM4_MOE: Dims(2048, 1536, 64, 8, 2, 16, 4, 128, 8192),
    Family.DEEPSEEK_V2: Dims(2048, 1408, 64, 6, 2, 16, 16, 128, 8192),
    Family.OLMOE: Dims(2048, 1024, 64, 8, 2, 16, 16, 128, 8192),
    Family.MINIMAX_M2: Dims(3072, 1536, 64, 8, 2, 48, 8, 128, 8192),
    Family.DOTS1: Dims(2048, 1408, 64, 6, 2, 32, 32, 128, 8192),
    Family.GLM4_MOE_LITE: Dims(2048, 1536, 64, 4, 2, 16, 16, 128, 8192),
}
CPU_DIMS = {f: Dims(64, 48, 8, 2 if f is Family.MIXTRAL else 4, 2, 4, 2, 16, 128) for f in Family}


@dataclass(frozen=True)
class Agreement:
    top1: float  # fraction of positions whose most likely next token is the same
    kl_mean: float  # KL(P || Q) of the next-token distributions, mean over positions (nats)
    kl_max: float

    def describe(self) -> str:
        return f"top-1 {self.top1:.4f}, KL mean {self.kl_mean:.2e} max {self.kl_max:.2e}"


@dataclass(frozen=True)
class Figures:
    hf_vs_moekit: Agreement  # the patched model against the unpatched one, both in `dtype`
    exact_vs_hf: Agreement  # the unpatched model in `dtype` against the fp32 model: dtype's own noise
    exact_vs_moekit: Agreement

    def describe(self, label: str) -> str:
        return (
            f"{label}: patched vs unpatched {self.hf_vs_moekit.describe()} | unpatched vs fp32 "
            f"{self.exact_vs_hf.describe()} | patched vs fp32 {self.exact_vs_moekit.describe()}"
        )


def compare(p_logits: torch.Tensor, q_logits: torch.Tensor) -> Agreement:
    logp, logq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean().item()
    return Agreement(top1=top1, kl_mean=kl.mean().item(), kl_max=kl.max().item())


def _config(family: Family, d: Dims):
    import transformers

    if family.hf.shared is not None:
        return shared_expert_config(
            family,
            hidden=d.hidden,
            intermediate=d.intermediate,
            experts=d.experts,
            top_k=d.top_k,
            layers=d.layers,
            heads=d.heads,
            kv_heads=d.kv_heads,
            head_dim=d.head_dim,
            vocab=d.vocab,
        )
    common = dict(
        hidden_size=d.hidden,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.head_dim,
        vocab_size=d.vocab,
    )
    if family in (Family.OLMOE, Family.MINIMAX_M2):
        return routed_only_config(
            family, hidden=d.hidden, intermediate=d.intermediate, experts=d.experts, top_k=d.top_k,
            layers=d.layers, heads=d.heads, kv_heads=d.kv_heads, head_dim=d.head_dim, vocab=d.vocab,
        )  # fmt: skip
    if family is Family.GPT_OSS:
        return transformers.GptOssConfig(
            intermediate_size=d.intermediate,
            num_local_experts=d.experts,
            num_experts_per_tok=d.top_k,
            **common,
        )
    if family is Family.MIXTRAL:
        return transformers.MixtralConfig(
            intermediate_size=d.intermediate,
            num_local_experts=d.experts,
            num_experts_per_tok=d.top_k,
            **common,
        )
    return transformers.Qwen3MoeConfig(
        moe_intermediate_size=d.intermediate,
        intermediate_size=2 * d.intermediate,
        num_experts=d.experts,
        num_experts_per_tok=d.top_k,
        norm_topk_prob=True,
        **common,
    )


def build_model(family: Family, d: Dims, *, seed: int, device: torch.device):
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):  # drawn where it runs: a CPU would take long over gpt-oss-sized experts
        model = transformers.AutoModelForCausalLM.from_config(_config(family, d), dtype=torch.float32)
    model = model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." not in name:
                continue
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
            elif "gate_up" in name:
                p.normal_(0.0, 3.0 / math.sqrt(d.hidden))
            elif "down" in name:
                p.normal_(0.0, 1.0 / math.sqrt(d.intermediate))
            else:  # the router (logits of std 2 on normalized inputs), the shared experts' gate and up
                p.normal_(0.0, 2.0 / math.sqrt(d.hidden))
    randomize_correction_biases(model)
    return model


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits[0].float()


def model_level_figures(
    family: Family, d: Dims, *, tokens: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Figures:
    model = build_model(family, d, seed=seed, device=device)
    ids = torch.randint(0, d.vocab, (1, tokens), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    exact = _logits(model, ids)
    model.to(dtype)
    hf = _logits(model, ids)
    patch_model(model)
    moekit = _logits(model, ids)
    unpatch(model)
    return Figures(
        hf_vs_moekit=compare(hf, moekit),
        exact_vs_hf=compare(exact, hf),
        exact_vs_moekit=compare(exact, moekit),
    )


def bf16_bound_violations(figures: Figures, *, tokens: int) -> list[str]:
    """The bounds a low-precision patched model must meet, relative to that precision's own noise (the
    unpatched model's distance from the fp32 model); tests/gpu/test_model_level.py gives the reasoning."""
    own, ours, across = figures.exact_vs_hf, figures.exact_vs_moekit, figures.hf_vs_moekit
    checks = {
        "moekit's KL from fp32 <= 5x HF's + 1e-4": ours.kl_mean <= 5 * own.kl_mean + 1e-4,
        "patched vs unpatched KL <= 5x HF's KL from fp32 + 1e-4": across.kl_mean <= 5 * own.kl_mean + 1e-4,
        "moekit's top-1 flips vs fp32 <= 2x HF's + 3": (1 - ours.top1) <= 2 * (1 - own.top1) + 3 / tokens,
        "patched vs unpatched top-1 >= 0.9": across.top1 >= 0.9,
    }
    return [name for name, ok in checks.items() if not ok]
