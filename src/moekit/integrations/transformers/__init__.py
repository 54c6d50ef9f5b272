"""Hugging Face transformers: convert GPT-OSS, Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE, DeepSeek-V2/V3,
GLM-4.5, GLM-4.7-Flash, dots1 and MiniMax-M2 MoE blocks, and patch models with them.

Data flow: `families` describes each supported family once (block class, router name, config fields,
experts layout, grouped-routing constants, correction bias, shared experts) -> `convert` turns a block
(or a config and its expert tensors) into a spec and `ExpertWeights` (and back), `held` checks a given
config against the fields the block holds -> `block.MoekitMoEBlock` runs a `FusedMoE` in a block's
place, plus the block's own shared-expert modules (saved, loaded and cast as the block would be) ->
`patch` swaps a model's blocks for them and puts them back.
Importing this package imports neither transformers nor torch models: each function reads the modules
it is given.
"""

from moekit.integrations.transformers.convert import (
    HfMoeLayer,
    from_hf_experts,
    from_hf_gpt_oss_experts,
    from_hf_mixtral_experts,
    from_hf_moe_block,
    from_hf_qwen3_moe_experts,
    hf_expert_tensors,
    spec_from_hf_config,
)
from moekit.integrations.transformers.families import FAMILIES, Family, HfFamily, family_of
from moekit.integrations.transformers.patch import (
    MoekitMoEBlock,
    PatchedBlock,
    PatchReport,
    fused_moe_from_hf,
    hf_layer_of,
    patch_model,
    unpatch,
)

__all__ = [
    "FAMILIES",
    "Family",
    "HfFamily",
    "HfMoeLayer",
    "MoekitMoEBlock",
    "PatchReport",
    "PatchedBlock",
    "family_of",
    "from_hf_experts",
    "from_hf_gpt_oss_experts",
    "from_hf_mixtral_experts",
    "from_hf_moe_block",
    "from_hf_qwen3_moe_experts",
    "fused_moe_from_hf",
    "hf_expert_tensors",
    "hf_layer_of",
    "patch_model",
    "spec_from_hf_config",
    "unpatch",
]
