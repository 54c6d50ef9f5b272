"""GPT-OSS MXFP4 checkpoints: read one MoE layer, and refuse a checkpoint that is ambiguous about it.

Data flow:
  path (a .safetensors file, a directory of them, or a directory with model.safetensors.index.json)
  -> `_resolve`: key -> file map, from the index or from each file's header (no tensor data read)
  -> naming detected (or given), layer checked against the layers present
  -> `_check_sources`: each of the layer's tensors in exactly one file, the one the index names;
     `_unexpected`: no other MoE tensor of the layer (unless allowed)
  -> header pass: every key of the layer present, dtype and shape checked with `get_slice` metadata,
     sizes E, H, I taken by majority over the eight tensors so the one wrong tensor is the one named
  -> [share (`moekit.parallel.RankShare`): `plan_shard` cuts the global spec (refusals here, before any
     data is read)]
  -> data pass: `safe_open(...).get_tensor` for exactly these eight keys, nothing else; with a share,
     `get_slice(key)[cut]` for the expert tensors, so only this rank's bytes are read and held (1/N:
     its experts, or its I/N rows and columns), a zero b2 off rank 0 made without reading, the router
     whole. From a memory-mapped file the OS reads whole pages: an expert cut and w13's row cut are
     contiguous runs, but w2's column cut (tensor parallelism) takes part of every row, so where a row
     is shorter than a page every page of w2 is touched; the rank still holds only its 1/N.
  -> E8M0 scale bytes checked for 0xFF (NaN) -> `GptOssLayer` (MXFP4 + INTERLEAVED `ExpertWeights`,
     router weight and bias) -> `GptOssLayer.spec_for(...)` gives the matching `MoESpec`.
With a share, the scale bytes checked are the share's: each rank checks what it reads.

Nothing is chosen silently: a tensor of the layer stored in two files, an index that disagrees with
its shards, or MoE tensors of the layer that would not be read (another copy or format of the
experts, the layer under the other naming) are refused with the tensor and the files named.
The names, the layouts and the facts they rest on are in `layer.py`.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch

from moekit.checkpoint.files import (
    FLOAT_DTYPES,
    Files,
    check_sources,
    open_file,
    read_cut,
    read_headers,
    resolve,
)
from moekit.checkpoint.layer import (
    LAYER_PATTERNS,
    ROLES,
    CheckpointNaming,
    GptOssLayer,
    gpt_oss_layer_keys,
    gpt_oss_spec,
)
from moekit.errors import ArgumentError, CheckpointError, FormatError, check_bool, check_type
from moekit.formats import check_mxfp4_scales, mxfp4_groups
from moekit.kernels.base import DeviceInfo
from moekit.parallel import RankShare, ShardPlan, plan_shard
from moekit.spec import GateLayout, WeightFormat
from moekit.weights import ExpertWeights

_UINT8_ROLES = frozenset({"w13", "w13_scale", "w2", "w2_scale"})


def _unexpected(files: Files, keys: dict[str, str], naming: CheckpointNaming, layer: int) -> list[str]:
    """Tensors of this layer's MoE block that the loader would not read: another copy or format of
    the experts (e.g. dequantized `gate_up_proj` beside `gate_up_proj_blocks`), or the same layer under
    the other naming. Only the OpenAI block's own norm (`block.{l}.mlp.norm.scale`) is expected."""
    expected = {*keys.values(), f"block.{layer}.mlp.norm.scale"}
    return sorted(
        k
        for other in CheckpointNaming
        for k in files.key_to_file
        if k not in expected and (m := LAYER_PATTERNS[other].match(k)) and int(m.group(1)) == layer
    )


def _layers_of(keys: object, naming: CheckpointNaming) -> list[int]:
    pattern = LAYER_PATTERNS[naming]
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


def _detect_naming(files: Files) -> CheckpointNaming:
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
    if e is None or two_i is None or h is None:
        raise CheckpointError(f"cannot infer E, 2I, H from the tensor shapes {shapes}")
    if e < 1:
        raise CheckpointError(
            f"the layer's tensors have E={e} experts (shapes {shapes}); a layer needs at least one expert"
        )
    if two_i % 2 or two_i < 1 or h < 1:
        raise CheckpointError(
            f"the layer's tensors have 2I={two_i}, H={h} (shapes {shapes}); 2I must be even and both "
            "at least 1"
        )
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


def _check_headers(
    files: Files, keys: dict[str, str]
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """Check presence, dtype and shape of every key from the file headers; return shapes and dtypes."""
    missing = [k for k in keys.values() if k not in files.key_to_file]
    if missing:
        hint = ""
        if any(k.removesuffix("_blocks") in files.key_to_file for k in missing if k.endswith("_blocks")):
            hint = (
                " The checkpoint stores dequantized float experts instead; build the weights with "
                "ExpertWeights.from_float or moekit.integrations.transformers.convert."
            )
        raise CheckpointError(f"missing tensor(s) {missing} in {files.searched}.{hint}")
    headers = read_headers(files, list(keys.values()))
    shapes = {role: headers[key][1] for role, key in keys.items()}
    dtypes = {
        role: _check_dtype(role, key, headers[key][0], files.key_to_file[key]) for role, key in keys.items()
    }
    expected = _expected_shapes(shapes)
    e, two_i, h = expected["b13"] + expected["b2"][1:]
    for role in ROLES:
        if shapes[role] != expected[role]:
            raise CheckpointError(
                f"tensor {keys[role]!r} has shape {list(shapes[role])}, expected {list(expected[role])} "
                f"(E={e}, 2I={two_i}, H={h} agreed by the other tensors of the layer; MXFP4 blocks are "
                f"[E, N, ceil(in/32), 16], scales [E, N, ceil(in/32)]) in {files.searched}"
            )
    return shapes, dtypes


def _check_dtype(role: str, key: str, dtype: str, file: Path) -> torch.dtype:
    if role in _UINT8_ROLES:
        if dtype == "U8":
            return torch.uint8
        why = "blocks hold two E2M1 codes per byte" if role in ("w13", "w2") else "scales are E8M0 bytes"
        raise CheckpointError(f"tensor {key!r} in {file} has dtype {dtype}, expected U8 (uint8): MXFP4 {why}")
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {key!r} in {file} has dtype {dtype}, expected a float: one of {sorted(FLOAT_DTYPES)}"
        )
    return FLOAT_DTYPES[dtype]


def _share_plan(share: RankShare, shapes: dict[str, tuple[int, ...]]) -> ShardPlan:
    """The share's cuts of the layer whose (checked) shapes these are: `moekit.parallel.plan_shard`'s,
    so a rank reads exactly what `shard_for` would keep of the whole layer."""
    e, two_i = shapes["b13"]
    spec = gpt_oss_spec(num_experts=e, hidden_size=shapes["b2"][1], intermediate_size=two_i // 2, top_k=1)
    return plan_shard(share, spec, stores_floats=False)


# ----- public entry points ------------------------------------------------------------------------------
def load_gpt_oss_layer(
    path: str | Path,
    *,
    layer: int,
    naming: CheckpointNaming | None = None,
    device: str | torch.device = "cpu",
    allow_extra_tensors: bool = False,
    share: RankShare | None = None,
) -> GptOssLayer:
    """Read the MoE tensors of one layer (and nothing else) of a GPT-OSS MXFP4 checkpoint.

    Refused (CheckpointError): a tensor of the layer stored in two files, an index that disagrees
    with its shards, and, unless `allow_extra_tensors`, MoE tensors of the layer that would not be
    read (another copy or format of the experts, or the layer under the other naming).
    `share`: read only that rank's share of the experts (`moekit.parallel.RankShare`; the bytes
    `shard_for` would keep of the whole layer, bit for bit) and the whole router."""
    check_type("path", path, (str, os.PathLike), fix="pass the checkpoint's file or folder as a str or Path")
    check_type("share", share, RankShare, optional=True, fix="pass moekit.parallel.RankShare(mode, rank, N)")
    check_bool("allow_extra_tensors", allow_extra_tensors, error=ArgumentError)
    DeviceInfo.of(device)  # a device moekit cannot load onto is refused before any file is opened
    files = resolve(Path(path))
    if naming is None:
        naming = _detect_naming(files)
    keys = gpt_oss_layer_keys(naming=naming, layer=layer)
    layers = _layers_of(files.key_to_file, naming)
    if layer not in layers:
        raise CheckpointError(
            f"layer {layer} not found in {files.searched}; {naming.name}-named MoE layers found: "
            f"{_describe_layers(layers)}"
        )
    extra = _unexpected(files, keys, naming, layer)
    check_sources(files, [*keys.values(), *extra])
    shapes, dtypes = _check_headers(files, keys)  # missing tensors first: their message carries the hint
    if extra and not allow_extra_tensors:
        raise CheckpointError(
            f"layer {layer} holds MoE tensors beyond the eight {naming.name}-named ones it reads: {extra} "
            f"in {files.searched}; they would be silently ignored. Remove them, or pass "
            "allow_extra_tensors=True to read only the eight"
        )
    cuts = {} if share is None else _share_plan(share, shapes).cuts  # refusals before any data is read
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for role, key in keys.items():
        by_file.setdefault(files.key_to_file[key], []).append(role)
    for file, roles in by_file.items():
        with open_file(file, device=device) as f:
            for role in roles:
                tensors[role] = read_cut(f, keys[role], cuts.get(role), shapes[role], dtypes[role], device)
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
        share=share,
    )
