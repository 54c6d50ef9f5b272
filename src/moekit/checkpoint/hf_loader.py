"""One MoE layer of a Hugging Face checkpoint that stores each expert's projections as their own tensors
(Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, OLMoE, MiniMax-M2,
dots.llm1; bf16/fp16/fp32, or FP8: 128x128
`.weight_scale_inv` blocks (quant_method "fp8"), or llm-compressor's `.weight_scale` per channel, per
tensor or per 128x128 block (quant_method "compressed-tensors")).

Data flow:
  path (a folder with config.json and .safetensors files or an index; or a file, with config=)
  -> config.json -> `HfCheckpointFamily` (key names); a layer config.json makes dense is refused
  -> `files.resolve` (key -> file, headers only)
  -> `hf_config.expert_quantization`: how quantization_config stores this layer's experts (None: float)
  -> the layer's keys: E experts x (gate, up, down) [+ their scales], the router
     `gate.weight` [+ the correction bias: `gate.e_score_correction_bias`, MiniMax-M2's
     `e_score_correction_bias` on the block]; a layer without experts, experts beyond the
     config's E, or other tensors in the block (not the shared experts) are refused
  -> header pass: the experts stored as quantization_config says (F8_E4M3 under FP8, else a float), the
     router float; every key present, in one file, of the right dtype and of the shape config.json gives
  -> `spec_from_checkpoint_config` -> the whole layer's `MoESpec`
  -> [share (`moekit.parallel.RankShare`): `plan_shard` cuts the spec, refusals before any data]
  -> data pass (`hf_stacked`): each `ExpertWeights` field is the per-expert tensors stacked (w13 = gate
     rows then up rows, CONCAT; w2 = down), read piece by piece with `get_slice` into one preallocated
     tensor, only the rows and columns the share's `Cut` keeps: an expert-parallel rank reads its
     experts' tensors and no other, a tensor-parallel rank its I/N rows of gate and up (and their
     per-row scales) and I/N columns of down; per-channel and per-tensor scales become PER_CHANNEL [E, N]
  -> FP8 scales checked finite and > 0 -> `HfCheckpointLayer` (spec, weights, router, correction bias, and
     the names of the shared-expert tensors the model adds beside the routed experts).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.checkpoint.files import FLOAT_DTYPES, Files, check_sources, open_file, read_headers, resolve
from moekit.checkpoint.hf_config import (
    CONFIG_FILE,
    HfCheckpointFamily,
    dense_layer_reason,
    expert_quantization,
    num_experts_of,
    read_config,
    spec_from_checkpoint_config,
    stored_format,
)
from moekit.checkpoint.hf_quant import ExpertQuantization
from moekit.checkpoint.hf_stacked import check_codes, check_scales, per_row, read_stacked, stacked_fields
from moekit.checks import check_router_tensor
from moekit.errors import ArgumentError, CheckpointError, SpecError, check_bool, check_type
from moekit.kernels.base import DeviceInfo, parse_device
from moekit.parallel import Cut, RankShare, plan_shard
from moekit.spec import GateLayout, MoESpec
from moekit.weights import ExpertWeights

_FP8 = {"F8_E4M3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class HfCheckpointLayer:
    """One MoE layer of a per-expert Hugging Face checkpoint: the routed experts and their router.

    `spec` is the whole layer's (all E experts, the full I); with `share`, `weights` are that rank's
    share of it (`plan_shard`'s cut). `shared_expert_keys` names the tensors of the shared experts the
    model adds to this layer's output (DeepSeek-V3, Qwen2-MoE); moekit does not compute them."""

    family: HfCheckpointFamily
    layer: int
    spec: MoESpec
    weights: ExpertWeights
    router_weight: torch.Tensor  # [E, H]
    correction_bias: torch.Tensor | None  # [E] fp32: the SIGMOID_GROUPED families only
    shared_expert_keys: tuple[str, ...] = ()
    share: RankShare | None = None

    def __post_init__(self) -> None:
        check_type(
            "HfCheckpointLayer.spec", self.spec, MoESpec, fix="build it with spec_from_checkpoint_config"
        )
        check_type(
            "HfCheckpointLayer.weights", self.weights, ExpertWeights, fix="read it with load_hf_moe_layer"
        )
        check_type(
            "HfCheckpointLayer.share", self.share, RankShare, optional=True, fix="pass a RankShare or None"
        )
        local = self.spec
        if self.share is not None:  # the share's spec: E_r experts or I/N
            local = plan_shard(self.share, self.spec, stores_floats=self.weights.stores_floats).spec
        self.weights.validate(local)
        spec = self.spec
        check_router_tensor(self.router_weight, name="router_weight", shape=(spec.E, spec.H), spec=spec)
        if spec.routing.has_correction_bias:
            check_router_tensor(self.correction_bias, name="correction_bias", shape=(spec.E,), spec=spec)
        elif self.correction_bias is not None:
            raise SpecError(f"a correction_bias was given, but {spec.routing.method.name} routing has none")

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits `[T, E]` = x @ router_weight^T. DeepSeek-V2/V3's, GLM-4.5/4.7-Flash's and
        dots1's HF routers compute them in fp32 too; Mixtral's, Qwen's, OLMoE's and MiniMax-M2's in the
        model's dtype, so a bf16 HF model may pick another expert for a token whose top scores nearly
        tie."""
        return torch.nn.functional.linear(x.float(), self.router_weight.float())


def _load_config(path: Path, config: object) -> Mapping[str, object]:
    if isinstance(config, Mapping):
        return config
    if config is None:
        if not path.exists():
            raise CheckpointError(
                f"checkpoint path {path} does not exist; give the model's folder (its config.json and "
                ".safetensors files)"
            )
        if not path.is_dir():
            raise CheckpointError(
                f"{path} is a file: pass config= (the model's config.json as a path or a dict), since "
                "the layer's sizes and routing come from it"
            )
        config = path / CONFIG_FILE
    check_type("config", config, (str, os.PathLike), optional=True, fix="pass config.json's path or a dict")
    return read_config(Path(config))


def per_expert_family(path: str | os.PathLike) -> HfCheckpointFamily | None:
    """The family of a checkpoint folder whose config.json names a per-expert family; None for a file, a
    folder without config.json, or another model_type (GPT-OSS), which the GPT-OSS loader reads. An
    unreadable config.json is a CheckpointError, not a guess."""
    if not (Path(path) / CONFIG_FILE).is_file():
        return None
    model_type = _load_config(Path(path), None).get("model_type")
    return next((f for f in HfCheckpointFamily if f.value == model_type), None)


def _no_experts_error(
    files: Files, family: HfCheckpointFamily, layer: int, layers: list[int]
) -> CheckpointError:
    shown = f"{layers[0]}..{layers[-1]} ({len(layers)} layers)" if len(layers) > 4 else str(layers)
    block = family.layout.prefix(layer)
    fused = sorted(k for k in files.key_to_file if k.startswith(f"{block}.experts."))
    why = (
        f"the block stores its experts as fused tensors ({fused[:3]}), not one tensor per expert as "
        f"{family.value} checkpoints do; save the model in its original per-expert format"
        if fused
        else "a dense layer, e.g. DeepSeek-V3's first first_k_dense_replace layers, has no experts to run"
    )
    return CheckpointError(
        f"layer {layer} has no routed experts ('{block}.experts.*') in {files.searched}; MoE layers found: "
        f"{shown} ({why})"
    )


def _check_declared_format(key: str, dtype: str, quant: ExpertQuantization | None) -> None:
    """The experts' stored dtype (of `key`) is the format config.json's quantization_config declares."""
    if quant is not None and dtype not in _FP8:
        raise CheckpointError(
            f"config.json's quantization_config ({quant.method}) declares FP8 (F8_E4M3) experts with "
            f"{quant.scale_suffix} scales, but tensor {key!r} is {dtype} (a dequantized checkpoint, or "
            "experts listed in modules_to_not_convert?); to read float experts, pass config= without "
            "quantization_config"
        )
    if quant is None and dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {key!r} is {dtype}, but config.json has no quantization_config that quantizes it "
            "(none, or one whose 'ignore' leaves these experts float) to say how to decode it; moekit reads "
            "F32, BF16 or F16 experts as they are, and F8_E4M3 ones under "
            "quantization_config {quant_method 'fp8', weight_block_size [128, 128]} (.weight_scale_inv) or "
            "quant_method 'compressed-tensors' (.weight_scale): add the checkpoint's quantization_config"
        )


def _moe_layers(files: Files, family: HfCheckpointFamily) -> dict[int, set[int]]:
    """Layer -> the expert ids its keys mention, for every layer with routed experts."""
    block = re.escape(family.layout.block).replace(re.escape("{l}"), r"(\d+)")
    pattern = re.compile(rf"^{block}\.experts\.(\d+)\.")
    found: dict[int, set[int]] = {}
    for key in files.key_to_file:
        if m := pattern.match(key):
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return found


def _layer_keys(
    family: HfCheckpointFamily, layer: int, quant: ExpertQuantization | None
) -> tuple[dict[str, str], dict[str, str]]:
    """(expert templates by role, router keys by role) of the layer; templates hold `{e}`."""
    prefix = family.layout.prefix(layer)
    roles = ("gate", "up", "down")
    experts = {
        role: f"{prefix}.experts.{{e}}.{name}.weight"
        for role, name in zip(roles, family.layout.projections, strict=True)
    }
    if quant is not None:
        suffix = quant.scale_suffix
        experts.update({f"{r}_scale": t.removesuffix(".weight") + suffix for r, t in list(experts.items())})
    router = {"router_weight": f"{prefix}.gate.weight"}
    if family.layout.correction_bias is not None:  # the router's (DeepSeek-V3) or the block's (MiniMax-M2)
        router["correction_bias"] = f"{prefix}.{family.layout.correction_bias}"
    return experts, router


def _weight_shapes(spec: MoESpec) -> dict[str, tuple[int, int]]:
    """Role -> one expert's [out, in] projection."""
    return {"gate": (spec.I, spec.H), "up": (spec.I, spec.H), "down": (spec.H, spec.I)}


def _expected_shapes(
    spec: MoESpec, quant: ExpertQuantization | None
) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Role -> the shapes one expert's tensor (or the router's) may have as stored."""
    weights = _weight_shapes(spec)
    shapes = {role: (shape,) for role, shape in weights.items()}
    if quant is not None:
        shapes |= {f"{role}_scale": quant.stored.shapes(*shape) for role, shape in weights.items()}
    return shapes | {"router_weight": ((spec.E, spec.H),), "correction_bias": ((spec.E,),)}


def _check_header(
    role: str,
    key: str,
    header: tuple[str, tuple[int, ...]],
    want: tuple[tuple[int, ...], ...],
    *,
    dtypes: dict[str, torch.dtype],
    sizes: str,
) -> torch.dtype:
    dtype, shape = header
    if dtype not in dtypes:
        raise CheckpointError(f"tensor {key!r} has dtype {dtype}, expected one of {sorted(dtypes)}")
    if shape not in want:
        shown = " or ".join(str(list(w)) for w in want)
        raise CheckpointError(f"tensor {key!r} has shape {list(shape)}, expected {shown} ({sizes})")
    return dtypes[dtype]


def _block_tensors(files: Files, family: HfCheckpointFamily, layer: int) -> list[str]:
    prefix = family.layout.prefix(layer) + "."
    return sorted(k for k in files.key_to_file if k.startswith(prefix))


def hf_moe_layers(
    path: str | os.PathLike, *, config: Mapping[str, object] | str | os.PathLike | None = None
) -> list[int]:
    """The layers `load_hf_moe_layer` reads: those whose experts the files hold and config.json does not
    make dense, from the headers only (to build every MoE layer of a model: one call a layer)."""
    check_type("path", path, (str, os.PathLike), fix="pass the checkpoint's folder as a str or Path")
    config = _load_config(Path(path), config)
    family = HfCheckpointFamily.of_config(config)
    layers = _moe_layers(resolve(Path(path)), family)
    return sorted(layer for layer in layers if dense_layer_reason(family, config, layer) is None)


def load_hf_moe_layer(
    path: str | os.PathLike,
    *,
    layer: int,
    config: Mapping[str, object] | str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    act_dtype: torch.dtype = torch.bfloat16,
    share: RankShare | None = None,
    allow_extra_tensors: bool = False,
) -> HfCheckpointLayer:
    """Read the routed experts and the router of MoE layer `layer` (and nothing else) of a per-expert
    Hugging Face checkpoint (module docstring); `config` defaults to the folder's config.json.

    `share`: read only that rank's share (`moekit.parallel.RankShare`: the bytes `shard_for` would keep
    of the whole layer) and the whole router. Refused (CheckpointError) before any tensor data is read: a
    layer without experts or one config.json makes dense, experts missing or beyond the config's E,
    experts stored in another format than quantization_config declares, a tensor of the wrong dtype or
    shape, a tensor in two files, and (unless `allow_extra_tensors`) tensors of the block that would not
    be read, other than the shared experts'."""
    check_type("path", path, (str, os.PathLike), fix="pass the checkpoint's folder as a str or Path")
    check_type("share", share, RankShare, optional=True, fix="pass moekit.parallel.RankShare(mode, rank, N)")
    check_bool("allow_extra_tensors", allow_extra_tensors, error=ArgumentError)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise CheckpointError(f"layer must be an int >= 0, got {layer!r}")
    DeviceInfo.of(device)  # a device moekit cannot load onto is refused before any file is opened
    dev = parse_device(device)
    config = _load_config(Path(path), config)
    family = HfCheckpointFamily.of_config(config)
    dense = dense_layer_reason(family, config, layer)
    if dense is not None:  # the model runs a dense MLP there, even if the files hold experts for it
        raise CheckpointError(
            f"layer {layer} is a dense MLP layer by config.json ({dense}), so the model routes no experts "
            "there; pick a MoE layer"
        )
    files = resolve(Path(path))
    layers = _moe_layers(files, family)
    if layer not in layers:
        raise _no_experts_error(files, family, layer, sorted(layers))
    num_experts = num_experts_of(family, config)
    have = layers[layer]
    beyond = sorted(e for e in have if e >= num_experts)
    if beyond:
        raise CheckpointError(
            f"layer {layer} holds experts {beyond[:8]} but config.json says E={num_experts}; the config "
            "and the checkpoint disagree"
        )
    if len(have) < num_experts:  # whole experts absent: one line, not E x 3 keys (E may be huge)
        absent = list(itertools.islice((e for e in range(num_experts) if e not in have), 8))
        more = "..." if num_experts - len(have) > len(absent) else ""
        raise CheckpointError(
            f"layer {layer} holds no tensor of experts {absent}{more} ({num_experts - len(have)} of the E="
            f"{num_experts} config.json says) in {files.searched}; the config and the checkpoint disagree"
        )
    quant = expert_quantization(family, config, layer)
    templates, router_keys = _layer_keys(family, layer, quant)
    expert_keys = [t.format(e=e) for e in range(num_experts) for t in templates.values()]
    read = [*expert_keys, *router_keys.values()]
    shared_prefixes = tuple(family.layout.prefix(layer) + "." + p for p in family.layout.shared_prefixes)
    block = _block_tensors(files, family, layer)
    shared = tuple(k for k in block if k.startswith(shared_prefixes))
    extra = sorted(set(block) - set(read) - set(shared))
    check_sources(files, [*read, *extra])
    gate0 = templates["gate"].format(e=0)
    stored_dtype = read_headers(files, [gate0])[gate0][0]
    _check_declared_format(gate0, stored_dtype, quant)  # before the scales' absence or presence is judged
    headers = read_headers(files, read)
    router_dtype = headers[router_keys["router_weight"]][0]
    if router_dtype in _FP8:
        raise CheckpointError(
            f"the router {router_keys['router_weight']!r} is stored {router_dtype}: moekit reads the router "
            "as float (llm-compressor keeps it so when quantization_config's 'ignore' lists it, e.g. "
            "'re:.*mlp.gate$'); quantize the model again with the router ignored"
        )
    if extra and not allow_extra_tensors:
        raise CheckpointError(
            f"layer {layer} holds tensors the loader would not read: {extra[:8]} ({len(extra)} in all) in "
            f"{files.searched}; they would be silently ignored (another quantization's scales?). Remove "
            "them, or pass allow_extra_tensors=True to read only the experts and the router"
        )
    stored = stored_format(quant, FLOAT_DTYPES.get(stored_dtype))
    spec = spec_from_checkpoint_config(family, config, stored, act_dtype=act_dtype)
    expected = _expected_shapes(spec, quant)
    sizes = (
        f"E = {spec.E}, H = hidden_size = {spec.H}, "
        f"I = {family.layout.intermediate_field} = {spec.I} in config.json"
    )
    weight_dtypes = _FP8 if quant is not None else {stored_dtype: FLOAT_DTYPES[stored_dtype]}
    dtypes: dict[str, torch.dtype] = {}
    for role, template in templates.items():
        allowed = FLOAT_DTYPES if role.endswith("_scale") else weight_dtypes
        for e in range(num_experts):
            key = template.format(e=e)
            dtypes[role] = _check_header(role, key, headers[key], expected[role], dtypes=allowed, sizes=sizes)
    for role, key in router_keys.items():
        dtypes[role] = _check_header(
            role, key, headers[key], expected[role], dtypes=FLOAT_DTYPES, sizes=sizes
        )
    # The share's refusals come here, before any data is read.
    cuts = {} if share is None else plan_shard(share, spec, stores_floats=quant is None).cuts
    experts = list(range(num_experts))
    if "w13" in cuts and cuts["w13"].dim == 0:  # expert parallelism: this rank's experts only
        experts = [e for start, n in cuts["w13"].segments for e in range(start, start + n)]
    fields = stacked_fields(templates, _weight_shapes(spec), dtypes["gate"], quant)
    with ExitStack() as stack:
        tensors = {
            name: read_stacked(stack, files, field, experts, _within(cuts.get(name)), dev)
            for name, field in fields.items()
        }
        router = {}
        for role, key in router_keys.items():
            handle = stack.enter_context(open_file(files.key_to_file[key], device=dev))
            router[role] = handle.get_tensor(key)
    if quant is not None:
        for name in ("w13", "w2"):
            check_codes(fields[name], tensors[name], experts, _within(cuts.get(name)))
        for name in ("w13_scale", "w2_scale"):
            check_scales(fields[name], tensors[name], experts, _within(cuts.get(name)))
            tensors[name] = per_row(tensors[name], quant)
    weights = ExpertWeights(
        format=spec.weight_format,
        gate_layout=GateLayout.CONCAT,
        fp8_scale=spec.fp8_scale,
        **tensors,
    )
    return HfCheckpointLayer(
        family=family,
        layer=layer,
        spec=spec,
        weights=weights,
        router_weight=router["router_weight"],
        correction_bias=router.get("correction_bias"),
        shared_expert_keys=shared,
        share=share,
    )


def _within(cut: Cut | None) -> Cut | None:
    """The cut within each expert (expert parallelism picks experts, `read_stacked` reads them whole)."""
    return None if cut is None or cut.dim == 0 else cut
