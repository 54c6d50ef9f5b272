"""llm-compressor ("compressed-tensors") FP8 checkpoints written for tests, by hand with safetensors (the
compressed-tensors package does not import here), following what compressed-tensors 0.20.1 saves: each
quantized projection `.weight` float8_e4m3fn [out, in] and `.weight_scale` (channel [out, 1], tensor [1],
block [ceil(out/128), ceil(in/128)]) in the model's dtype, the router float, and a quantization_config
{quant_method "compressed-tensors", format "float-quantized", config_groups {group_0 {targets ["Linear"],
weights, input_activations}}, ignore [lm_head, the router]}.

Data flow: (family, weight strategy, activation strategy, scale dtype) -> `write_ct_checkpoint(folder,
...)` -> random FP8 codes and positive scales -> one .safetensors file + config.json -> a `CtFile` that
holds the codes and scales as written (per expert and projection) for the tests' hand computations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from moekit.checkpoint import HfCheckpointFamily

LAYER = 1  # a layer other than 0, so names carry a real layer index
ROUTERS = {HfCheckpointFamily.MIXTRAL: "re:.*block_sparse_moe.gate$"}  # others: "re:.*mlp.gate$"
SIZES = {"block": (320, 256), "channel": (64, 96), "tensor": (64, 96)}  # (H, I): block needs I/2 % 128 == 0
E = 5  # uneven over 2 expert-parallel ranks


def weights_args(strategy: str) -> dict:
    args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    args |= {"group_size": None, "actorder": None, "observer": "minmax"}
    if strategy == "block":
        args["block_structure"] = [128, 128]
    return args


def activation_args(strategy: str | None) -> dict | None:
    if strategy is None:
        return None  # weight-only FP8 (W8A16)
    group_size = 128 if strategy == "group" else None
    return {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": True,
        "group_size": group_size, "observer": None,
    }  # fmt: skip


def ct_quantization_config(family: HfCheckpointFamily, strategy: str, act: str | None) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": weights_args(strategy),
        "input_activations": activation_args(act),
        "output_activations": None,
        "format": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if act is not None else "naive-quantized",  # as 0.20.1 infers it
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", ROUTERS.get(family, "re:.*mlp.gate$")],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.1",
    }


def ct_config(family: HfCheckpointFamily, strategy: str, act: str | None) -> dict:
    h, i = SIZES[strategy]
    intermediate = "intermediate_size" if family is HfCheckpointFamily.MIXTRAL else "moe_intermediate_size"
    config = {"model_type": family.value, "hidden_size": h, intermediate: i, "num_hidden_layers": 2}
    config |= {"num_experts_per_tok": 2, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    config["quantization_config"] = ct_quantization_config(family, strategy, act)
    if family is HfCheckpointFamily.DEEPSEEK_V3:
        config |= {"n_routed_experts": E, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5}
        return config | {"first_k_dense_replace": LAYER}
    if family is HfCheckpointFamily.MIXTRAL:
        return config | {"num_local_experts": E}
    return config | {"num_experts": E, "norm_topk_prob": True}


@dataclass(frozen=True)
class CtFile:
    """What a written checkpoint holds: codes and scales by (expert, role), the router, the key names."""

    family: HfCheckpointFamily
    strategy: str
    codes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # float8_e4m3fn [out, in]
    scales: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # as stored
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # every key written

    def key(self, expert: int, role: str, suffix: str = "weight") -> str:
        proj = dict(zip(("gate", "up", "down"), self.family.layout.projections, strict=True))[role]
        return f"{self.family.layout.prefix(LAYER)}.experts.{expert}.{proj}.{suffix}"

    @property
    def router_key(self) -> str:
        return f"{self.family.layout.prefix(LAYER)}.gate.weight"

    def dequantized(self, expert: int, role: str) -> torch.Tensor:
        """codes x scale in fp32, the scale repeated over its rows / 128x128 block."""
        codes, scale = self.codes[expert, role].float(), self.scales[expert, role].float()
        if self.strategy == "block":
            scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[
                : codes.shape[0], : codes.shape[1]
            ]
        return codes * scale  # channel [out, 1], tensor [1] or [] broadcast over the codes


def _codes(out: int, inp: int, g: torch.Generator) -> torch.Tensor:
    """Random FP8 E4M3 codes over most of the range (no NaN: finite values cast)."""
    return (torch.randn(out, inp, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scale(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=g) * 4e-3 + 1e-4).to(dtype)


def write_ct_checkpoint(
    folder: Path,
    family: HfCheckpointFamily,
    strategy: str,
    act: str | None,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
    scalar_tensor_scales: bool = False,
    seed: int = 0,
) -> CtFile:
    """A random compressed-tensors FP8 layer `LAYER` of `family` in `folder` (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    h, i = SIZES[strategy]
    written = CtFile(family, strategy)
    prefix = family.layout.prefix(LAYER)
    written.tensors[written.router_key] = torch.randn(E, h, generator=g).to(torch.bfloat16)
    if family.layout.correction_bias:
        written.tensors[f"{prefix}.gate.e_score_correction_bias"] = torch.randn(E, generator=g) * 0.1
    for e in range(E):
        for role, (out, inp) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            codes = _codes(out, inp, g)
            shape = {"channel": (out, 1), "tensor": () if scalar_tensor_scales else (1,)}.get(
                strategy, (-(-out // 128), -(-inp // 128))
            )
            scale = _scale(shape, scale_dtype, g)
            written.codes[e, role], written.scales[e, role] = codes, scale
            written.tensors[written.key(e, role)] = codes
            written.tensors[written.key(e, role, "weight_scale")] = scale
    save_file(written.tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(ct_config(family, strategy, act)))
    return written
