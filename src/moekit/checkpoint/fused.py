"""`FusedMoE` layers read from checkpoints: the bodies of `FusedMoE.from_gpt_oss_checkpoint` and
`FusedMoE.from_hf_checkpoint`. With `parallel`, the loader reads only this rank's share
(`moekit.parallel.RankShare`) and the layer is built from it without a second cut (`presharded`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.checkpoint.hf_loader import load_hf_moe_layer
from moekit.checkpoint.layer import CheckpointNaming
from moekit.checkpoint.loader import load_gpt_oss_layer
from moekit.errors import check_type
from moekit.parallel import Parallel, RankShare
from moekit.parallel.build import refused_in_construction
from moekit.planning.options import PlanOptions
from moekit.spec import MoESpec
from moekit.weights import ExpertWeights


@dataclass(frozen=True)
class CheckpointTensors:
    """What a checkpoint gives a layer: the whole layer's spec, the (share of the) weights, the router."""

    spec: MoESpec
    weights: ExpertWeights
    router_weight: torch.Tensor
    router_bias: torch.Tensor | None
    correction_bias: torch.Tensor | None


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


def _built(
    cls: type[torch.nn.Module],  # FusedMoE (not imported: it imports this module)
    read: Callable[[RankShare | None], CheckpointTensors],
    *,
    device: torch.device | str,
    options: PlanOptions | None,
    parallel: Parallel | None,
) -> torch.nn.Module:
    """The layer from what `read` returns for this rank's share; a rank whose read is refused (a file
    missing on its node) makes every rank of the group raise."""
    share = _share(parallel)
    with refused_in_construction(parallel):
        t = read(share)
    return cls(
        spec=t.spec,
        weights=t.weights,
        router_weight=t.router_weight,
        router_bias=t.router_bias,
        correction_bias=t.correction_bias,
        device=device,
        options=options,
        parallel=parallel,
        presharded=parallel is not None,
    )


def gpt_oss_checkpoint_layer(
    cls: type[torch.nn.Module],
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
    def read(share: RankShare | None) -> CheckpointTensors:
        loaded = load_gpt_oss_layer(path, layer=layer, naming=naming, device=device, share=share)
        spec = loaded.spec_for(top_k=top_k, act_dtype=act_dtype)
        return CheckpointTensors(spec, loaded.weights, loaded.router_weight, loaded.router_bias, None)

    return _built(cls, read, device=device, options=options, parallel=parallel)


def hf_checkpoint_layer(
    cls: type[torch.nn.Module],
    path: str | os.PathLike,
    layer: int,
    *,
    config: Mapping[str, object] | str | os.PathLike | None,
    device: torch.device | str,
    act_dtype: torch.dtype,
    options: PlanOptions | None,
    parallel: Parallel | None,
) -> torch.nn.Module:
    def read(share: RankShare | None) -> CheckpointTensors:
        loaded = load_hf_moe_layer(
            path, layer=layer, config=config, device=device, act_dtype=act_dtype, share=share
        )
        return CheckpointTensors(
            loaded.spec, loaded.weights, loaded.router_weight, None, loaded.correction_bias
        )

    return _built(cls, read, device=device, options=options, parallel=parallel)
