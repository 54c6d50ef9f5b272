"""Per-rank checkpoint reads: `load_gpt_oss_layer(share=...)` reads only a rank's bytes, the same bytes.

Data flow: a random GPT-OSS MXFP4 layer (E not divisible by N) -> `save_gpt_oss_layer` (both namings, one
file or a folder of two shards) -> for every rank r of N in {2, 3}, expert and tensor parallel:
`load_gpt_oss_layer(share=RankShare(mode, r, N))` through a spy on `safe_open` that counts the bytes each
`get_tensor` / `get_slice(...)[...]` returns -> compared bit for bit with the whole layer cut by
`expert_shard` / `tensor_shard` (what `FusedMoE(parallel=...)` does), and the bytes read with 1/N of the
layer's. Refusals fire before any data is read. One gloo run checks `FusedMoE.from_gpt_oss_checkpoint(
parallel=...)` against the layer built from the whole checkpoint: same spec, expert map and weights.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moekit import CheckpointError, FusedMoE, Parallel, SpecError, UnsupportedSpecError
from moekit.checkpoint import (
    CheckpointNaming,
    GptOssLayer,
    gpt_oss_layer_keys,
    gpt_oss_layer_tensors,
    gpt_oss_spec,
    load_gpt_oss_layer,
    save_gpt_oss_layer,
)
from moekit.errors import ArgumentError
from moekit.parallel import ParallelMode, RankShare, expert_shard, tensor_shard
from moekit.synthetic import random_layer
from safetensors_spy import spy_reads
from spawn_ranks import run_on_ranks

E, H, I = 5, 64, 192  # E divisible by neither 2 nor 3; I/2 = 96 and I/3 = 64 are whole MXFP4 blocks
LAYER = 1
EXPERT_ROLES = ("w13", "w13_scale", "b13", "w2", "w2_scale", "b2")


def _layer(seed: int = 0, *, e: int = E, i: int = I) -> GptOssLayer:
    spec = gpt_oss_spec(num_experts=e, hidden_size=H, intermediate_size=i, top_k=2)
    synthetic = random_layer(spec, seed=seed, weight_std=0.5)
    return GptOssLayer(
        weights=synthetic.weights,
        router_weight=synthetic.router_weight,
        router_bias=torch.randn(e, generator=torch.Generator().manual_seed(seed)).bfloat16(),
        naming=CheckpointNaming.HF,
        layer=LAYER,
    )


def _save(folder: Path, layer: GptOssLayer, naming: CheckpointNaming, *, two_shards: bool) -> Path:
    if not two_shards:
        return save_gpt_oss_layer(folder / "model.safetensors", layer, layer=LAYER, naming=naming)
    from safetensors.torch import save_file

    tensors = gpt_oss_layer_tensors(layer, layer=LAYER, naming=naming)
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[:4]}, str(folder / "a.safetensors"))
    save_file({k: tensors[k] for k in keys[4:]}, str(folder / "b.safetensors"))
    return folder


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int]]:
    return spy_reads(monkeypatch)


def _expected_share(whole: GptOssLayer, share: RankShare):
    spec = whole.spec_for(top_k=2)
    cut = expert_shard if share.mode is ParallelMode.EXPERT else tensor_shard
    return cut(spec, whole.weights, rank=share.rank, world_size=share.world_size)[1]


@pytest.mark.parametrize("two_shards", [False, True], ids=["one-file", "two-shards"])
@pytest.mark.parametrize("naming", list(CheckpointNaming), ids=[n.value for n in CheckpointNaming])
@pytest.mark.parametrize("mode", list(ParallelMode), ids=[m.value for m in ParallelMode])
@pytest.mark.parametrize("world", [2, 3])
def test_a_share_read_from_safetensors_is_the_whole_layer_cut(
    tmp_path: Path, reads, world: int, mode: ParallelMode, naming: CheckpointNaming, two_shards: bool
) -> None:
    path = _save(tmp_path, _layer(seed=world), naming, two_shards=two_shards)
    whole = load_gpt_oss_layer(path, layer=LAYER)
    keys = gpt_oss_layer_keys(naming=naming, layer=LAYER)
    full_bytes = sum(t.nbytes for t in whole.weights.tensors().values())
    router_bytes = whole.router_weight.nbytes + whole.router_bias.nbytes
    read_per_rank = []
    for rank in range(world):
        reads.clear()
        share = RankShare(mode, rank, world)
        got = load_gpt_oss_layer(path, layer=LAYER, share=share)
        expected = _expected_share(whole, share)
        assert got.share == share and got.weights.tensors().keys() == expected.tensors().keys()
        for name, t in expected.tensors().items():
            mine = getattr(got.weights, name)
            assert mine.dtype == t.dtype and torch.equal(mine, t), name
            assert mine.untyped_storage().nbytes() == mine.nbytes, f"{name} holds more than its share"
        assert torch.equal(got.router_weight, whole.router_weight)
        assert torch.equal(got.router_bias, whole.router_bias)
        assert got.spec_for(top_k=2) == whole.spec_for(top_k=2)  # the global spec, from a share
        by_key = {k: n for k, n in reads}
        assert len(by_key) == len(reads), "a tensor read twice"
        expert_read = sum(by_key.get(keys[r], 0) for r in EXPERT_ROLES)
        assert sum(by_key.values()) == expert_read + router_bytes
        # Exactly this rank's bytes: what it holds, but for a zero b2 made without reading.
        zero_b2 = mode is ParallelMode.TENSOR and rank > 0
        assert (
            expert_read
            == sum(t.nbytes for t in expected.tensors().values()) - zero_b2 * got.weights.b2.nbytes
        )
        read_per_rank.append(expert_read)
    assert sum(read_per_rank) == full_bytes  # each byte read by exactly one rank
    b2_bytes = whole.weights.b2.nbytes
    for rank, n in enumerate(read_per_rank):
        bound = -(-E // world) / E if mode is ParallelMode.EXPERT else 1 / world
        extra = b2_bytes if mode is ParallelMode.TENSOR and rank == 0 else 0
        assert n <= full_bytes * bound + extra, (rank, n, full_bytes)


def test_refusals_come_before_any_data_is_read(tmp_path: Path, reads) -> None:
    path = _save(tmp_path, _layer(), CheckpointNaming.HF, two_shards=False)
    cases = [
        (RankShare(ParallelMode.TENSOR, 0, 4), UnsupportedSpecError, r"I/N = 192/4 must be a multiple of 32"),
        (RankShare(ParallelMode.EXPERT, 0, 6), SpecError, r"num_experts E=5 < world_size N=6"),
    ]
    for share, error, match in cases:
        with pytest.raises(error, match=match):
            load_gpt_oss_layer(path, layer=LAYER, share=share)
    with pytest.raises(ArgumentError, match="share"):
        load_gpt_oss_layer(path, layer=LAYER, share=(ParallelMode.EXPERT, 0, 2))
    with pytest.raises(ArgumentError, match=r"rank=2 must be in \[0, world_size=2\)"):
        RankShare(ParallelMode.EXPERT, 2, 2)
    # The loader's own refusals still fire, and still first: a tensor in two files.
    dup = tmp_path / "dup"
    dup.mkdir()
    _save(dup, _layer(), CheckpointNaming.HF, two_shards=False)
    _save(dup, _layer(), CheckpointNaming.HF, two_shards=True)
    with pytest.raises(CheckpointError, match="stored in 2 files"):
        load_gpt_oss_layer(dup, layer=LAYER, share=RankShare(ParallelMode.EXPERT, 0, 2))
    assert reads == []


def test_a_share_is_not_a_checkpoint_layer(tmp_path: Path) -> None:
    path = _save(tmp_path, _layer(), CheckpointNaming.OPENAI, two_shards=False)
    share = load_gpt_oss_layer(path, layer=LAYER, share=RankShare(ParallelMode.EXPERT, 1, 2))
    with pytest.raises(CheckpointError, match="holds the share"):
        save_gpt_oss_layer(tmp_path / "out.safetensors", share, layer=LAYER, naming=CheckpointNaming.HF)


# ----- the layer: FusedMoE.from_gpt_oss_checkpoint(parallel=...) on gloo ranks ---------------------------
def _from_checkpoint_main(rank: int, world: int, *, path: str) -> None:
    whole = load_gpt_oss_layer(path, layer=LAYER)
    group = dist.group.WORLD
    for parallel in (Parallel.expert(group), Parallel.tensor(group)):
        got = FusedMoE.from_gpt_oss_checkpoint(
            path, LAYER, act_dtype=torch.float32, top_k=2, parallel=parallel
        )
        ref = FusedMoE(
            spec=whole.spec_for(top_k=2, act_dtype=torch.float32),
            weights=whole.weights,
            router_weight=whole.router_weight,
            router_bias=whole.router_bias,
            parallel=parallel,
        )
        assert got.spec == ref.spec
        assert (got.expert_map is None) == (ref.expert_map is None)
        assert got.expert_map is None or torch.equal(got.expert_map, ref.expert_map)
        for name, t in ref.weights.tensors().items():
            assert torch.equal(getattr(got.weights, name), t), (parallel.mode, name)
        x = torch.randn(7, H, generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(got(x), ref(x), rtol=0, atol=0)
    # A checkpoint one rank cannot read (missing on its node): every rank raises, none waits for it.
    mine = path if rank == 0 else f"{path}.missing"
    with pytest.raises(CheckpointError, match="does not exist" if rank == 1 else "another rank"):
        FusedMoE.from_gpt_oss_checkpoint(mine, LAYER, top_k=2, parallel=Parallel.expert(group))


def test_from_gpt_oss_checkpoint_reads_this_ranks_share(tmp_path: Path) -> None:
    path = _save(tmp_path, _layer(seed=4, e=3, i=128), CheckpointNaming.HF, two_shards=False)
    run_on_ranks(partial(_from_checkpoint_main, path=str(path)), 2, tmp_path)
