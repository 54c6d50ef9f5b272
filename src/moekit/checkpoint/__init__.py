"""Checkpoints, one MoE layer at a time: GPT-OSS MXFP4 (fused experts) and per-expert Hugging Face ones.

Data flow: a .safetensors file, a folder of them, or a folder with an index -> `loader.load_gpt_oss_layer`
(locate, check headers, read eight tensors, or a rank's share of them) -> `layer.GptOssLayer`; and back:
`layer.save_gpt_oss_layer`.
A folder with config.json whose experts are stored one per tensor (Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE,
DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, dots1, MiniMax-M2; float, FP8 block-128 "fp8", or llm-compressor
"compressed-tensors" FP8) -> `hf_loader.load_hf_moe_layer` -> `hf_loader.HfCheckpointLayer` (spec from
`hf_config` and `hf_rules`, the stored format from `hf_quant` / `compressed_tensors`, the reads in
`hf_stacked`).
"""

from moekit.checkpoint.files import INDEX_FILE
from moekit.checkpoint.hf_config import HfCheckpointFamily, spec_from_checkpoint_config
from moekit.checkpoint.hf_loader import HfCheckpointLayer, hf_moe_layers, load_hf_moe_layer, per_expert_family
from moekit.checkpoint.layer import (
    ROLES,
    CheckpointNaming,
    GptOssLayer,
    gpt_oss_layer_keys,
    gpt_oss_layer_tensors,
    gpt_oss_spec,
    save_gpt_oss_layer,
)
from moekit.checkpoint.loader import load_gpt_oss_layer

__all__ = [
    "INDEX_FILE",
    "ROLES",
    "CheckpointNaming",
    "GptOssLayer",
    "HfCheckpointFamily",
    "HfCheckpointLayer",
    "gpt_oss_layer_keys",
    "gpt_oss_layer_tensors",
    "gpt_oss_spec",
    "hf_moe_layers",
    "spec_from_checkpoint_config",
    "load_gpt_oss_layer",
    "load_hf_moe_layer",
    "per_expert_family",
    "save_gpt_oss_layer",
]
