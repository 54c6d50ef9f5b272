"""Hugging Face MoE checkpoints stored one expert at a time: where each family keeps its routed experts,
and the `MoESpec` its `config.json` describes.

Data flow: `config.json` (a dict) -> `HfCheckpointFamily.of_config` (by `model_type`) -> `.layout` (the
family's key names) and `spec_from_checkpoint_config` (E, K, H, I, activation, routing, the weight
format from `quantization_config`: `expert_quantization`, with `hf_quant` and `compressed_tensors`) ->
`hf_loader.load_hf_moe_layer` reads one layer's tensors by these names.

Facts, read from transformers 5.24's `models/*/modeling_*.py` and configuration classes and from what
its `save_pretrained` writes (checked by tests/cpu/test_hf_checkpoint.py on tiny models of each family):
- On disk every family keeps one tensor per expert and projection, `[out, in]` as `nn.Linear` does:
  `{block}.experts.{e}.{gate,up,down}.weight`, with the block `model.layers.{l}.block_sparse_moe`
  (Mixtral, MiniMax-M2; projections `w1` gate, `w3` up, `w2` down: conversion_mapping.py renames them
  to the live `mlp.` on load) or `model.layers.{l}.mlp` (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE,
  DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, dots1; `gate_proj`, `up_proj`, `down_proj`). The router is
  `{block}.gate.weight [E, H]`, no bias.
- DeepSeek-V3, GLM-4.5, GLM-4.7-Flash and dots1 add `{block}.gate.e_score_correction_bias [E]` (fp32);
  MiniMax-M2 keeps its correction bias on the block, `{block}.e_score_correction_bias [E]`. DeepSeek-V2/V3,
  GLM-4.5/4.7-Flash and dots1 have shared experts `{block}.shared_experts.*` that the model adds to the
  routed output; Qwen2-MoE and Qwen3-Next have `{block}.shared_expert.*` and
  `{block}.shared_expert_gate.weight`. A moekit layer computes the routed experts only (as vLLM's fused
  MoE does); the shared experts are named in the loaded layer, not read.
- Each family's routing and dense-layer rule from its config fields: `hf_rules` (its docstring states
  them, with DeepSeek-V3's grouped routing, which GLM-4.5, GLM-4.7-Flash and dots1 share; `scoring_func`
  "sigmoid" and `topk_method` "noaux_tc" in DeepSeek's own config, absent from configs transformers
  writes, which assume them). E is `n_routed_experts` (DeepSeek-V2/V3, GLM, dots1), `num_experts`
  (Qwen, OLMoE) or `num_local_experts` (Mixtral, MiniMax-M2, and every family's alias); I is
  `moe_intermediate_size`, except `intermediate_size` for Mixtral, OLMoE and MiniMax-M2.
- FP8 releases (DeepSeek-V3, Qwen3 "-FP8"; MiniMax-M2's by its published config.json) carry
  `quantization_config` {quant_method "fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size
  [128, 128]}: each projection is float8_e4m3fn with a
  `.weight_scale_inv` of shape [ceil(out/128), ceil(in/128)] that multiplies the codes (the name
  notwithstanding), and activations are quantized per token and 128-column group at run time.
- llm-compressor's FP8 releases (RedHatAI's Qwen3-30B-A3B-FP8-dynamic, Mixtral-8x7B FP8) carry
  quantization_config {quant_method "compressed-tensors", format "float-quantized", config_groups,
  ignore (the routers among them)}: each quantized projection is float8_e4m3fn with a `.weight_scale`
  per output channel, per tensor or per 128x128 block (`compressed_tensors`, where its facts are sourced).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moekit.checkpoint.compressed_tensors import compressed_tensors_experts
from moekit.checkpoint.hf_quant import (
    CT_METHOD,
    FP8_BLOCK_QUANT,
    FP8_METHOD,
    ExpertQuantization,
    check_fp8_method,
)
from moekit.checkpoint.hf_rules import (
    DenseRule,
    HfRouting,
    dense_reason,
    routing_of_config,
)
from moekit.checkpoint.hf_rules import (
    config_field as _field,
)
from moekit.errors import CheckpointError, SpecError
from moekit.parallel.shard import FP8_BLOCK
from moekit.spec import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
)

# HF `hidden_act` names (transformers.activations.ACT2FN) -> moekit activations with the same math.
HF_ACTIVATIONS: dict[str, Activation] = {
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "gelu": Activation.GELU,  # exact erf GELU
    "gelu_pytorch_tanh": Activation.GELU_TANH,
}
CONFIG_FILE = "config.json"  # beside the .safetensors files of a model folder
CORRECTION_BIAS = "e_score_correction_bias"  # the [E] buffer's name, on the router or on the block
_ROUTER_BIAS = f"gate.{CORRECTION_BIAS}"  # DeepSeek-V3's: `{block}.gate.e_score_correction_bias`


@dataclass(frozen=True)
class CheckpointLayout:
    """Where one family keeps a MoE layer's tensors, and which config fields give its sizes and routing."""

    block: str  # the MoE block's key prefix, with `{l}` for the layer
    projections: tuple[str, str, str]  # per-expert (gate, up, down) module names
    num_experts_fields: tuple[str, ...]  # config fields that may hold E (HF writes its alias)
    intermediate_field: str
    renormalize_field: str | None  # SOFTMAX: the renormalize flag; None: always renormalizes (Mixtral) or N/A
    routing: HfRouting
    correction_bias: str | None  # block-relative key of the `[E]` correction bias; None: the family has none
    shared_prefixes: tuple[str, ...]  # block-relative prefixes of tensors the model adds beside the experts
    dense_rule: DenseRule
    norm_topk_prob_if_missing: bool = True  # SIGMOID_GROUPED: the config class's default

    @property
    def routing_method(self) -> RoutingMethod:
        return self.routing.method

    def prefix(self, layer: int) -> str:
        return self.block.format(l=layer)


class HfCheckpointFamily(enum.Enum):
    """The model families whose per-expert checkpoints moekit reads (values are HF `model_type`s)."""

    MIXTRAL = "mixtral"
    QWEN2_MOE = "qwen2_moe"
    QWEN3_MOE = "qwen3_moe"
    QWEN3_NEXT = "qwen3_next"
    DEEPSEEK_V3 = "deepseek_v3"
    GLM4_MOE = "glm4_moe"
    DEEPSEEK_V2 = "deepseek_v2"
    OLMOE = "olmoe"
    MINIMAX_M2 = "minimax_m2"
    DOTS1 = "dots1"
    GLM4_MOE_LITE = "glm4_moe_lite"

    @property
    def layout(self) -> CheckpointLayout:
        return LAYOUTS[self]

    @classmethod
    def of_config(cls, config: Mapping[str, object]) -> HfCheckpointFamily:
        model_type = config.get("model_type")
        for family in cls:
            if family.value == model_type:
                return family
        hint = (
            " GPT-OSS checkpoints store fused MXFP4 experts: read them with moekit.checkpoint."
            "load_gpt_oss_layer or FusedMoE.from_gpt_oss_checkpoint."
            if model_type == "gpt_oss"
            else ""
        )
        raise CheckpointError(
            f"config.json model_type={model_type!r} is not a per-expert MoE family moekit reads; "
            f"supported: {[f.value for f in cls]}.{hint}"
        )


_MLP_BLOCK = "model.layers.{l}.mlp"
_PROJ = ("gate_proj", "up_proj", "down_proj")
_QWEN_SHARED = CheckpointLayout(  # Qwen2-MoE, Qwen3-Next: a gated shared expert beside the routed ones
    block=_MLP_BLOCK,
    projections=_PROJ,
    num_experts_fields=("num_experts", "num_local_experts"),
    intermediate_field="moe_intermediate_size",
    renormalize_field="norm_topk_prob",
    routing=HfRouting.SOFTMAX,
    correction_bias=None,
    shared_prefixes=("shared_expert.", "shared_expert_gate."),
    dense_rule=DenseRule.QWEN_SPARSE_STEP,
)
_SIGMOID_GROUPED = CheckpointLayout(  # DeepSeek-V3, GLM-4.5: corrected sigmoid scores, shared experts
    block=_MLP_BLOCK,
    projections=_PROJ,
    num_experts_fields=("n_routed_experts", "num_local_experts"),
    intermediate_field="moe_intermediate_size",
    renormalize_field=None,
    routing=HfRouting.SIGMOID_GROUPED,
    correction_bias=_ROUTER_BIAS,
    shared_prefixes=("shared_experts.",),
    dense_rule=DenseRule.FIRST_K_DENSE_REPLACE,
)

_MIXTRAL = CheckpointLayout(
    block="model.layers.{l}.block_sparse_moe",
    projections=("w1", "w3", "w2"),
    num_experts_fields=("num_local_experts",),
    intermediate_field="intermediate_size",
    renormalize_field=None,
    routing=HfRouting.SOFTMAX,
    correction_bias=None,
    shared_prefixes=(),
    dense_rule=DenseRule.NONE,
)

LAYOUTS: dict[HfCheckpointFamily, CheckpointLayout] = {
    HfCheckpointFamily.MIXTRAL: _MIXTRAL,
    HfCheckpointFamily.QWEN3_MOE: replace(_QWEN_SHARED, shared_prefixes=()),
    HfCheckpointFamily.QWEN2_MOE: _QWEN_SHARED,
    HfCheckpointFamily.QWEN3_NEXT: _QWEN_SHARED,
    HfCheckpointFamily.DEEPSEEK_V3: _SIGMOID_GROUPED,
    HfCheckpointFamily.GLM4_MOE: _SIGMOID_GROUPED,
    HfCheckpointFamily.DEEPSEEK_V2: replace(  # greedy softmax routing, no correction bias
        _SIGMOID_GROUPED, routing=HfRouting.SOFTMAX_GREEDY_SCALED, correction_bias=None
    ),
    HfCheckpointFamily.OLMOE: replace(  # Qwen3-MoE's routing; I is `intermediate_size`, every layer MoE
        _QWEN_SHARED, intermediate_field="intermediate_size", shared_prefixes=(), dense_rule=DenseRule.NONE
    ),
    HfCheckpointFamily.MINIMAX_M2: replace(  # Mixtral's names; the correction bias is the block's own
        _MIXTRAL, routing=HfRouting.SIGMOID_CORRECTED, correction_bias=CORRECTION_BIAS
    ),
    HfCheckpointFamily.DOTS1: replace(_SIGMOID_GROUPED, norm_topk_prob_if_missing=False),
    HfCheckpointFamily.GLM4_MOE_LITE: replace(_SIGMOID_GROUPED, dense_rule=DenseRule.MLP_LAYER_TYPES),
}


def num_experts_of(family: HfCheckpointFamily, config: Mapping[str, object]) -> int:
    """E from whichever of the family's fields config.json holds (transformers writes its own alias,
    e.g. `num_local_experts` for Qwen3-MoE, whose released configs say `num_experts`)."""
    names = family.layout.num_experts_fields
    present = {name: config[name] for name in names if config.get(name) is not None}
    if not present:
        raise CheckpointError(f"config.json holds none of {list(names)}, so E is unknown")
    values = {_field(config, name) for name in present}
    if len(values) > 1:
        raise CheckpointError(f"config.json fields {present} disagree on E; keep one")
    return values.pop()


@dataclass(frozen=True)
class StoredFormat:
    """How the checkpoint stores expert weights: the spec's format fields."""

    weight_format: WeightFormat
    fp8_scale: Fp8Scale | None
    act_quant: ActivationQuant


def expert_modules(family: HfCheckpointFamily, config: Mapping[str, object], layer: int) -> list[str]:
    """The module names of layer `layer`'s expert projections (`{block}.experts.{e}.{proj}`), which a
    compressed-tensors config's targets and `ignore` match."""
    prefix = family.layout.prefix(layer)
    return [
        f"{prefix}.experts.{e}.{proj}"
        for e in range(num_experts_of(family, config))
        for proj in family.layout.projections
    ]


def expert_quantization(
    family: HfCheckpointFamily, config: Mapping[str, object], layer: int
) -> ExpertQuantization | None:
    """How `quantization_config` says layer `layer`'s experts are stored; None: float experts (no
    quantization_config, or one whose `ignore` leaves them float). Any other quantization is refused here,
    before the checkpoint's tensors are looked at."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"config.json quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == CT_METHOD:
        return compressed_tensors_experts(quant, expert_modules(family, config, layer))
    if method != FP8_METHOD:
        raise CheckpointError(
            f"quantization_config quant_method={method!r} is not one moekit reads: it reads "
            f"{FP8_METHOD!r} (DeepSeek-V3, Qwen3 -FP8: 128x128 block scales) and {CT_METHOD!r} "
            "(llm-compressor FP8). Dequantize the checkpoint to bf16, or quantize bf16 experts with "
            "ExpertWeights.from_float"
        )
    check_fp8_method(quant)
    return FP8_BLOCK_QUANT


def stored_format(quant: ExpertQuantization | None, float_dtype: torch.dtype | None) -> StoredFormat:
    """The format `quant` declares; without one, the float dtype the tensors hold."""
    if quant is not None:
        return StoredFormat(WeightFormat.FP8_E4M3, quant.fp8_scale, quant.act_quant)
    weight_format = None if float_dtype is None else WeightFormat.of_float_dtype(float_dtype)
    if weight_format is None:
        raise CheckpointError(
            "config.json declares no quantization of these experts (no quantization_config, or one whose "
            f"'ignore' lists them), so they must be float32, bfloat16 or float16, but they are "
            f"{float_dtype}; a quantized checkpoint needs its quantization_config"
        )
    return StoredFormat(weight_format, None, ActivationQuant.NONE)


def read_config(file: Path) -> dict[str, object]:
    """A model's config.json as a dict; an unreadable or non-object file is a CheckpointError."""
    try:
        loaded = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file} as the model's config.json: {exc!r}") from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def spec_from_config_file(file: Path, *, act_dtype: torch.dtype = torch.bfloat16) -> MoESpec:
    """The MoE layer spec a per-expert checkpoint's config.json (or the config.json of the model folder
    `file`) describes, without its tensors: the float format from the config's `dtype` (`torch_dtype` in
    older configs) unless it declares FP8 (for the first layer with experts: a compressed-tensors config
    may leave some layers' experts float), for planning (`moekit explain --config`); `load_hf_moe_layer`
    checks it against the tensors it reads."""
    file = Path(file)
    config = read_config(file / CONFIG_FILE if file.is_dir() else file)
    family = HfCheckpointFamily.of_config(config)
    name = config.get("dtype", config.get("torch_dtype"))
    dtype = _CONFIG_DTYPES.get(name) if isinstance(name, str) else None  # a list or object names none
    quant = expert_quantization(family, config, first_moe_layer(family, config))
    if quant is None and dtype is None:
        raise CheckpointError(
            f"{file} names the weights' dtype {name!r} (field 'dtype' or 'torch_dtype'); one of "
            f"{sorted(_CONFIG_DTYPES)} is needed to know their format without reading them"
        )
    stored = stored_format(quant, dtype)
    return spec_from_checkpoint_config(family, config, stored, act_dtype=act_dtype)


def _routing(family: HfCheckpointFamily, config: Mapping[str, object]) -> RoutingSpec:
    layout = family.layout
    return routing_of_config(
        layout.routing,
        config,
        renormalize_field=layout.renormalize_field,
        norm_topk_prob_if_missing=layout.norm_topk_prob_if_missing,
    )


def spec_from_checkpoint_config(
    family: HfCheckpointFamily,
    config: Mapping[str, object],
    stored: StoredFormat,
    *,
    act_dtype: torch.dtype,
) -> MoESpec:
    """The `MoESpec` of one MoE layer of `config` (the whole layer: all E experts)."""
    layout = family.layout
    name = config.get("hidden_act", "silu")
    activation = HF_ACTIVATIONS.get(name) if isinstance(name, str) else None
    if activation is None:
        raise SpecError(
            f"config.json hidden_act={config.get('hidden_act')!r} has no moekit activation; known: "
            f"{list(HF_ACTIVATIONS)}"
        )
    intermediate = _field(config, layout.intermediate_field)
    if stored.fp8_scale is Fp8Scale.BLOCK_128 and intermediate % FP8_BLOCK:
        raise CheckpointError(
            f"{layout.intermediate_field}={intermediate} is not a multiple of {FP8_BLOCK}: the gate and up "
            f"scale blocks cannot stack into one [2I] grid of {FP8_BLOCK}-row blocks; dequantize the experts "
            "and quantize them again with ExpertWeights.from_float"
        )
    return MoESpec(
        num_experts=num_experts_of(family, config),
        top_k=_field(config, "num_experts_per_tok"),
        hidden_size=_field(config, "hidden_size"),
        intermediate_size=intermediate,
        weight_format=stored.weight_format,
        fp8_scale=stored.fp8_scale,
        act_dtype=act_dtype,
        act_quant=stored.act_quant,
        activation=ActivationSpec(activation),
        gate_layout=GateLayout.CONCAT,
        routing=_routing(family, config),
    )


def dense_layer_reason(family: HfCheckpointFamily, config: Mapping[str, object], layer: int) -> str | None:
    """Why config.json makes decoder layer `layer` a dense MLP (transformers builds no experts for it,
    whatever tensors the files hold), or None; the family's rule is its layout's `dense_rule`
    (`hf_rules.dense_reason` states each)."""
    return dense_reason(family.layout.dense_rule, config, layer)


def first_moe_layer(family: HfCheckpointFamily, config: Mapping[str, object]) -> int:
    """The first layer config.json does not make dense (0 when it says nothing of the layers)."""
    count = config.get("num_hidden_layers")
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    return next((layer for layer in range(count) if dense_layer_reason(family, config, layer) is None), 0)
