"""Per-expert Hugging Face checkpoints: `load_hf_moe_layer` / `FusedMoE.from_hf_checkpoint` against the
models transformers itself builds and saves, and against FP8 block-128 checkpoints written here.

Data flow: tiny models of every `HfCheckpointFamily` (transformers 5.x, random weights
of a useful size, DeepSeek's correction bias random too) -> `save_pretrained` (the names, layouts and
config fields are transformers', not moekit's) -> moekit reads one MoE layer -> its reference and its
`FusedMoE` are compared with the HF block's own forward, less the shared experts the model adds. FP8:
a moekit FP8 layer split into per-expert tensors and `.weight_scale_inv` under DeepSeek's names with a
`quantization_config` -> read back bit for bit, whole and as each rank's share (checked against
`expert_shard` / `tensor_shard` and through the spy on every byte read). Refusals come before any data
is read, each with the offending key or field.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hf_checkpoints import FP8_E, FP8_H, FP8_I, fp8_spec, write_fp8_checkpoint
from hf_tiny import tiny_new_family_model
from moekit import CheckpointError, FusedMoE, Parallel, SpecError, UnsupportedSpecError
from moekit.checkpoint import HfCheckpointFamily, load_hf_moe_layer
from moekit.checkpoint.hf_rules import DenseRule
from moekit.ops import route
from moekit.parallel import ParallelMode, RankShare, expert_shard, tensor_shard
from moekit.reference import fused_moe_reference, relative_l2_error
from moekit.spec import RoutingMethod, WeightFormat
from safetensors_spy import spy_reads
from spawn_ranks import run_on_ranks

transformers = pytest.importorskip("transformers")

H, I_FLOAT, E = 64, 96, 6  # I/2 and I/3 whole; E divisible by neither 4 nor 5 ranks
GROUPED = (
    HfCheckpointFamily.DEEPSEEK_V3,
    HfCheckpointFamily.GLM4_MOE,
    HfCheckpointFamily.DOTS1,
    HfCheckpointFamily.GLM4_MOE_LITE,
)  # sigmoid + correction, shared experts
GATED_SHARED = (HfCheckpointFamily.QWEN2_MOE, HfCheckpointFamily.QWEN3_NEXT)  # a gated shared expert
SHARED_EXPERTS = (*GROUPED, HfCheckpointFamily.DEEPSEEK_V2)  # `shared_experts` added as is
BIASED = (*GROUPED, HfCheckpointFamily.MINIMAX_M2)  # a correction bias (MiniMax-M2's on the block)
NEW_FAMILIES = {
    HfCheckpointFamily.DEEPSEEK_V2,
    HfCheckpointFamily.OLMOE,
    HfCheckpointFamily.MINIMAX_M2,
    HfCheckpointFamily.DOTS1,
    HfCheckpointFamily.GLM4_MOE_LITE,
}


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int]]:
    return spy_reads(monkeypatch)


def _tiny(family: HfCheckpointFamily):  # -> (transformers model, MoE layer index)
    if family in NEW_FAMILIES:
        return tiny_new_family_model(family.value, hidden=H, intermediate=I_FLOAT, experts=E)
    common = dict(vocab_size=32, hidden_size=H, num_attention_heads=2, num_experts_per_tok=2)
    if family is HfCheckpointFamily.MIXTRAL:
        cfg = transformers.MixtralConfig(
            **common,
            intermediate_size=I_FLOAT,
            num_hidden_layers=1,
            num_key_value_heads=1,
            num_local_experts=E,
        )
        return transformers.MixtralForCausalLM(cfg), 0
    if family is HfCheckpointFamily.QWEN3_MOE:
        cfg = transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=I_FLOAT, num_hidden_layers=1,
            num_key_value_heads=1, head_dim=32, num_experts=E, norm_topk_prob=True,
        )  # fmt: skip
        return transformers.Qwen3MoeForCausalLM(cfg), 0
    if family is HfCheckpointFamily.QWEN2_MOE:
        cfg = transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=I_FLOAT,
            shared_expert_intermediate_size=48,
            num_hidden_layers=1,
            num_key_value_heads=1,
            num_experts=E,
        )  # fmt: skip  (norm_topk_prob False, as Qwen2-MoE releases)
        return transformers.Qwen2MoeForCausalLM(cfg), 0
    if family is HfCheckpointFamily.QWEN3_NEXT:  # one full-attention layer: the MoE block is what matters
        cfg = transformers.Qwen3NextConfig(
            **common, intermediate_size=128, moe_intermediate_size=I_FLOAT,
            shared_expert_intermediate_size=48, num_hidden_layers=1, num_key_value_heads=1, head_dim=32,
            num_experts=E, layer_types=["full_attention"],
        )  # fmt: skip
        return transformers.Qwen3NextForCausalLM(cfg), 0
    if family is HfCheckpointFamily.GLM4_MOE:
        cfg = transformers.Glm4MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=I_FLOAT, num_hidden_layers=2,
            first_k_dense_replace=1, num_key_value_heads=1, head_dim=32, n_routed_experts=E, n_group=1,
            topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        )  # fmt: skip
        return transformers.Glm4MoeForCausalLM(cfg), 1
    cfg = transformers.DeepseekV3Config(
        **common, intermediate_size=128, moe_intermediate_size=I_FLOAT, num_hidden_layers=2,
        first_k_dense_replace=1, num_key_value_heads=2, n_routed_experts=E, n_group=3, topk_group=2,
        n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(cfg), 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[HfCheckpointFamily, tuple[Path, torch.nn.Module, int]]:
    out = {}
    for n, family in enumerate(HfCheckpointFamily):
        torch.manual_seed(n)
        model, layer = _tiny(family)
        with torch.no_grad():  # weights of a size where routing and the activation both matter
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (1.0 if "gate.weight" in name else 0.2))
            block = model.model.layers[layer].mlp
            if family in BIASED:
                owner = block if family is HfCheckpointFamily.MINIMAX_M2 else block.gate
                owner.e_score_correction_bias.copy_(torch.rand(E) * 0.2)
        folder = tmp_path_factory.mktemp(family.value)
        model.save_pretrained(folder)
        out[family] = (folder, block.eval(), layer)
    return out


def _routed_output(family: HfCheckpointFamily, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF block's output less what the model adds beside the routed experts."""
    with torch.no_grad():
        y = block(x[None])
        y = (y[0] if isinstance(y, tuple) else y)[0]
        if family in SHARED_EXPERTS:
            y = y - block.shared_experts(x)
        if family in GATED_SHARED:
            y = y - torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return y


@pytest.mark.parametrize("family", list(HfCheckpointFamily), ids=[f.value for f in HfCheckpointFamily])
def test_a_saved_hf_model_layer_computes_what_the_hf_block_computes(saved, family) -> None:
    folder, block, layer = saved[family]
    loaded = load_hf_moe_layer(folder, layer=layer, act_dtype=torch.float32)
    spec = loaded.spec
    assert (spec.E, spec.K, spec.H, spec.I, spec.weight_format) == (E, 2, H, I_FLOAT, WeightFormat.FP32)
    assert (spec.routing.method is RoutingMethod.SIGMOID_GROUPED) == (family in BIASED)
    assert spec.routing.has_correction_bias == (family in BIASED) == (loaded.correction_bias is not None)
    config = json.loads((folder / "config.json").read_text())
    assert spec.routing.renormalize == config.get("norm_topk_prob", True)  # Qwen2-MoE's, OLMoE's False
    shared = 3 if family in SHARED_EXPERTS else 4 if family in GATED_SHARED else 0
    assert len(loaded.shared_expert_keys) == shared
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(5))
    want = _routed_output(family, block, x)
    routing = route(
        loaded.router_logits(x), top_k=spec.K, spec=spec.routing, correction_bias=loaded.correction_bias
    )
    ref = fused_moe_reference(x, loaded.weights, routing, spec=spec)
    assert relative_l2_error(ref, want) < 1e-5
    fused = FusedMoE.from_hf_checkpoint(folder, layer, act_dtype=torch.float32)
    assert relative_l2_error(fused(x), want) < 1e-5


def test_a_dense_layer_and_other_families_are_refused_with_where_to_go(saved, tmp_path) -> None:
    folder, _, _ = saved[HfCheckpointFamily.DEEPSEEK_V3]
    with pytest.raises(
        CheckpointError, match=r"layer 0 is a dense MLP layer by config.json \(first_k_dense_rep"
    ):
        load_hf_moe_layer(folder, layer=0)
    with pytest.raises(CheckpointError, match="pass config="):
        load_hf_moe_layer(folder / "model.safetensors", layer=1)
    config = json.loads((folder / "config.json").read_text())
    unsaid = {k: v for k, v in config.items() if k != "first_k_dense_replace"}  # the files then decide
    with pytest.raises(CheckpointError, match=r"layer 0 has no routed experts .*MoE layers found: \[1\]"):
        load_hf_moe_layer(folder, layer=0, config=unsaid)
    with pytest.raises(CheckpointError, match="load_gpt_oss_layer"):
        load_hf_moe_layer(folder, layer=1, config={**config, "model_type": "gpt_oss"})
    with pytest.raises(SpecError, match="scoring_func='softmax'"):
        load_hf_moe_layer(folder, layer=1, config={**config, "scoring_func": "softmax"})
    with pytest.raises(CheckpointError, match=r"holds experts \[4, 5\] but config.json says E=4"):
        load_hf_moe_layer(folder, layer=1, config={**config, "n_routed_experts": 4})
    with pytest.raises(CheckpointError, match="disagree on E"):
        load_hf_moe_layer(folder, layer=1, config={**config, "num_local_experts": 8})
    with pytest.raises(CheckpointError, match=r"'moe_intermediate_size' must be an int, got '96'"):
        load_hf_moe_layer(folder, layer=1, config={**config, "moe_intermediate_size": "96"})
    wrong = {**config, "moe_intermediate_size": 64}
    with pytest.raises(
        CheckpointError, match=r"experts.0.gate_proj.weight' has shape \[96, 64\], expected \[64, 64\]"
    ):
        load_hf_moe_layer(folder, layer=1, config=wrong)
    compressed = {**config, "quantization_config": {"quant_method": "compressed-tensors"}}
    with pytest.raises(CheckpointError, match=r"quantization_config.config_groups=None: must be an object"):
        load_hf_moe_layer(folder, layer=1, config=compressed)
    awq = {**config, "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(CheckpointError, match="quant_method='awq' is not one moekit reads"):
        load_hf_moe_layer(folder, layer=1, config=awq)


# ----- FP8 block-128 checkpoints (DeepSeek-V3, Qwen3 -FP8 and MiniMax-M2 layouts) -------------------------
FP8_FAMILIES = [HfCheckpointFamily.DEEPSEEK_V3, HfCheckpointFamily.QWEN3_MOE, HfCheckpointFamily.MINIMAX_M2]


@pytest.mark.parametrize("family", FP8_FAMILIES, ids=[f.value for f in FP8_FAMILIES])
def test_an_fp8_checkpoint_is_read_bit_for_bit_and_runs(tmp_path, family) -> None:
    synthetic = write_fp8_checkpoint(
        tmp_path,
        family,
        scale_dtype=torch.bfloat16 if family is HfCheckpointFamily.QWEN3_MOE else torch.float32,
    )
    loaded = load_hf_moe_layer(tmp_path, layer=3, act_dtype=torch.float32)
    assert loaded.spec == fp8_spec(family)
    for name, t in synthetic.weights.tensors().items():
        expect = (
            t
            if name not in ("w13_scale", "w2_scale") or family is not HfCheckpointFamily.QWEN3_MOE
            else t.bfloat16().float()
        )
        assert torch.equal(getattr(loaded.weights, name), expect), name
    layer = FusedMoE.from_hf_checkpoint(tmp_path, 3, act_dtype=torch.float32)
    x = torch.randn(29, FP8_H, generator=torch.Generator().manual_seed(1))
    routing = route(
        loaded.router_logits(x), top_k=2, spec=loaded.spec.routing, correction_bias=loaded.correction_bias
    )
    ref = fused_moe_reference(x, loaded.weights, routing, spec=loaded.spec)
    assert relative_l2_error(layer(x), ref) < 1e-5


@pytest.mark.parametrize("mode", list(ParallelMode), ids=[m.value for m in ParallelMode])
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_reads_exactly_its_share(tmp_path, reads, mode, world) -> None:
    write_fp8_checkpoint(tmp_path, HfCheckpointFamily.DEEPSEEK_V3)
    whole = load_hf_moe_layer(tmp_path, layer=3, act_dtype=torch.float32)
    expert_bytes = sum(t.nbytes for t in whole.weights.tensors().values())
    router_bytes = whole.router_weight.nbytes + whole.correction_bias.nbytes
    if mode is ParallelMode.TENSOR and world == 3:
        with pytest.raises(UnsupportedSpecError, match=r"I/N = 256/3 must be a multiple of 128"):
            load_hf_moe_layer(tmp_path, layer=3, share=RankShare(mode, 0, world))
        return
    cut = expert_shard if mode is ParallelMode.EXPERT else tensor_shard
    total = 0
    for rank in range(world):
        reads.clear()
        share = RankShare(mode, rank, world)
        got = load_hf_moe_layer(tmp_path, layer=3, act_dtype=torch.float32, share=share)
        expected = cut(whole.spec, whole.weights, rank=rank, world_size=world)[1]
        for name, t in expected.tensors().items():
            assert torch.equal(getattr(got.weights, name), t), (rank, name)
        assert got.spec == whole.spec and torch.equal(got.router_weight, whole.router_weight)
        read = sum(n for _, n in reads)
        held = sum(t.nbytes for t in expected.tensors().values())
        assert (
            read == held + router_bytes
        )  # the share's bytes (scales read in their stored fp32) and the router
        total += held
    assert total == expert_bytes  # every expert byte read by exactly one rank


def test_fp8_checkpoint_refusals_name_the_tensor_and_read_nothing(tmp_path, reads) -> None:
    from safetensors import safe_open

    write_fp8_checkpoint(tmp_path, HfCheckpointFamily.DEEPSEEK_V3)
    key = "model.layers.3.mlp.experts.4.down_proj.weight_scale_inv"
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        shard_b = {k: f.get_tensor(k) for k in f.keys()}
    reads.clear()
    bad = dict(shard_b)
    bad[key] = bad[key].clone()
    bad[key][0, 1] = float("nan")
    save_file(bad, str(tmp_path / "b.safetensors"))
    load_hf_moe_layer(tmp_path, layer=3, share=RankShare(ParallelMode.EXPERT, 0, 2))  # experts 0-2: clean
    with pytest.raises(CheckpointError, match=r"not finite and > 0, first in '.*experts\.4\.down_proj"):
        load_hf_moe_layer(tmp_path, layer=3, share=RankShare(ParallelMode.EXPERT, 1, 2))
    code_key = key.removesuffix("_scale_inv")  # the weight itself: one NaN code (E4M3 0xFF)
    bad = dict(shard_b)
    bad[code_key] = bad[code_key].clone()
    bad[code_key].view(torch.uint8)[5, 7] = 0xFF
    save_file(bad, str(tmp_path / "b.safetensors"))
    load_hf_moe_layer(tmp_path, layer=3, share=RankShare(ParallelMode.EXPERT, 0, 2))
    with pytest.raises(
        CheckpointError, match=rf"code\(s\) read from this layer are NaN .*first in '{code_key}'"
    ):
        load_hf_moe_layer(tmp_path, layer=3)
    extra = "model.layers.3.mlp.experts.0.up_proj.input_scale"  # another FP8 scheme's activation scale
    save_file({**shard_b, extra: torch.ones(1)}, str(tmp_path / "b.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"][extra] = "b.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reads.clear()
    with pytest.raises(CheckpointError, match=rf"would not read: \['{extra}'\]"):
        load_hf_moe_layer(tmp_path, layer=3)
    assert reads == []
    assert load_hf_moe_layer(tmp_path, layer=3, allow_extra_tensors=True).spec.E == FP8_E


# ----- FusedMoE.from_hf_checkpoint(parallel=...) on gloo ranks ------------------------------------------
def _parallel_main(rank: int, world: int, *, path: str) -> None:
    whole = FusedMoE.from_hf_checkpoint(path, 3, act_dtype=torch.float32)
    group = dist.group.WORLD
    x = torch.randn(11, FP8_H, generator=torch.Generator().manual_seed(7))  # every rank: the same tokens
    for parallel in (Parallel.expert(group), Parallel.tensor(group)):
        got = FusedMoE.from_hf_checkpoint(path, 3, act_dtype=torch.float32, parallel=parallel)
        cut = FusedMoE(
            spec=whole.spec,
            weights=whole.weights,
            router_weight=whole.router_weight,
            correction_bias=whole.correction_bias,
            parallel=parallel,
        )
        assert got.spec == cut.spec and (got.spec.E_local, got.spec.I) != (whole.spec.E_local, whole.spec.I)
        for name, t in cut.weights.tensors().items():
            assert torch.equal(getattr(got.weights, name), t), (parallel.mode, name)
        mine = x[rank::world] if parallel.mode is ParallelMode.EXPERT else x  # EP: each rank its own tokens
        assert relative_l2_error(got(mine), whole(mine)) < 1e-5, parallel.mode
        # A checkpoint one rank cannot read (another config on its node): every rank raises, none waits.
        config = None if rank == 0 else {"model_type": "gpt_oss"}
        with pytest.raises(CheckpointError, match="load_gpt_oss_layer" if rank == 1 else "another rank"):
            FusedMoE.from_hf_checkpoint(path, 3, config=config, parallel=parallel)


def test_from_hf_checkpoint_reads_this_ranks_share_and_matches_one_rank(tmp_path: Path) -> None:
    write_fp8_checkpoint(tmp_path, HfCheckpointFamily.DEEPSEEK_V3, seed=3)
    run_on_ranks(partial(_parallel_main, path=str(tmp_path)), 2, tmp_path)


def test_moekit_run_reads_a_per_expert_checkpoint(tmp_path: Path, capsys) -> None:
    from moekit.app.cli import main

    write_fp8_checkpoint(tmp_path, HfCheckpointFamily.DEEPSEEK_V3, seed=2)
    assert main(["run", "--checkpoint", str(tmp_path), "--layer", "3", "--tokens", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "layer 3 (deepseek_v3, routed experts only)" in report["source"]
    assert report["spec"].startswith(f"E={FP8_E} K=2 H={FP8_H} I={FP8_I} FP8_E4M3") and report["check_passed"]
    assert main(["run", "--checkpoint", str(tmp_path), "--layer", "2"]) == 1
    assert "layer 2 has no routed experts" in capsys.readouterr().err


def test_an_hf_moe_layer_checks_its_router_tensors(saved) -> None:
    from dataclasses import replace

    from moekit import ShapeError

    folder, _, layer = saved[HfCheckpointFamily.QWEN3_MOE]
    loaded = load_hf_moe_layer(folder, layer=layer, act_dtype=torch.float32)
    with pytest.raises(ShapeError, match=rf"router_weight has shape \({E}, {H - 1}\), expected \({E}, {H}\)"):
        replace(loaded, router_weight=loaded.router_weight[:, 1:])
    with pytest.raises(SpecError, match="SOFTMAX_TOPK routing has none"):
        replace(loaded, correction_bias=torch.zeros(E))


def test_moekit_explain_plans_the_layer_a_config_describes(tmp_path: Path, capsys) -> None:
    from hf_checkpoints import fp8_config
    from moekit.app.cli import main

    file = tmp_path / "config.json"
    file.write_text(json.dumps(fp8_config(HfCheckpointFamily.DEEPSEEK_V3)))
    assert main(["explain", "--config", str(file), "--device", "h200", "--tokens", "64", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec.startswith(f"E={FP8_E} K=2 H={FP8_H} I={FP8_I} FP8_E4M3") and "SIGMOID_GROUPED" in spec
    assert main(["explain", "--config", str(file), "--ep", "2"]) == 0
    assert f"E_local={-(-FP8_E // 2)}" in capsys.readouterr().out
    assert main(["explain", "--config", str(file), "--preset", "deepseek-v3"]) == 2
    assert "both name the layer" in capsys.readouterr().err
    float_config = {
        k: v for k, v in fp8_config(HfCheckpointFamily.QWEN3_MOE).items() if k != "quantization_config"
    }
    file.write_text(json.dumps(float_config))  # no dtype: the format is unknown without the tensors
    assert main(["explain", "--config", str(file)]) == 2
    assert "names the weights' dtype None" in capsys.readouterr().err
    file.write_text(json.dumps({**float_config, "torch_dtype": "bfloat16"}))
    assert main(["explain", "--config", str(file), "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"].startswith(f"E={FP8_E} K=2 H={FP8_H} I={FP8_I} BF16")


def test_which_loader_a_folder_takes(tmp_path: Path, saved) -> None:
    from moekit.checkpoint import per_expert_family

    assert per_expert_family(saved[HfCheckpointFamily.MIXTRAL][0]) is HfCheckpointFamily.MIXTRAL
    assert per_expert_family(tmp_path) is None  # no config.json: the GPT-OSS loader's files
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert per_expert_family(tmp_path) is None  # fused MXFP4 experts: the GPT-OSS loader
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read .*config.json as the model's config.json"):
        per_expert_family(tmp_path)


def test_hf_moe_layers_lists_the_layers_with_experts_to_run(saved) -> None:
    from moekit.checkpoint import hf_moe_layers

    for family, (folder, _, layer) in saved.items():
        config = json.loads((folder / "config.json").read_text())
        # The tiny models' MoE layers: all from `layer` on (DeepSeek-V2/V3, GLM-4.5/4.7-Flash, dots1: 1).
        assert hf_moe_layers(folder) == list(range(layer, config["num_hidden_layers"])), family
        assert layer in hf_moe_layers(folder)
        # The config decides too: a layer it makes dense is not listed even where experts are on disk.
        assert hf_moe_layers(folder, config={**config, "first_k_dense_replace": 5}) == (
            [] if family.layout.dense_rule is DenseRule.FIRST_K_DENSE_REPLACE else hf_moe_layers(folder)
        )
