"""Tiny Hugging Face configs of the shared-expert MoE families (DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, dots1,
Qwen2-MoE, Qwen3-Next) and of OLMoE and MiniMax-M2, for the tests.

Data flow: sizes (H, I, E, K, layers, attention heads, vocab) -> `shared_expert_config(family, ...)` -> a
`DeepseekV3Config` (MLA attention sized from `head_dim`, every layer MoE, grouped routing that still has
a choice: `topk_group` of `n_group` groups keep more experts than K) or a `Qwen2MoeConfig` (a shared expert
twice the routed experts' size) -> `transformers.AutoModelForCausalLM.from_config`; then
`randomize_correction_biases(model)` draws each DeepSeek-V3 router's `e_score_correction_bias` (a buffer,
zero at init) at a size that changes which experts are chosen.
"""

from __future__ import annotations

import torch

from moekit.checkpoint.hf_config import CORRECTION_BIAS
from moekit.integrations.transformers import Family


def _groups(experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group): several groups, most of them kept, and more experts kept than K."""
    n_group = next(n for n in (4, 3, 2, 1) if experts % n == 0)
    topk_group = max(1, (3 * n_group) // 4)
    if topk_group * (experts // n_group) < top_k:
        raise ValueError(f"E={experts} in {n_group} groups, {topk_group} kept, cannot give K={top_k}")
    return n_group, topk_group


def shared_expert_config(
    family: Family,
    *,
    hidden: int,
    intermediate: int,
    experts: int,
    top_k: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    norm_topk_prob: bool = True,
):
    import transformers

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, vocab_size=vocab)

    def grouped() -> dict:
        """DeepSeek-V3's MoE and routing fields, which GLM-4.5's config shares."""
        n_group, topk_group = _groups(experts, top_k)
        return dict(
            moe_intermediate_size=intermediate,
            intermediate_size=2 * intermediate,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=2.5,
            norm_topk_prob=norm_topk_prob,
            n_shared_experts=1,
            first_k_dense_replace=0,
            **common,
        )

    gated_shared = dict(  # Qwen2-MoE's MoE fields, which Qwen3-Next's config shares
        moe_intermediate_size=intermediate,
        shared_expert_intermediate_size=2 * intermediate,
        intermediate_size=2 * intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        num_key_value_heads=kv_heads,
        **common,
    )
    if family is Family.DEEPSEEK_V3:
        return transformers.DeepseekV3Config(
            **grouped(),
            num_key_value_heads=heads,  # MLA: per-head keys and values from one latent; kv_heads unused
            q_lora_rank=None,
            kv_lora_rank=2 * head_dim,
            qk_rope_head_dim=head_dim // 2,
            qk_nope_head_dim=head_dim // 2,
            v_head_dim=head_dim,
        )
    if family is Family.QWEN2_MOE:
        return transformers.Qwen2MoeConfig(**gated_shared)
    if family is Family.GLM4_MOE:
        return transformers.Glm4MoeConfig(
            **grouped(),
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
        )
    if family is Family.QWEN3_NEXT:  # full attention only: the linear-attention layers are not under test
        return transformers.Qwen3NextConfig(
            **gated_shared, head_dim=head_dim, layer_types=["full_attention"] * layers
        )
    mla = dict(  # DeepSeek-V2's and GLM-4.7-Flash's attention, sized as DeepSeek-V3's above
        num_key_value_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=2 * head_dim,
        qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
    )
    if family is Family.DEEPSEEK_V2:  # DeepSeek-V2-Lite's greedy routing; groups unused, norm ignored
        return transformers.DeepseekV2Config(**grouped(), **mla, topk_method="greedy")
    if family is Family.DOTS1:
        return transformers.Dots1Config(**grouped(), num_key_value_heads=kv_heads, head_dim=head_dim)
    if family is Family.GLM4_MOE_LITE:  # every layer MoE (the config's default makes layer 0 dense)
        return transformers.Glm4MoeLiteConfig(**grouped(), **mla, mlp_layer_types=["sparse"] * layers)
    raise ValueError(f"{family} has no shared experts")


def routed_only_config(
    family: Family, *, hidden: int, intermediate: int, experts: int, top_k: int, layers: int, heads: int,
    kv_heads: int, head_dim: int, vocab: int,
):  # fmt: skip
    """A tiny OLMoE or MiniMax-M2 config (routed experts only, every layer MoE); OLMoE renormalizes (the
    released model does not: both settings are covered by the checkpoint tests)."""
    import transformers

    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab, intermediate_size=intermediate, num_experts_per_tok=top_k,
    )  # fmt: skip
    if family is Family.OLMOE:
        return transformers.OlmoeConfig(**common, num_experts=experts, norm_topk_prob=True, eos_token_id=None)
    if family is Family.MINIMAX_M2:
        return transformers.MiniMaxM2Config(
            **common, head_dim=head_dim, num_local_experts=experts, bos_token_id=None, eos_token_id=None
        )
    raise ValueError(f"{family} is not built here")


def randomize_correction_biases(model: torch.nn.Module, *, std: float = 0.1) -> None:
    """Each `e_score_correction_bias` (added to sigmoid scores in (0, 1)) drawn at `std`: nonzero, and
    large enough to move some tokens' choices."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(CORRECTION_BIAS):
                buffer.normal_(0.0, std)


def tiny_new_family_model(model_type: str, *, hidden: int, intermediate: int, experts: int):
    """(a small causal LM of DeepSeek-V2, OLMoE, MiniMax-M2, dots1 or GLM-4.7-Flash, its MoE layer index):
    two experts per token, a dense first layer where the family has one, routing that exercises its
    constants (scaling factor != 1, nonzero correction biases drawn by the caller)."""
    import transformers

    common = dict(vocab_size=32, hidden_size=hidden, num_attention_heads=2, num_experts_per_tok=2)
    mla = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    moe = dict(intermediate_size=128, moe_intermediate_size=intermediate, n_routed_experts=experts)
    if model_type == "deepseek_v2":  # DeepSeek-V2-Lite's routing: greedy, not renormalized, scaled
        cfg = transformers.DeepseekV2Config(
            **common, **moe, **mla, num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=2,
            n_shared_experts=1, topk_method="greedy", routed_scaling_factor=1.5,
        )  # fmt: skip
        return transformers.DeepseekV2ForCausalLM(cfg), 1
    if model_type == "olmoe":  # OLMoE's released norm_topk_prob is False
        cfg = transformers.OlmoeConfig(
            **common, intermediate_size=intermediate, num_hidden_layers=1, num_key_value_heads=1,
            num_experts=experts,
        )  # fmt: skip
        return transformers.OlmoeForCausalLM(cfg), 0
    if model_type == "minimax_m2":
        cfg = transformers.MiniMaxM2Config(
            **common, intermediate_size=intermediate, num_hidden_layers=1, num_key_value_heads=1,
            head_dim=32, num_local_experts=experts, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return transformers.MiniMaxM2ForCausalLM(cfg), 0
    if model_type == "dots1":  # norm_topk_prob set: Dots1Config's default (False) is refused
        cfg = transformers.Dots1Config(
            **common, **moe, num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=1,
            head_dim=32, n_shared_experts=1, n_group=3, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )  # fmt: skip
        return transformers.Dots1ForCausalLM(cfg), 1
    if model_type == "glm4_moe_lite":  # mlp_layer_types' default: layer 0 dense
        cfg = transformers.Glm4MoeLiteConfig(
            **common, **mla, **moe, num_hidden_layers=2, num_key_value_heads=2, n_shared_experts=1,
            n_group=1, topk_group=1,
        )  # fmt: skip
        return transformers.Glm4MoeLiteForCausalLM(cfg), 1
    raise ValueError(f"{model_type} is not one of the families built here")
