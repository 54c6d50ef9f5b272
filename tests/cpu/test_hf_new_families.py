"""DeepSeek-V2, OLMoE, MiniMax-M2, dots1 and GLM-4.7-Flash: what only these families have.

Data flow: tiny random models built by transformers (`hf_tiny`) -> `save_pretrained` -> the per-expert
reader with config.json variants (refusals before any tensor data is read, by the `reads` spy), and the
live models -> `patch_model` / `spec_from_hf_config`: DeepSeek-V2's "group_limited_greedy" and the other
routings moekit does not compute refused by field and value; MiniMax-M2's block-held correction bias
(nonzero, moving choices) read, saved, loaded and given back on unpatch; OLMoE without renormalization
(its released setting) matching the unpatched model in fp32 (test_hf_parity's 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import randomize_correction_biases, routed_only_config, tiny_new_family_model  # noqa: E402
from moekit import CheckpointError, SpecError  # noqa: E402
from moekit.checkpoint import HfCheckpointFamily, load_hf_moe_layer  # noqa: E402
from moekit.integrations.transformers import (  # noqa: E402
    Family,
    MoekitMoEBlock,
    hf_layer_of,
    patch_model,
    spec_from_hf_config,
    unpatch,
)
from moekit.reference import relative_l2_error  # noqa: E402
from moekit.spec import WeightFormat  # noqa: E402
from safetensors_spy import spy_reads  # noqa: E402

H, I, E = 64, 96, 6
RTOL = 1e-5
IDS = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int]]:
    return spy_reads(monkeypatch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[HfCheckpointFamily, tuple[Path, dict, int]]:
    out = {}
    for family in (HfCheckpointFamily.DEEPSEEK_V2, HfCheckpointFamily.MINIMAX_M2, HfCheckpointFamily.DOTS1,
                   HfCheckpointFamily.GLM4_MOE_LITE):  # fmt: skip
        torch.manual_seed(0)
        model, layer = tiny_new_family_model(family.value, hidden=H, intermediate=I, experts=E)
        folder = tmp_path_factory.mktemp(family.value)
        model.save_pretrained(folder)
        out[family] = (folder, json.loads((folder / "config.json").read_text()), layer)
    return out


# config.json changes each refused before any tensor data is read: (family, change, error, message)
REFUSALS = [
    (HfCheckpointFamily.DEEPSEEK_V2, {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2},
     SpecError, r"topk_method='group_limited_greedy': .*'group_limited_greedy' \(full DeepSeek-V2\)"),
    (HfCheckpointFamily.DEEPSEEK_V2, {"scoring_func": "sigmoid"}, SpecError,
     r"scoring_func='sigmoid': moekit computes DeepSeek-V2 routing with scoring_func='softmax'"),
    (HfCheckpointFamily.DEEPSEEK_V2, {"norm_topk_prob": True}, SpecError,
     r"norm_topk_prob=True: transformers' DeepSeek-V2 router ignores it"),
    (HfCheckpointFamily.DEEPSEEK_V2, {"routed_scaling_factor": "16"}, CheckpointError,
     r"'routed_scaling_factor' must be a number, got '16'"),
    (HfCheckpointFamily.MINIMAX_M2, {"scoring_func": "softmax"}, SpecError,
     r"scoring_func='softmax': moekit computes MiniMax-M2 routing with scoring_func='sigmoid'"),
    (HfCheckpointFamily.MINIMAX_M2, {"routed_scaling_factor": 2.0}, SpecError,
     r"routed_scaling_factor=2.0: moekit computes MiniMax-M2 routing with routed_scaling_factor=1.0"),
    (HfCheckpointFamily.DOTS1, {"norm_topk_prob": None}, SpecError,  # absent: Dots1Config's False
     r"norm_topk_prob=False: moekit's SIGMOID_GROUPED routing always renormalizes"),
    (HfCheckpointFamily.DOTS1, {"topk_method": "group_limited_greedy"}, SpecError,
     r"topk_method='group_limited_greedy': moekit's SIGMOID_GROUPED routing is DeepSeek-V3's"),
    (HfCheckpointFamily.GLM4_MOE_LITE, {"mlp_layer_types": ["sparse", "dense"]}, CheckpointError,
     r"layer 1 is a dense MLP layer by config.json \(mlp_layer_types\[1\] is 'dense'"),
    (HfCheckpointFamily.GLM4_MOE_LITE, {"mlp_layer_types": ["dense", "moe"]}, CheckpointError,
     r"'mlp_layer_types' must be a list of 'dense' / 'sparse'"),
    (HfCheckpointFamily.GLM4_MOE_LITE, {"mlp_layer_types": None}, CheckpointError,  # the default: 0 dense
     r"layer 0 is a dense MLP layer by config.json \(mlp_layer_types is absent"),
    (HfCheckpointFamily.DEEPSEEK_V2, {"first_k_dense_replace": 2}, CheckpointError,
     r"layer 1 is a dense MLP layer by config.json \(first_k_dense_replace=2"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "change", "error", "message"), REFUSALS, ids=lambda v: str(v)[:40])
def test_a_routing_or_layer_moekit_does_not_compute_is_refused_before_reading(
    saved, reads, family, change, error, message
) -> None:
    folder, config, layer = saved[family]
    changed = {k: v for k, v in {**config, **change}.items() if v is not None}
    if change.get("mlp_layer_types", ()) is None:
        layer = 0
    with pytest.raises(error, match=message):
        load_hf_moe_layer(folder, layer=layer, config=changed)
    assert reads == []


def test_routings_of_the_released_configs_are_read(saved) -> None:
    folder, config, layer = saved[HfCheckpointFamily.DEEPSEEK_V2]
    spec = load_hf_moe_layer(folder, layer=layer, config={**config, "scoring_func": "softmax"}).spec
    assert not spec.routing.renormalize and spec.routing.routed_scaling_factor == 1.5
    folder, config, layer = saved[HfCheckpointFamily.MINIMAX_M2]
    released = {**config, "scoring_func": "sigmoid", "routed_scaling_factor": 1.0}
    loaded = load_hf_moe_layer(folder, layer=layer, config=released)
    assert loaded.spec.routing.n_group is None and loaded.spec.routing.routed_scaling_factor == 1.0
    assert loaded.correction_bias.dtype == torch.float32 and loaded.correction_bias.shape == (E,)
    folder, config, layer = saved[HfCheckpointFamily.GLM4_MOE_LITE]
    unsaid = {k: v for k, v in config.items() if k != "norm_topk_prob"}  # Glm4MoeLiteConfig's True
    assert load_hf_moe_layer(folder, layer=1, config=unsaid).spec.routing.routed_scaling_factor == 1.8


def _deepseek_v2(topk_method: str):
    config = transformers.DeepseekV2Config(
        hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=48, n_routed_experts=E, n_group=3,
        topk_group=2, num_experts_per_tok=2, n_shared_experts=1, topk_method=topk_method, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return config, transformers.AutoModelForCausalLM.from_config(config).eval()


def test_a_live_deepseek_v2_model_with_group_limited_greedy_is_refused_and_left_as_it_was() -> None:
    config, model = _deepseek_v2("group_limited_greedy")
    message = r"topk_method='group_limited_greedy': moekit routes DeepSeek-V2 models whose topk_method"
    with pytest.raises(SpecError, match=message):
        spec_from_hf_config(config, weight_format=WeightFormat.FP32, act_dtype=torch.float32)
    with pytest.raises(SpecError, match=message):
        hf_layer_of(model.model.layers[0].mlp)  # the router's own attribute
    with pytest.raises(SpecError, match=message):
        patch_model(model)
    assert not any(isinstance(m, MoekitMoEBlock) for m in model.modules())
    assert all(p.numel() > 0 for p in model.parameters())


def _minimax(seed: int):
    config = routed_only_config(
        Family.MINIMAX_M2, hidden=H, intermediate=48, experts=8, top_k=2, layers=2, heads=4, kv_heads=2,
        head_dim=16, vocab=48,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.5 if "gate_up" in name else 0.3)
    randomize_correction_biases(model)
    return model


def test_minimax_m2_block_held_correction_bias_is_read_saved_loaded_and_given_back() -> None:
    model = _minimax(0)
    block = model.model.layers[0].mlp
    layer = hf_layer_of(block)
    assert torch.equal(layer.correction_bias, block.e_score_correction_bias)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    unbiased = hf_layer_of(block)
    object.__setattr__(unbiased, "correction_bias", torch.zeros(8))
    moved = (unbiased.route(x).ids.sort(-1).values != layer.route(x).ids.sort(-1).values).any(-1)
    assert moved.sum() >= 3, "the correction bias must change some tokens' experts"

    key = "model.layers.0.mlp.e_score_correction_bias"
    state = _minimax(5).state_dict()
    with torch.no_grad():
        expected = model(IDS).logits
    patch_model(model)
    assert list(model.state_dict()) == list(state)  # the block's buffer under its own name
    model.load_state_dict(state)  # another model's experts and biases
    patched = model.model.layers[0].mlp
    assert torch.equal(patched.moe.correction_bias, state[key])
    with torch.no_grad():
        loaded = model(IDS).logits
    assert relative_l2_error(loaded, expected) > 1e-3
    unpatch(model)
    assert torch.equal(model.model.layers[0].mlp.e_score_correction_bias, state[key])
    with torch.no_grad():
        assert relative_l2_error(model(IDS).logits, loaded) < RTOL


def test_olmoe_without_renormalization_matches_the_unpatched_model() -> None:
    config = routed_only_config(
        Family.OLMOE, hidden=H, intermediate=48, experts=8, top_k=4, layers=2, heads=4, kv_heads=2,
        head_dim=16, vocab=48,
    )  # fmt: skip
    config.norm_topk_prob = False  # OLMoE-1B-7B's
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.5 if "gate_up" in name else 0.3)
        expected = model(IDS).logits
    report = patch_model(model)
    assert all(not b.spec.routing.renormalize for b in report.blocks) and len(report.blocks) == 2
    with torch.no_grad():
        assert relative_l2_error(model(IDS).logits, expected) < RTOL
