"""Per-expert FP8 block-128 checkpoints written for tests: a random moekit FP8 layer split into DeepSeek-V3
/ Qwen3 -FP8 / MiniMax-M2 tensors (`experts.{e}.{gate,up,down}_proj.weight`, MiniMax-M2's `w1/w3/w2`, +
`.weight_scale_inv`, router, the correction bias) over two shards with an index, and the config.json that
describes it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from moekit.checkpoint import HfCheckpointFamily
from moekit.spec import ActivationQuant, Fp8Scale, MoESpec, RoutingMethod, RoutingSpec, WeightFormat
from moekit.synthetic import SyntheticLayer, random_layer

FP8_H, FP8_I, FP8_E = 320, 256, 5  # H ragged against 128; I/2 is one scale block


def fp8_spec(family: HfCheckpointFamily) -> MoESpec:
    grouped = family is HfCheckpointFamily.DEEPSEEK_V3
    corrected = RoutingSpec(RoutingMethod.SIGMOID_GROUPED, has_correction_bias=True)  # MiniMax-M2's
    return MoESpec(
        num_experts=FP8_E, top_k=2, hidden_size=FP8_H, intermediate_size=FP8_I,
        weight_format=WeightFormat.FP8_E4M3, fp8_scale=Fp8Scale.BLOCK_128, act_dtype=torch.float32,
        act_quant=ActivationQuant.FP8_PER_GROUP_128,
        routing=RoutingSpec(
            RoutingMethod.SIGMOID_GROUPED, has_correction_bias=True, routed_scaling_factor=2.5
        ) if grouped else corrected if family is HfCheckpointFamily.MINIMAX_M2
        else RoutingSpec(RoutingMethod.SOFTMAX_TOPK),
    )  # fmt: skip


def fp8_config(family: HfCheckpointFamily) -> dict:
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    config = {"model_type": family.value, "hidden_size": FP8_H, family.layout.intermediate_field: FP8_I}
    config |= {"num_experts_per_tok": 2, "hidden_act": "silu", "quantization_config": quant}
    if family is HfCheckpointFamily.DEEPSEEK_V3:
        return {
            **config,
            "n_routed_experts": FP8_E,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
        }
    if family is HfCheckpointFamily.MINIMAX_M2:  # its release's routing fields (transformers has none)
        return {**config, "num_local_experts": FP8_E, "scoring_func": "sigmoid"}
    return {**config, "num_experts": FP8_E, "norm_topk_prob": True}


def write_fp8_checkpoint(
    folder: Path, family: HfCheckpointFamily, *, scale_dtype: torch.dtype = torch.float32, seed: int = 0
) -> SyntheticLayer:
    """A random FP8 layer as `family` stores it, in two shards with an index; returns the synthetic layer."""
    synthetic = random_layer(fp8_spec(family), seed=seed, weight_std=0.5)
    w, blocks = synthetic.weights, FP8_I // 128
    layout = family.layout
    prefix = layout.prefix(3)
    tensors = {f"{prefix}.gate.weight": synthetic.router_weight.contiguous()}
    if synthetic.correction_bias is not None:
        tensors[f"{prefix}.{layout.correction_bias}"] = synthetic.correction_bias
    gate, up, down = layout.projections
    for e in range(FP8_E):
        parts = {
            gate: (w.w13[e, :FP8_I], w.w13_scale[e, :blocks]),
            up: (w.w13[e, FP8_I:], w.w13_scale[e, blocks:]),
            down: (w.w2[e], w.w2_scale[e]),
        }
        for name, (codes, scale) in parts.items():
            tensors[f"{prefix}.experts.{e}.{name}.weight"] = codes.contiguous()
            tensors[f"{prefix}.experts.{e}.{name}.weight_scale_inv"] = scale.to(scale_dtype).contiguous()
    keys = sorted(tensors)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
    for name, listed in shards.items():
        save_file({k: tensors[k] for k in listed}, str(folder / name))
    index = {"weight_map": {k: name for name, listed in shards.items() for k in listed}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(fp8_config(family)))
    return synthetic
