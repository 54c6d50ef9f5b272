"""GPT-OSS MXFP4 checkpoints: the tensors of one MoE layer, their names, and writing them.

Data flow: `GptOssLayer` (MXFP4 + INTERLEAVED `ExpertWeights`, router weight and bias, checked when
built) -> `gpt_oss_layer_tensors` names its eight tensors as a `CheckpointNaming` does (one key per
role in `ROLES`) -> `save_gpt_oss_layer` writes them to a .safetensors file; `loader.py` reads them
back (the whole layer, or with `share` one rank's share of its experts). `GptOssLayer.spec_for(...)`
gives the whole layer's `MoESpec` (`gpt_oss_spec`).

Checkpoint facts, verified against public code (facts only, no code copied):
- openai/gpt-oss `gpt_oss/torch/weights.py`: keys `block.{l}.mlp.mlp1_weight.blocks` / `.scales`,
  `mlp1_bias`, `mlp2_weight.blocks` / `.scales`, `mlp2_bias`; blocks `[..., G, 16]` uint8 with the low
  nibble the even element; scales are E8M0 with bias 127 (it subtracts 127 and uses ldexp); the
  dequantized tensor is `[..., N, G*32]`, i.e. blocks are stored out-major `[E, N, G, 16]`.
- openai/gpt-oss `gpt_oss/torch/model.py`: `mlp1_weight [E, 2I, H]`, `mlp2_weight [E, H, I]`
  (einsum over the last, input, axis), router `gate` = Linear(H, E) with bias (weight `[E, H]`,
  bias `[E]`); swiglu takes gate = even columns `[..., ::2]`, up = odd `[..., 1::2]` (INTERLEAVED),
  gate clamped above at the limit, up on both sides, `(up + 1)`; alpha 1.702, limit 7.0; routing is
  top-k on the logits then softmax over the K values (TOPK_SOFTMAX); mlp2_bias is added per expert
  before the router weighting. Parameters (biases included) are bf16 in that model.
- huggingface/transformers `src/transformers/models/gpt_oss/convert_gpt_oss_weights_to_hf.py`: the
  MXFP4 export renames `block.{l}.mlp.mlp1_weight.blocks` -> `model.layers.{l}.mlp.experts.
  gate_up_proj_blocks` (`.scales` -> `_scales`), `mlp1_bias` -> `gate_up_proj_bias`, `mlp2_*` ->
  `down_proj_*`, `mlp.gate` -> `mlp.router`, and copies blocks and scales unchanged (same
  `[E, N, G, 16]` layout and +127 scale bias, no transpose, no gate/up reordering); every non-norm
  tensor, so the biases and the router, is cast to bf16.
- transformers 5.24 (installed) `integrations/mxfp4.py` (`_convert_moe_packed_tensors`: scales - 127,
  low nibble -> even column, result `[E, N, in]` then transposed to the `[E, in, N]` parameters of
  `GptOssExperts`) and `quantizers/quantizer_mxfp4.py` (expects `gate_up_proj_blocks/_scales`,
  `down_proj_blocks/_scales`). `tests/cpu/test_hf_parity.py` runs that dequantizer on moekit's blocks.
Biases and the router are accepted in fp32, bf16 or fp16 and kept as stored (the reference
accumulates in fp32).
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from moekit.checks import described
from moekit.errors import CheckpointError, DTypeError, LayoutMismatchError, ShapeError, check_type
from moekit.parallel import ParallelMode, RankShare, plan_shard
from moekit.spec import (
    ActivationSpec,
    GateLayout,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
)
from moekit.weights import ExpertWeights, WeightPacking

# The eight tensors of one layer, by role. The roles match `ExpertWeights` field names.
ROLES = ("w13", "w13_scale", "b13", "w2", "w2_scale", "b2", "router_weight", "router_bias")
# The dtypes a checkpoint stores the router (and the biases) in; the loader reads exactly these.
ROUTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointNaming(enum.Enum):
    """Tensor naming scheme of a GPT-OSS checkpoint."""

    OPENAI = "openai"  # original release: block.{l}.mlp.mlp1_weight.blocks ...
    HF = "hf"  # Hugging Face: model.layers.{l}.mlp.experts.gate_up_proj_blocks ...


_TEMPLATES: dict[CheckpointNaming, dict[str, str]] = {
    CheckpointNaming.OPENAI: {
        "w13": "block.{l}.mlp.mlp1_weight.blocks",
        "w13_scale": "block.{l}.mlp.mlp1_weight.scales",
        "b13": "block.{l}.mlp.mlp1_bias",
        "w2": "block.{l}.mlp.mlp2_weight.blocks",
        "w2_scale": "block.{l}.mlp.mlp2_weight.scales",
        "b2": "block.{l}.mlp.mlp2_bias",
        "router_weight": "block.{l}.mlp.gate.weight",
        "router_bias": "block.{l}.mlp.gate.bias",
    },
    CheckpointNaming.HF: {
        "w13": "model.layers.{l}.mlp.experts.gate_up_proj_blocks",
        "w13_scale": "model.layers.{l}.mlp.experts.gate_up_proj_scales",
        "b13": "model.layers.{l}.mlp.experts.gate_up_proj_bias",
        "w2": "model.layers.{l}.mlp.experts.down_proj_blocks",
        "w2_scale": "model.layers.{l}.mlp.experts.down_proj_scales",
        "b2": "model.layers.{l}.mlp.experts.down_proj_bias",
        "router_weight": "model.layers.{l}.mlp.router.weight",
        "router_bias": "model.layers.{l}.mlp.router.bias",
    },
}
# Any MLP tensor of a layer marks the layer as present (attention-only keys do not).
LAYER_PATTERNS = {
    CheckpointNaming.OPENAI: re.compile(r"^block\.(\d+)\.mlp\."),
    CheckpointNaming.HF: re.compile(r"^model\.layers\.(\d+)\.mlp\."),
}


def gpt_oss_layer_keys(*, naming: CheckpointNaming, layer: int) -> dict[str, str]:
    """Role (`ROLES`) -> checkpoint key of every tensor of MoE layer `layer` in `naming`."""
    if not isinstance(naming, CheckpointNaming):
        choices = [n.name for n in CheckpointNaming]
        raise CheckpointError(f"naming must be a CheckpointNaming ({choices}), got {naming!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise CheckpointError(f"layer must be an int >= 0, got {layer!r}")
    return {role: template.format(l=layer) for role, template in _TEMPLATES[naming].items()}


def gpt_oss_spec(
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    top_k: int = 4,
    act_dtype: torch.dtype = torch.bfloat16,
    activation: ActivationSpec | None = None,
) -> MoESpec:
    """The `MoESpec` of a GPT-OSS MoE layer of these sizes: MXFP4, INTERLEAVED, biases, TOPK_SOFTMAX;
    K=4 and SWIGLU_OAI alpha 1.702 limit 7.0 as both gpt-oss-20b and gpt-oss-120b use."""
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        weight_format=WeightFormat.MXFP4,
        act_dtype=act_dtype,
        activation=ActivationSpec.gpt_oss() if activation is None else activation,
        gate_layout=GateLayout.INTERLEAVED,
        has_bias=True,
        routing=RoutingSpec(RoutingMethod.TOPK_SOFTMAX),
    )


@dataclass(frozen=True)
class GptOssLayer:
    """One GPT-OSS MoE layer: MXFP4 experts (INTERLEAVED gate/up, with biases) and the router.

    With `share`, `weights` are one rank's share of the experts (`moekit.parallel.plan_shard`'s cut of
    the global layer); the router is always the whole layer's."""

    weights: ExpertWeights
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor  # [E]
    naming: CheckpointNaming
    layer: int
    share: RankShare | None = None

    def __post_init__(self) -> None:
        w = self.weights
        if not isinstance(w, ExpertWeights) or w.format is not WeightFormat.MXFP4:
            got = w.format.name if isinstance(w, ExpertWeights) else type(w).__name__
            raise DTypeError(
                f"GptOssLayer.weights must be MXFP4 ExpertWeights, got {got}; "
                "quantize with ExpertWeights.from_float(format=WeightFormat.MXFP4, ...)"
            )
        if w.packing is not WeightPacking.CHECKPOINT:
            raise LayoutMismatchError(
                f"GptOssLayer holds MXFP4 blocks and scales in CHECKPOINT packing, got {w.packing.name}; "
                "keep the loaded layer and derive other packings from layer.weights"
            )
        if w.gate_layout is not GateLayout.INTERLEAVED:
            raise LayoutMismatchError(
                f"GptOssLayer holds INTERLEAVED weights as GPT-OSS checkpoints store them, got "
                f"{w.gate_layout.name}; convert with weights.to_layout(GateLayout.INTERLEAVED)"
            )
        if not w.has_bias:
            raise ShapeError("GPT-OSS experts carry biases b13 [E, 2I] and b2 [E, H]; the weights have none")
        for name in ("router_weight", "router_bias"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype not in ROUTER_DTYPES:
                raise DTypeError(
                    f"GptOssLayer.{name} must be a float32, bfloat16 or float16 torch.Tensor, got "
                    f"{described(t)}; convert it, e.g. torch.as_tensor(value, dtype=torch.bfloat16)"
                )
        e, h = self.num_experts, w.H
        if tuple(self.router_weight.shape) != (e, h) or tuple(self.router_bias.shape) != (e,):
            raise ShapeError(
                f"router weight/bias have shapes {tuple(self.router_weight.shape)} / "
                f"{tuple(self.router_bias.shape)}, expected ({e}, {h}) / ({e},) for E={e}, H={h}"
            )
        if not isinstance(self.naming, CheckpointNaming):
            raise CheckpointError(f"GptOssLayer.naming must be a CheckpointNaming, got {self.naming!r}")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise CheckpointError(f"GptOssLayer.layer must be an int >= 0, got {self.layer!r}")
        if self.share is not None:
            if not isinstance(self.share, RankShare):
                raise CheckpointError(f"GptOssLayer.share must be a RankShare or None, got {self.share!r}")
            local = plan_shard(self.share, self.spec_for(top_k=1), stores_floats=False).spec
            if (w.num_experts, w.I) != (local.E_local, local.I):
                raise ShapeError(
                    f"GptOssLayer weights hold E={w.num_experts} experts of I={w.I}, but {self.share} of "
                    f"the E={e} layer holds E={local.E_local} of I={local.I}; read the share with "
                    "load_gpt_oss_layer(..., share=share)"
                )

    @property
    def num_experts(self) -> int:
        """E of the whole layer (the router's rows), whatever share of the experts `weights` hold."""
        return self.router_weight.shape[0] if self.share is not None else self.weights.num_experts

    @property
    def intermediate_size(self) -> int:
        """I of the whole layer (a tensor-parallel share holds I/N of it)."""
        tensor = self.share is not None and self.share.mode is ParallelMode.TENSOR
        return self.weights.I * (self.share.world_size if tensor else 1)

    def spec_for(
        self,
        *,
        top_k: int = 4,
        act_dtype: torch.dtype = torch.bfloat16,
        activation: ActivationSpec | None = None,
    ) -> MoESpec:
        """The `MoESpec` of the whole layer (`gpt_oss_spec`): E, H, I from the tensors (and the share)."""
        return gpt_oss_spec(
            num_experts=self.num_experts,
            hidden_size=self.weights.H,
            intermediate_size=self.intermediate_size,
            top_k=top_k,
            act_dtype=act_dtype,
            activation=activation,
        )

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits `[T, E]` = x @ router_weight^T + router_bias."""
        return torch.nn.functional.linear(x.float(), self.router_weight.float(), self.router_bias.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Role -> tensor, as `save_gpt_oss_layer` writes them (the whole layer: a share is refused)."""
        if self.share is not None:
            raise CheckpointError(
                f"this GptOssLayer holds the share {self.share} of layer {self.layer}, not the layer; "
                "load it without share= to write it"
            )
        router = {"router_weight": self.router_weight, "router_bias": self.router_bias}
        return {**self.weights.tensors(), **router}


def gpt_oss_layer_tensors(
    layer_obj_or_tensors: GptOssLayer | Mapping[str, torch.Tensor],
    *,
    layer: int,
    naming: CheckpointNaming,
) -> dict[str, torch.Tensor]:
    """Checkpoint key -> contiguous tensor for one layer; merge several layers' dicts to build a model file.

    A mapping must hold exactly the roles in `ROLES` (the `ExpertWeights` field names plus
    `router_weight` and `router_bias`), each a tensor; it is written as given, unchecked beyond that.
    """
    if isinstance(layer_obj_or_tensors, GptOssLayer):
        by_role = layer_obj_or_tensors.tensors()
    elif isinstance(layer_obj_or_tensors, Mapping):
        by_role = dict(layer_obj_or_tensors)
    else:
        got = type(layer_obj_or_tensors).__name__
        raise CheckpointError(f"expected a GptOssLayer or a role -> tensor mapping, got {got}")
    if set(by_role) != set(ROLES):
        raise CheckpointError(
            f"a GPT-OSS layer has exactly the tensors {list(ROLES)}; missing "
            f"{sorted(set(ROLES) - set(by_role))}, unexpected {sorted(set(by_role) - set(ROLES))}"
        )
    for role in ROLES:
        if not isinstance(by_role[role], torch.Tensor):
            raise DTypeError(
                f"layer_obj_or_tensors[{role!r}] must be a torch.Tensor, got {described(by_role[role])}; "
                "pass the layer's tensors (GptOssLayer.tensors()) or the GptOssLayer itself"
            )
    keys = gpt_oss_layer_keys(naming=naming, layer=layer)
    return {keys[role]: by_role[role].detach().to("cpu").contiguous() for role in ROLES}


def save_gpt_oss_layer(
    path: str | Path,
    layer_obj_or_tensors: GptOssLayer | Mapping[str, torch.Tensor],
    *,
    layer: int,
    naming: CheckpointNaming,
) -> Path:
    """Write one layer's tensors to a .safetensors file named as `naming` does; returns the path."""
    check_type("path", path, (str, os.PathLike), fix="pass the file to write as a str or Path")
    tensors = gpt_oss_layer_tensors(layer_obj_or_tensors, layer=layer, naming=naming)
    path = Path(path)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
