"""`FusedMoE` layers read from checkpoints: the bodies of `FusedMoE.from_gpt_oss_checkpoint` and
`FusedMoE.from_hf_checkpoint`. With `parallel`, the loader reads only this rank's share
(`moekit.parallel.RankShare`) and the layer is built from it without a second cut (`presharded`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from moekit.checkpoint.hf_loader import load_hf_moe_layer
from moekit.checkpoint.layer import CheckpointNaming
from moekit.checkpoint.loader import load_gpt_oss_layer
from moekit.errors import check_type
from moekit.parallel import Parallel, RankShare
from moekit.parallel.build import refused_in_construction
from moekit.planning.options import PlanOptions


def _share(parallel: Parallel | None) -> RankShare | None:
    """The share to read; a `parallel` of another type is refused before any file is read."""
    check_type(
        "parallel",
        parallel,
        Parallel,
        optional=True,
        fix="pass moekit.Parallel.expert(group) or .tensor(group)",
    )
    return None if parallel is None else RankShare.of(parallel)


def gpt_oss_checkpoint_layer(
    cls: type[torch.nn.Module],  # FusedMoE (not imported: it imports this module)
    path: str | Path,
    layer: int,
    *,
    device: torch.device | str,
    act_dtype: torch.dtype,
    top_k: int,
    naming: CheckpointNaming | None,
    options: PlanOptions | None,
    parallel: Parallel | None,
) -> torch.nn.Module:
    share = _share(parallel)
    with refused_in_construction(parallel):  # e.g. a file missing on one node: every rank raises
        loaded = load_gpt_oss_layer(path, layer=layer, naming=naming, device=device, share=share)
        spec = loaded.spec_for(top_k=top_k, act_dtype=act_dtype)
    return cls(
        spec=spec,
        weights=loaded.weights,
        router_weight=loaded.router_weight,
        router_bias=loaded.router_bias,
        device=device,
        options=options,
        parallel=parallel,
        presharded=parallel is not None,
    )


def hf_checkpoint_layer(
    cls: type[torch.nn.Module],  # FusedMoE (not imported: it imports this module)
    path: str | os.PathLike,
    layer: int,
    *,
    config: Mapping[str, object] | str | os.PathLike | None,
    device: torch.device | str,
    act_dtype: torch.dtype,
    options: PlanOptions | None,
    parallel: Parallel | None,
) -> torch.nn.Module:
    share = _share(parallel)
    with refused_in_construction(parallel):  # e.g. a file missing on one node: every rank raises
        loaded = load_hf_moe_layer(
            path, layer=layer, config=config, device=device, act_dtype=act_dtype, share=share
        )
    return cls(
        spec=loaded.spec,
        weights=loaded.weights,
        router_weight=loaded.router_weight,
        correction_bias=loaded.correction_bias,
        device=device,
        options=options,
        parallel=parallel,
        presharded=parallel is not None,
    )
