"""GPT-OSS MXFP4 checkpoints, one MoE layer at a time.

Data flow: a .safetensors file, a folder of them, or a folder with an index -> `loader.load_gpt_oss_layer`
(locate, check headers, read eight tensors, or a rank's share of them) -> `layer.GptOssLayer`; and back:
`layer.save_gpt_oss_layer`.
"""

from moekit.checkpoint.files import INDEX_FILE
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
    "gpt_oss_layer_keys",
    "gpt_oss_layer_tensors",
    "gpt_oss_spec",
    "load_gpt_oss_layer",
    "save_gpt_oss_layer",
]
