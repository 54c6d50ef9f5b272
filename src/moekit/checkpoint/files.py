"""Safetensors checkpoints: where each tensor lives, and reading a tensor or a cut of it.

Data flow: a path (a .safetensors file, a folder of them, or a folder with model.safetensors.index.json)
-> `resolve`: key -> file map from the index or from each file's header (no tensor data read) ->
`check_sources`: a key stored in two files, or in another file than the index names, is refused ->
`open_file(...).get_slice(key)` for headers, `read_cut` for data (a `moekit.parallel.Cut` reads only a
rank's bytes). Shared by the GPT-OSS loader (`loader.py`) and the per-expert Hugging Face loader
(`hf_loader.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moekit.errors import CheckpointError
from moekit.parallel import Cut

INDEX_FILE = "model.safetensors.index.json"
# The safetensors dtype names of the float tensors the loaders accept (biases, routers, experts, scales).
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class Files:
    """Where each key of a checkpoint lives; built from headers or the index only."""

    key_to_file: dict[str, Path]  # the file a key is read from: the index's entry, else the file holding it
    searched: str  # for error messages: which file(s) or index were searched
    holders: dict[str, list[Path]]  # every file whose header lists the key (index-listed files only)
    index: Path | None = None


def open_file(file: Path, *, device: str | torch.device = "cpu"):  # returns a safetensors handle
    """`safe_open` (reads the header only) with unreadable files reported as CheckpointError."""
    where = torch.device(device)
    where = "cpu" if where.type == "cpu" else str(where)  # safetensors refuses "cpu:0", which torch allows
    try:
        return safe_open(str(file), framework="pt", device=where)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"cannot read {file} as a safetensors file: {exc}") from exc


def read_keys(file: Path) -> list[str]:
    with open_file(file) as f:
        return list(f.keys())


def holders_of(files: list[Path]) -> dict[str, list[Path]]:
    holders: dict[str, list[Path]] = {}
    for file in files:
        for key in read_keys(file):
            holders.setdefault(key, []).append(file)
    return holders


def resolve(path: Path) -> Files:
    if path.is_file():
        return Files({k: path for k in read_keys(path)}, searched=str(path), holders={})
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint path {path} does not exist; give a .safetensors file or a directory of them"
        )
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, RecursionError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map': {exc!r}") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
        if outside:
            raise CheckpointError(
                f"{index} names shards outside {path}: {outside}; list files of that folder"
            )
        listed = [path / n for n in names]
        return Files(
            {k: path / v for k, v in weight_map.items()},
            searched=f"index {index} ({len(names)} files: {', '.join(names)})",
            holders=holders_of([f for f in listed if f.is_file()]),
            index=index,
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors file and no {INDEX_FILE}")
    holders = holders_of(files)
    return Files(
        {k: where[0] for k, where in holders.items()},
        searched=f"{len(files)} files in {path}: {', '.join(f.name for f in files)}",
        holders=holders,
    )


def check_sources(files: Files, keys: list[str]) -> None:
    """Each key of the layer is in exactly one file, and it is the file the index names (if any)."""
    for key in keys:
        where = files.holders.get(key, [])
        if len(where) > 1:
            said = f" (the index {files.index} names {files.key_to_file.get(key)})" if files.index else ""
            raise CheckpointError(
                f"tensor {key!r} is stored in {len(where)} files: {', '.join(map(str, where))}{said}; "
                "which copy is the model's is ambiguous. Remove the stale copy, or keep the checkpoint's "
                "shards in a folder of their own"
            )
        if files.index is None or not where:
            continue  # a single file, or a key no shard holds (reported as missing)
        named = files.key_to_file.get(key)
        if named != where[0]:
            listed = f"maps it to {named}" if named else "does not list it"
            raise CheckpointError(
                f"the index {files.index} {listed}, but tensor {key!r} is in {where[0]}; the index and the "
                "shards disagree. Regenerate the index from the shards"
            )


def read_headers(files: Files, keys: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Key -> (safetensors dtype name, shape) of every key, from the file headers only; a key no file
    holds, a listed file that does not exist, or a file that lacks a key its index names is refused."""
    missing = [k for k in keys if k not in files.key_to_file]
    if missing:
        shown = missing[:6] + (["..."] if len(missing) > 6 else [])
        raise CheckpointError(f"{len(missing)} tensor(s) of the layer missing in {files.searched}: {shown}")
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(files.key_to_file[key], []).append(key)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file, listed in by_file.items():
        if not file.is_file():
            raise CheckpointError(f"{file} (listed for {listed[:3]} in {files.searched}) does not exist")
        with open_file(file) as f:
            present = set(f.keys())
            for key in listed:
                if key not in present:
                    raise CheckpointError(
                        f"missing tensor {key!r}: the index names {file} but the file lacks it"
                    )
                meta = f.get_slice(key)
                found[key] = (meta.get_dtype(), tuple(meta.get_shape()))
    return found


def read_cut(  # noqa: ANN001 - a safetensors handle and a device
    f, key: str, cut: Cut | None, shape: tuple[int, ...], dtype: torch.dtype, device
) -> torch.Tensor:
    """The tensor `key`, or only its `cut` (`get_slice`: the other bytes are not read)."""
    if cut is None:
        return f.get_tensor(key)
    if cut.zeros:
        return torch.zeros(shape, dtype=dtype, device=device)
    view = f.get_slice(key)
    parts = [view[index] for index in cut.indices()]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=cut.dim)
    # On the CPU a slice may be a view into the whole tensor's memory map (safetensors 0.8 does this):
    # a compact copy, so that the rank holds only its share and the map can be dropped.
    if t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
    return t
