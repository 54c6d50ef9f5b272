"""How a per-expert Hugging Face checkpoint's `quantization_config` says one MoE layer's experts are stored.

Data flow: config.json's `quantization_config` and the module names of one layer's expert projections ->
`hf_config.expert_quantization` -> None (no quantization_config, or one that leaves these experts float:
their tensors' dtype decides) or an `ExpertQuantization` (this module): the suffix of each projection's
scale tensor, how that scale is stored (`StoredScale`), and the moekit FP8 format it maps onto (`Fp8Scale`,
`ActivationQuant`). Two methods are read: "fp8" (DeepSeek-V3, Qwen3 -FP8: 128x128 `.weight_scale_inv`
blocks, per-1x128 dynamic activations; `check_fp8_method`, `FP8_BLOCK_QUANT`) and "compressed-tensors"
(llm-compressor; `compressed_tensors.compressed_tensors_experts`); any other is refused before any tensor
is looked at.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from moekit.errors import CheckpointError
from moekit.formats import fp8_weight_scale_shape
from moekit.parallel.shard import FP8_BLOCK
from moekit.spec import ActivationQuant, Fp8Scale

WEIGHT_BLOCK_SIZE = [FP8_BLOCK, FP8_BLOCK]  # the only FP8 weight block moekit's BLOCK_128 format stores


class StoredScale(enum.Enum):
    """How a checkpoint stores one FP8 projection's scale (`[out, in]` codes; the scale multiplies)."""

    BLOCK_128 = "block"  # [ceil(out/128), ceil(in/128)]
    CHANNEL = "channel"  # [out, 1]: one per output row
    TENSOR = "tensor"  # [1] (or [] in older llm-compressor files): one for the whole projection

    def shapes(self, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
        """The shapes one [out, inp] projection's scale may have in a file, the usual one first."""
        if self is StoredScale.BLOCK_128:
            return (fp8_weight_scale_shape(lead=(), n=out, k=inp, granularity=Fp8Scale.BLOCK_128),)
        if self is StoredScale.CHANNEL:
            return ((out, 1),)
        return ((1,), ())


@dataclass(frozen=True)
class ExpertQuantization:
    """FP8 experts as a checkpoint stores them, and the moekit format they are read into."""

    scale_suffix: str  # beside each projection's ".weight"
    stored: StoredScale
    fp8_scale: Fp8Scale  # ExpertWeights' granularity: BLOCK_128, or PER_CHANNEL for CHANNEL and TENSOR
    act_quant: ActivationQuant
    method: str  # quantization_config's quant_method, for messages

    def __post_init__(self) -> None:
        want = Fp8Scale.BLOCK_128 if self.stored is StoredScale.BLOCK_128 else Fp8Scale.PER_CHANNEL
        if self.fp8_scale is not want:  # the loader stacks the stored scales into this granularity
            raise CheckpointError(f"{self.stored.name} scales are read as {want.name}, not {self.fp8_scale}")


FP8_METHOD = "fp8"
CT_METHOD = "compressed-tensors"
FP8_BLOCK_QUANT = ExpertQuantization(
    ".weight_scale_inv",
    StoredScale.BLOCK_128,
    Fp8Scale.BLOCK_128,
    ActivationQuant.FP8_PER_GROUP_128,
    FP8_METHOD,
)


def check_fp8_method(quant: Mapping[str, object]) -> None:
    """quant_method "fp8" as DeepSeek-V3 and Qwen3 -FP8 write it, or a CheckpointError."""
    fmt = quant.get("fmt", "e4m3")
    block, scheme = quant.get("weight_block_size"), quant.get("activation_scheme", "dynamic")
    block_ok = isinstance(block, (list, tuple)) and list(block) == WEIGHT_BLOCK_SIZE  # an int is no grid
    # transformers' FineGrainedFP8Config: expert_dtype "fp4" packs the experts two codes a byte (DeepSeek-V4)
    experts = quant.get("expert_dtype", "fp8")
    if fmt != "e4m3" or not block_ok or scheme != "dynamic" or experts != "fp8":
        raise CheckpointError(
            f"quantization_config {dict(quant)} is not one moekit reads: it reads quant_method 'fp8', fmt "
            f"'e4m3', weight_block_size {WEIGHT_BLOCK_SIZE}, activation_scheme 'dynamic', expert_dtype "
            "'fp8' (DeepSeek-V3, Qwen3 -FP8), and quant_method 'compressed-tensors' FP8 (llm-compressor). "
            "Dequantize the checkpoint to bf16, or quantize bf16 experts with ExpertWeights.from_float"
        )
