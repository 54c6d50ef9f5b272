"""Hugging Face blocks on a parallel group: `fused_moe_from_hf` and `patch_model` with `parallel=`.

Data flow: pytest -> 2 gloo ranks (`spawn_ranks.run_on_ranks`) -> on each rank, the same tiny random
GPT-OSS, Qwen3-MoE, DeepSeek-V3 and Qwen2-MoE causal LMs (fp32; the last two with shared experts, which
every rank runs whole and adds once, after a tensor-parallel layer's all-reduce: added twice, or left
out, they would move the block's output far beyond the tolerance) -> for tensor parallelism (the same
tokens on every rank) and expert parallelism (each rank its own tokens, of its own count): the HF
block's output on this rank's tokens against `fused_moe_from_hf(block, parallel=...)`'s (plus the
block's shared experts), then `patch_model(model, parallel=...)`: the patched block and the whole
model's logits against the unpatched ones, a state_dict round trip, and `unpatch` giving the model
back. Held to `moekit.reference.tolerance(spec)`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from hf_tiny import randomize_correction_biases, shared_expert_config  # noqa: E402
from moekit import Parallel, ParallelMode, SpecError  # noqa: E402
from moekit.integrations.transformers import (  # noqa: E402
    Family,
    MoekitMoEBlock,
    fused_moe_from_hf,
    patch_model,
    unpatch,
)
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from spawn_ranks import run_on_ranks  # noqa: E402

H, I, E, VOCAB = 32, 48, 6, 40  # I/2 = 24 per tensor-parallel rank, E/2 = 3 experts per expert-parallel rank
_COMMON = dict(
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=VOCAB,
)


def _model(family: Family):
    if family.hf.shared is not None:
        dims = dict(hidden=H, intermediate=I, experts=E, top_k=2, layers=2, heads=2, kv_heads=1, head_dim=16)
        config = shared_expert_config(family, vocab=VOCAB, **dims)
    elif family is Family.GPT_OSS:
        config = transformers.GptOssConfig(
            intermediate_size=I, num_local_experts=E, num_experts_per_tok=2, **_COMMON
        )
    else:
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=I, intermediate_size=2 * I, num_experts=E, num_experts_per_tok=2, **_COMMON
        )
    torch.manual_seed(0)  # the same model on every rank
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # the default init (std 0.02) barely routes
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.2 if name.endswith("bias") else 0.4)
    randomize_correction_biases(model)
    return model


def _shared(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a block adds beside its routed experts (zero for a family without shared experts)."""
    if hasattr(block, "shared_experts"):
        return block.shared_experts(x)
    if hasattr(block, "shared_expert"):
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return torch.zeros_like(x)


def _hidden(result) -> torch.Tensor:  # noqa: ANN001 - a block's output: a tensor or (tensor, scores)
    return result[0] if isinstance(result, tuple) else result


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = relative_l2_error(got, want)
    assert err <= tol, f"{what}: rel L2 {err:.2e} > {tol:.0e}"


def _check(family: Family, parallel: Parallel) -> None:
    rank, tensor = parallel.rank, parallel.mode is ParallelMode.TENSOR
    seed = 11 if tensor else 20 + rank  # tensor parallel: the same tokens on every rank
    gen = torch.Generator().manual_seed(seed)
    tokens = 7 if tensor else 3 + 4 * rank  # expert parallel: each rank its own count
    x = torch.randn(1, tokens, H, generator=gen)
    ids = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    model = _model(family)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        want_block = _hidden(block(x))
        want_logits = model(ids).logits

        moe = fused_moe_from_hf(block, parallel=parallel)
        tol = tolerance(moe.spec)
        assert moe.parallel is parallel
        if tensor:
            assert moe.spec.I == I // 2 and moe.spec.E == E
        else:
            assert moe.spec.E_local == E // 2 and moe.spec.E == E
        routed = moe(x.reshape(-1, H)).reshape(x.shape)  # the routed experts: the block adds its shared ones
        _close(routed + _shared(block, x), want_block, tol, "fused_moe_from_hf")

        report = patch_model(model, parallel=parallel)
        assert not any(b.released_original for b in report.blocks)  # a share cannot rebuild the experts
        patched = model.model.layers[0].mlp
        assert isinstance(patched, MoekitMoEBlock) and patched.moe.parallel is parallel
        _close(_hidden(patched(x)), want_block, tol, "patched block")
        _close(model(ids).logits, want_logits, tol, "patched model")
        model.load_state_dict(model.state_dict())  # rebuilds each share from the whole experts
        assert model.model.layers[0].mlp.moe.spec == moe.spec
        _close(model(ids).logits, want_logits, tol, "patched model after load_state_dict")
        assert unpatch(model) == 2
        assert torch.equal(model(ids).logits, want_logits)


def _check_one_rank_refused(rank: int) -> None:
    """A block only rank 1 refuses to convert (not an HF MoE block there): every rank raises SpecError at
    construction, none waits in the group's agreement."""
    block = _model(Family.QWEN3_MOE).model.layers[0].mlp
    mine = block if rank == 0 else torch.nn.Linear(H, H)
    for parallel in (Parallel.tensor(dist.group.WORLD), Parallel.expert(dist.group.WORLD)):
        with pytest.raises(SpecError, match="not a supported" if rank == 1 else "another rank"):
            fused_moe_from_hf(mine, parallel=parallel)


def _rank_main(rank: int, world: int) -> None:
    group = dist.group.WORLD
    _check_one_rank_refused(rank)
    for family in (Family.GPT_OSS, Family.QWEN3_MOE, Family.DEEPSEEK_V3, Family.QWEN2_MOE):
        for parallel in (Parallel.tensor(group), Parallel.expert(group)):
            try:
                _check(family, parallel)
            except AssertionError as e:
                raise AssertionError(
                    f"rank {rank} of {world}, {family.value}, {parallel.describe()}: {e}"
                ) from e


@pytest.mark.timeout(120)
def test_hf_blocks_on_two_ranks_give_the_unpatched_output(tmp_path) -> None:
    run_on_ranks(_rank_main, 2, tmp_path)
