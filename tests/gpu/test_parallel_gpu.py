"""Expert and tensor parallelism on 2 CUDA GPUs over NCCL, every preset at full size: N ranks == 1 rank.

Data flow: spawn 2 ranks (NCCL, GPU = rank) -> per preset: the global random layer drawn on each GPU
(same seed, so the same weights) -> the 1-rank layer, the expert-parallel share (engine chosen per bucket,
then each engine named) and the tensor-parallel share -> a global batch drawn the same on every rank:
EP ranks take uneven slices of it (one rank's slice is empty in one case), TP ranks all pass it whole ->
each output against the 1-rank layer's rows on the same GPU, within `tolerance(spec)`. Then a CUDA graph
of the EP layer captured at one T on both ranks, replayed on new tokens, equal to eager to the bit. Then
a gpt-oss-20b checkpoint read per rank (EP and TP) onto each GPU, against the layer read whole.
Expected runtime on 2 H200s: about two and a half minutes (compiles for five presets, 11 GB of FP8 experts).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpu_only import skip_unless_compiled_gpu
from spawn_ranks import run_on_ranks

skip_unless_compiled_gpu()

from moekit import EpEngine, FusedMoE, Parallel, preset  # noqa: E402
from moekit.checkpoint import CheckpointNaming, GptOssLayer, save_gpt_oss_layer  # noqa: E402
from moekit.presets import PRESETS  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.synthetic import random_layer, random_tokens  # noqa: E402

pytestmark = pytest.mark.gpu
WORLD = 2
# (tokens of rank 0, tokens of rank 1): uneven, one rank empty, a prefill-sized pair.
EP_SPLITS = ((37, 200), (0, 64), (1500, 2600))
TP_TOKENS = (1, 300)


def _check(name: str, rank: int) -> list[str]:
    spec = preset(name)
    device = torch.device("cuda", rank)
    layer = random_layer(spec, seed=7, device=device)
    common = dict(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        correction_bias=layer.correction_bias,
        device=device,
    )
    one = FusedMoE(**common)
    group = dist.group.WORLD
    lines, tol = [], tolerance(spec)
    for engine in (None, *EpEngine):
        ep = FusedMoE(**common, parallel=Parallel.expert(group, engine=engine))
        for split in EP_SPLITS:
            x = random_tokens(spec, sum(split), seed=sum(split), device=device)
            start = sum(split[:rank])
            mine = x[start : start + split[rank]]
            got, want = ep(mine), one(x)[start : start + split[rank]]
            err = relative_l2_error(got, want) if split[rank] else 0.0
            lines.append(f"{name} EP {engine} {split}: rank {rank} rel L2 vs 1 rank {err:.2e}")
            assert got.shape == mine.shape and err <= tol, lines[-1] + "\n" + ep.explain()
    tp = FusedMoE(**common, parallel=Parallel.tensor(group))
    for t in TP_TOKENS:
        x = random_tokens(spec, t, seed=t, device=device)
        err = relative_l2_error(tp(x), one(x))
        lines.append(f"{name} TP T={t}: rank {rank} rel L2 vs 1 rank {err:.2e}")
        assert err <= tol, lines[-1]
    return lines


def _rank_main(rank: int, world: int) -> None:
    del world
    for name in PRESETS:
        for line in _check(name, rank):
            print(line, flush=True)
        torch.cuda.empty_cache()
    _check_graph(rank)
    _check_checkpoint(rank)


def _check_checkpoint(rank: int) -> None:
    """Each rank reads only its share of a gpt-oss-20b checkpoint straight onto its GPU: EP and TP equal
    the 1-rank layer read whole."""
    spec = preset("gpt-oss-20b")
    device = torch.device("cuda", rank)
    path = Path(os.environ["MOEKIT_TEST_CKPT_DIR"]) / "gpt-oss-20b-layer0.safetensors"
    if rank == 0:
        layer = random_layer(spec, seed=21, device=device)
        saved = GptOssLayer(
            weights=layer.weights,
            router_weight=layer.router_weight,
            router_bias=(0.1 * torch.randn(spec.E, device=device)).to(torch.bfloat16),
            naming=CheckpointNaming.HF,
            layer=0,
        )
        save_gpt_oss_layer(path, saved, layer=0, naming=CheckpointNaming.HF)
    dist.barrier()
    one = FusedMoE.from_gpt_oss_checkpoint(path, 0, device=device)
    x = random_tokens(spec, 96, seed=rank, device=device)
    for parallel in (Parallel.expert(dist.group.WORLD), Parallel.tensor(dist.group.WORLD)):
        share = FusedMoE.from_gpt_oss_checkpoint(path, 0, device=device, parallel=parallel)
        err = relative_l2_error(share(x), one(x))
        print(f"checkpoint {parallel.mode.value}: rank {rank} rel L2 vs 1 rank {err:.2e}", flush=True)
        assert err <= tolerance(spec), err


def _check_graph(rank: int) -> None:
    """A captured EP forward (the same T on both ranks) replays to eager's bits on new tokens."""
    spec = preset("gpt-oss-120b")
    device = torch.device("cuda", rank)
    layer = random_layer(spec, seed=3, device=device)
    ep = FusedMoE(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        device=device,
        parallel=Parallel.expert(dist.group.WORLD),
    )
    ep.warmup(64)
    for t in (1, 64):
        static_x = random_tokens(spec, t, seed=rank, device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            ep(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            static_out = ep(static_x)
        static_x.copy_(random_tokens(spec, t, seed=10 + rank, device=device))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            eager = ep(static_x)
        assert torch.equal(static_out, eager), f"rank {rank} T={t}: graph replay != eager"
        print(f"EP graph T={t}: rank {rank} replay == eager", flush=True)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_every_preset_on_two_gpus_matches_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOEKIT_TEST_CKPT_DIR", str(tmp_path))  # spawned ranks inherit the environment
    run_on_ranks(_rank_main, WORLD, tmp_path, backend="nccl")
