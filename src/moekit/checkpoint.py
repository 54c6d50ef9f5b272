"""GPT-OSS MXFP4 checkpoints: load (and, for tests and tools, save) one MoE layer at a time.

Data flow:
  path (a .safetensors file, a directory of them, or a directory with model.safetensors.index.json)
  -> `_resolve`: key -> file map, from the index or from each file's header (no tensor data read)
  -> naming detected (or given), layer checked against the layers present
  -> header pass: every key of the layer present, dtype and shape checked with `get_slice` metadata,
     sizes E, H, I taken by majority over the eight tensors so the one wrong tensor is the one named
  -> data pass: `safe_open(...).get_tensor` for exactly these eight keys, nothing else
  -> E8M0 scale bytes checked for 0xFF (NaN) -> `GptOssLayer` (MXFP4 + INTERLEAVED `ExpertWeights`,
     router weight and bias) -> `GptOssLayer.spec_for(...)` gives the matching `MoESpec`.

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
import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moekit.errors import CheckpointError, DTypeError, FormatError, LayoutMismatchError, ShapeError
from moekit.formats import check_mxfp4_scales, mxfp4_groups
from moekit.spec import (
    ActivationSpec,
    GateLayout,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
)
from moekit.weights import ExpertWeights, WeightPacking

INDEX_FILE = "model.safetensors.index.json"

# The eight tensors of one layer, by role. The roles match `ExpertWeights` field names.
ROLES = ("w13", "w13_scale", "b13", "w2", "w2_scale", "b2", "router_weight", "router_bias")
_UINT8_ROLES = frozenset({"w13", "w13_scale", "w2", "w2_scale"})
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


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
_LAYER_PATTERNS = {
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


@dataclass(frozen=True)
class GptOssLayer:
    """One GPT-OSS MoE layer: MXFP4 experts (INTERLEAVED gate/up, with biases) and the router."""

    weights: ExpertWeights
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor  # [E]
    naming: CheckpointNaming
    layer: int

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
        e, h = w.num_experts, w.H
        if tuple(self.router_weight.shape) != (e, h) or tuple(self.router_bias.shape) != (e,):
            raise ShapeError(
                f"router weight/bias have shapes {tuple(self.router_weight.shape)} / "
                f"{tuple(self.router_bias.shape)}, expected ({e}, {h}) / ({e},) for E={e}, H={h}"
            )
        if not isinstance(self.naming, CheckpointNaming):
            raise CheckpointError(f"GptOssLayer.naming must be a CheckpointNaming, got {self.naming!r}")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise CheckpointError(f"GptOssLayer.layer must be an int >= 0, got {self.layer!r}")

    def spec_for(
        self,
        *,
        top_k: int = 4,
        act_dtype: torch.dtype = torch.bfloat16,
        activation: ActivationSpec | None = None,
    ) -> MoESpec:
        """The `MoESpec` of this layer: E, H, I from the tensors; K=4 and SWIGLU_OAI alpha 1.702 limit 7.0
        as both gpt-oss-20b and gpt-oss-120b use (pass `top_k` / `activation` for other configs)."""
        return MoESpec(
            num_experts=self.weights.num_experts,
            top_k=top_k,
            hidden_size=self.weights.H,
            intermediate_size=self.weights.I,
            weight_format=WeightFormat.MXFP4,
            act_dtype=act_dtype,
            activation=ActivationSpec.gpt_oss() if activation is None else activation,
            gate_layout=GateLayout.INTERLEAVED,
            has_bias=True,
            routing=RoutingSpec(RoutingMethod.TOPK_SOFTMAX),
        )

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits `[T, E]` = x @ router_weight^T + router_bias."""
        return torch.nn.functional.linear(x.float(), self.router_weight.float(), self.router_bias.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Role -> tensor, as `save_gpt_oss_layer` writes them."""
        router = {"router_weight": self.router_weight, "router_bias": self.router_bias}
        return {**self.weights.tensors(), **router}


# ----- locating tensors ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Files:
    """Where each key of a checkpoint lives; built from headers or the index only."""

    key_to_file: dict[str, Path]
    searched: str  # for error messages: which file(s) or index were searched


def _open(file: Path, *, device: str | torch.device = "cpu"):  # returns a safetensors handle
    """`safe_open` (reads the header only) with unreadable files reported as CheckpointError."""
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"cannot read {file} as a safetensors file: {exc}") from exc


def _read_keys(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def _resolve(path: Path) -> _Files:
    if path.is_file():
        return _Files({k: path for k in _read_keys(path)}, searched=str(path))
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint path {path} does not exist; give a .safetensors file or a directory of them"
        )
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map': {exc}") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        return _Files(
            {k: path / v for k, v in weight_map.items()},
            searched=f"index {index} ({len(files)} files: {', '.join(files)})",
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors file and no {INDEX_FILE}")
    key_to_file: dict[str, Path] = {}
    for file in files:
        key_to_file.update({k: file for k in _read_keys(file)})
    return _Files(key_to_file, searched=f"{len(files)} files in {path}: {', '.join(f.name for f in files)}")


def _layers_of(keys: object, naming: CheckpointNaming) -> list[int]:
    pattern = _LAYER_PATTERNS[naming]
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


def _detect_naming(files: _Files) -> CheckpointNaming:
    present = [n for n in CheckpointNaming if _layers_of(files.key_to_file, n)]
    if len(present) == 1:
        return present[0]
    if not present:
        sample = sorted(files.key_to_file)[:5]
        raise CheckpointError(
            "no GPT-OSS MoE tensors ('block.{l}.mlp.*' or 'model.layers.{l}.mlp.*') in "
            f"{files.searched}; first keys: {sample}"
        )
    raise CheckpointError(
        f"{files.searched} holds tensors of both namings {[n.name for n in present]}; pass naming= explicitly"
    )


def _describe_layers(layers: list[int]) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 4:
        return f"{layers[0]}..{layers[-1]} ({len(layers)} layers)"
    return ", ".join(map(str, layers))


# ----- header checks ------------------------------------------------------------------------------------
def _majority(values: list[int | None]) -> int | None:
    counts = Counter(v for v in values if v is not None)
    return counts.most_common(1)[0][0] if counts else None


def _expected_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Expected shape per role; E, 2I, H by majority vote so a single wrong tensor is the one reported."""

    def dim(role: str, d: int) -> int | None:
        s = shapes[role]
        return s[d] if len(s) > d else None

    e = _majority([dim(r, 0) for r in ROLES])
    two_i = _majority([dim("w13", 1), dim("w13_scale", 1), dim("b13", 1)])
    h = _majority([dim("w2", 1), dim("w2_scale", 1), dim("b2", 1), dim("router_weight", 1)])
    if e is None or two_i is None or h is None or two_i % 2 or min(e, two_i, h) < 1:
        raise CheckpointError(f"cannot infer E, 2I, H from the tensor shapes {shapes}; 2I must be even")
    g_h, g_i = mxfp4_groups(h), mxfp4_groups(two_i // 2)
    return {
        "w13": (e, two_i, g_h, 16),
        "w13_scale": (e, two_i, g_h),
        "b13": (e, two_i),
        "w2": (e, h, g_i, 16),
        "w2_scale": (e, h, g_i),
        "b2": (e, h),
        "router_weight": (e, h),
        "router_bias": (e,),
    }


def _check_headers(files: _Files, keys: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Check presence, dtype and shape of every key from the file headers; return the shapes."""
    missing = [k for k in keys.values() if k not in files.key_to_file]
    if missing:
        hint = ""
        if any(k.removesuffix("_blocks") in files.key_to_file for k in missing if k.endswith("_blocks")):
            hint = (
                " The checkpoint stores dequantized float experts instead; build the weights with "
                "ExpertWeights.from_float or moekit.integrations.transformers.convert."
            )
        raise CheckpointError(f"missing tensor(s) {missing} in {files.searched}.{hint}")
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for role, key in keys.items():
        by_file.setdefault(files.key_to_file[key], []).append(role)
    for file, roles in by_file.items():
        if not file.is_file():
            listed = [keys[r] for r in roles]
            raise CheckpointError(f"{file} (listed for {listed} in {files.searched}) does not exist")
        with _open(file) as f:
            present = set(f.keys())
            for role in roles:
                key = keys[role]
                if key not in present:
                    raise CheckpointError(
                        f"missing tensor {key!r}: the index names {file} but the file lacks it"
                    )
                meta = f.get_slice(key)
                _check_dtype(role, key, meta.get_dtype(), file)
                shapes[role] = tuple(meta.get_shape())
    expected = _expected_shapes(shapes)
    e, two_i, h = expected["b13"] + expected["b2"][1:]
    for role in ROLES:
        if shapes[role] != expected[role]:
            raise CheckpointError(
                f"tensor {keys[role]!r} has shape {list(shapes[role])}, expected {list(expected[role])} "
                f"(E={e}, 2I={two_i}, H={h} agreed by the other tensors of the layer; MXFP4 blocks are "
                f"[E, N, ceil(in/32), 16], scales [E, N, ceil(in/32)]) in {files.searched}"
            )
    return shapes


def _check_dtype(role: str, key: str, dtype: str, file: Path) -> None:
    if role in _UINT8_ROLES:
        if dtype != "U8":
            why = "blocks hold two E2M1 codes per byte" if role in ("w13", "w2") else "scales are E8M0 bytes"
            raise CheckpointError(
                f"tensor {key!r} in {file} has dtype {dtype}, expected U8 (uint8): MXFP4 {why}"
            )
    elif dtype not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {key!r} in {file} has dtype {dtype}, expected a float: one of {sorted(_FLOAT_DTYPES)}"
        )


# ----- public entry points ------------------------------------------------------------------------------
def load_gpt_oss_layer(
    path: str | Path,
    *,
    layer: int,
    naming: CheckpointNaming | None = None,
    device: str | torch.device = "cpu",
) -> GptOssLayer:
    """Read the MoE tensors of one layer (and nothing else) of a GPT-OSS MXFP4 checkpoint."""
    files = _resolve(Path(path))
    if naming is None:
        naming = _detect_naming(files)
    keys = gpt_oss_layer_keys(naming=naming, layer=layer)
    layers = _layers_of(files.key_to_file, naming)
    if layer not in layers:
        raise CheckpointError(
            f"layer {layer} not found in {files.searched}; {naming.name}-named MoE layers found: "
            f"{_describe_layers(layers)}"
        )
    shapes = _check_headers(files, keys)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for role, key in keys.items():
        by_file.setdefault(files.key_to_file[key], []).append(role)
    for file, roles in by_file.items():
        with _open(file, device=device) as f:
            for role in roles:
                tensors[role] = f.get_tensor(keys[role])
    for role in ("w13_scale", "w2_scale"):
        try:
            check_mxfp4_scales(tensors[role], name=keys[role])
        except FormatError as exc:
            raise CheckpointError(str(exc)) from exc
    weights = ExpertWeights(
        format=WeightFormat.MXFP4,
        gate_layout=GateLayout.INTERLEAVED,
        w13=tensors["w13"],
        w13_scale=tensors["w13_scale"],
        w2=tensors["w2"],
        w2_scale=tensors["w2_scale"],
        b13=tensors["b13"],
        b2=tensors["b2"],
        hidden_size=shapes["w2"][1],
    )
    return GptOssLayer(
        weights=weights,
        router_weight=tensors["router_weight"],
        router_bias=tensors["router_bias"],
        naming=naming,
        layer=layer,
    )


def gpt_oss_layer_tensors(
    layer_obj_or_tensors: GptOssLayer | Mapping[str, torch.Tensor],
    *,
    layer: int,
    naming: CheckpointNaming,
) -> dict[str, torch.Tensor]:
    """Checkpoint key -> contiguous tensor for one layer; merge several layers' dicts to build a model file.

    A mapping must hold exactly the roles in `ROLES` (the `ExpertWeights` field names plus
    `router_weight` and `router_bias`); it is written as given, unchecked beyond that.
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
    tensors = gpt_oss_layer_tensors(layer_obj_or_tensors, layer=layer, naming=naming)
    path = Path(path)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
