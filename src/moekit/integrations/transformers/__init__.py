"""Hugging Face transformers: convert GPT-OSS, Mixtral and Qwen3-MoE blocks, and patch models with them.

`convert` turns a block (or a config and its expert tensors) into a spec and `ExpertWeights`; `patch`
swaps a model's blocks for `FusedMoE` layers and puts them back. Importing this package imports neither
transformers nor torch models: each function reads the modules it is given.
"""

from moekit.integrations.transformers.patch import (
    Family,
    MoekitMoEBlock,
    PatchReport,
    family_of,
    fused_moe_from_hf,
    hf_layer_of,
    patch_model,
    unpatch,
)

__all__ = [
    "Family",
    "MoekitMoEBlock",
    "PatchReport",
    "family_of",
    "fused_moe_from_hf",
    "hf_layer_of",
    "patch_model",
    "unpatch",
]
