"""Blocks with shared experts (DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, dots1, Qwen2-MoE, Qwen3-Next) through
moekit's Hugging Face integration.

Data flow: a tiny random `DeepseekV3ForCausalLM` / `Qwen2MoeForCausalLM` / ... (fp32 unless said, CPU,
`hf_tiny.shared_expert_config`), its MoE weights redrawn at a useful size (experts, routers and shared
experts, not HF's 0.02 init) and DeepSeek-V3's correction biases drawn nonzero -> the block's own forward
against: `from_hf_moe_block` / `hf_layer_of` routing and `fused_moe_reference` plus the block's shared
experts; `fused_moe_from_hf` plus the same; `patch_model`'s `MoekitMoEBlock`. Then the config checks
(n_group, topk_group, routed_scaling_factor, norm_topk_prob and the rest), the refusal of a DeepSeek-V3
block that does not renormalize, load_state_dict of the correction bias, and a bf16 model whose router
HF keeps in fp32. Held to the fp32 parity tests' 1e-5 (measured 0 to ~5e-8) and to
`moekit.reference.tolerance` in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import randomize_correction_biases, shared_expert_config  # noqa: E402
from moekit import NonFiniteError, RoutingMethod, RoutingSpec, SpecError  # noqa: E402
from moekit.integrations.transformers import (  # noqa: E402
    Family,
    MoekitMoEBlock,
    from_hf_moe_block,
    fused_moe_from_hf,
    hf_layer_of,
    patch_model,
    spec_from_hf_config,
    unpatch,
)
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance  # noqa: E402
from moekit.spec import WeightFormat  # noqa: E402

H, I, E, K, VOCAB, T = 64, 48, 8, 4, 48, 40
RTOL_FP32 = 1e-5  # test_hf_parity's fp32 bound
IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
SHARED = [f for f in Family if f.hf.shared is not None]  # DeepSeek-V2/V3, GLM-4.5/4.7-Flash, dots1, Qwen


def _config(family: Family, *, norm: bool = True, layers: int = 2):
    return shared_expert_config(
        family,
        hidden=H,
        intermediate=I,
        experts=E,
        top_k=K,
        layers=layers,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=VOCAB,
        norm_topk_prob=norm,
    )


def _model(config, *, seed: int = 0, impl: str = "eager", dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, experts_implementation=impl
    ).eval()
    with torch.no_grad():  # HF's std-0.02 init barely routes and leaves the shared experts near zero
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.5 if "gate_up" in name else 0.3)
    randomize_correction_biases(model)
    return model


def _shared(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's shared experts on x `[T, H]`, by its own modules, as its forward adds them."""
    if hasattr(block, "shared_experts"):
        return block.shared_experts(x)
    return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


def _block_forward(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None])[0]


CASES = [(f, True) for f in SHARED] + [(Family.QWEN2_MOE, False)]
CASE_IDS = [f.value for f in SHARED] + ["qwen2_moe_no_norm"]


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize(("family", "norm"), CASES, ids=CASE_IDS)
def test_routed_plus_shared_experts_match_the_block(family: Family, norm: bool, impl: str) -> None:
    config = _config(family, norm=norm, layers=1)
    block = _model(config, seed=CASES.index((family, norm)), impl=impl).model.layers[0].mlp
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    layer = from_hf_moe_block(block, config=config)
    assert layer.spec == hf_layer_of(block).spec  # the config and the block agree
    spec = layer.spec
    assert (spec.E, spec.K, spec.H, spec.I, spec.weight_format) == (E, K, H, I, WeightFormat.FP32)
    if family.hf.correction_bias is not None:  # DeepSeek-V3, GLM-4.5
        assert spec.routing == RoutingSpec(
            RoutingMethod.SIGMOID_GROUPED,
            n_group=config.n_group,
            topk_group=config.topk_group,
            has_correction_bias=True,
            routed_scaling_factor=2.5,
        )
        bias = block.gate.e_score_correction_bias
        assert (
            torch.equal(layer.correction_bias, bias) and layer.correction_bias.data_ptr() != bias.data_ptr()
        )
        unbiased = from_hf_moe_block(block, config=config)
        object.__setattr__(unbiased, "correction_bias", torch.zeros_like(bias))
        moved = (unbiased.route(x).ids.sort(-1).values != layer.route(x).ids.sort(-1).values).any(-1)
        assert moved.sum() >= 3, "the correction bias must change some tokens' experts"
    elif family is Family.DEEPSEEK_V2:  # greedy: not renormalized (norm_topk_prob ignored), scaled
        assert spec.routing == RoutingSpec(
            RoutingMethod.SOFTMAX_TOPK, renormalize=False, routed_scaling_factor=2.5
        )
        assert layer.correction_bias is None
    else:
        assert spec.routing == RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=norm)
        assert layer.correction_bias is None

    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        routing = layer.route(x)
        shared = _shared(block, x)
    order, hf_order = routing.ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(routing.ids.gather(1, order).long(), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(
        routing.weights.gather(1, order), hf_weights.float().gather(1, hf_order), rtol=1e-6, atol=1e-7
    )
    expected = _block_forward(block, x)
    got = fused_moe_reference(x, layer.weights, routing, spec=spec) + shared
    err = relative_l2_error(got, expected)
    with torch.no_grad():
        fused_err = relative_l2_error(fused_moe_from_hf(block)(x) + shared, expected)
    print(
        f"\n{family.value} norm={norm} {impl}: reference rel L2 {err:.2e}, fused_moe_from_hf {fused_err:.2e}"
    )
    assert err < RTOL_FP32 and fused_err < RTOL_FP32
    assert relative_l2_error(shared, expected) > 0.1, "the shared experts must matter"


# ----- configs: each field the block holds is checked; DeepSeek-V3 without renormalization is refused -----
MISMATCHES = [
    (Family.DEEPSEEK_V3, "n_group", 1, "n_group=1 but the block's router has n_group=4"),
    (Family.DEEPSEEK_V3, "topk_group", 2, "topk_group=2 but the block's router has topk_group=3"),
    (
        Family.DEEPSEEK_V3,
        "routed_scaling_factor",
        1.0,
        "routed_scaling_factor=1.0 but the block's router has routed_scaling_factor=2.5",
    ),
    (Family.DEEPSEEK_V3, "num_experts_per_tok", 2, "num_experts_per_tok=2 but the block's router selects"),
    (Family.DEEPSEEK_V3, "n_routed_experts", 16, "n_routed_experts=16 but the block's experts hold E=8"),
    (Family.DEEPSEEK_V3, "moe_intermediate_size", 32, "moe_intermediate_size=32 but the block's experts"),
    (Family.DEEPSEEK_V3, "hidden_act", "gelu", "hidden_act='gelu' but the block's experts compute 'silu'"),
    (Family.QWEN2_MOE, "norm_topk_prob", False, "norm_topk_prob=False but the block's router has norm"),
    (
        Family.DEEPSEEK_V2,
        "routed_scaling_factor",
        1.0,
        "routed_scaling_factor=1.0 but the block's router has routed_scaling_factor=2.5",
    ),
    (Family.DOTS1, "topk_group", 2, "topk_group=2 but the block's router has topk_group=3"),
    (Family.QWEN2_MOE, "num_experts_per_tok", 2, "num_experts_per_tok=2 but the block's router selects"),
    (Family.QWEN2_MOE, "num_experts", 4, "num_experts=4 but the block's experts hold E=8"),
    (Family.QWEN2_MOE, "moe_intermediate_size", 96, "moe_intermediate_size=96 but the block's experts"),
]


@pytest.mark.parametrize(("family", "field", "value", "message"), MISMATCHES, ids=lambda v: str(v))
def test_a_config_that_disagrees_with_the_block_is_refused(family, field: str, value, message: str) -> None:
    config = _config(family, layers=1)
    block = _model(config).model.layers[0].mlp
    other = _config(family, layers=1)
    setattr(other, field, value)
    with pytest.raises(SpecError, match=rf"config\.{message}.*pass the config of the model"):
        from_hf_moe_block(block, config=other)
    assert from_hf_moe_block(block, config=config).spec == hf_layer_of(block, config=other).spec


def test_deepseek_v3_without_renormalization_is_refused_everywhere() -> None:
    config = _config(Family.DEEPSEEK_V3, norm=False)
    model = _model(config)
    block = model.model.layers[0].mlp
    message = r"norm_topk_prob=False: moekit's SIGMOID_GROUPED routing always renormalizes the top-k"
    with pytest.raises(SpecError, match=message):
        spec_from_hf_config(config, weight_format=WeightFormat.FP32, act_dtype=torch.float32)
    for convert in (hf_layer_of, fused_moe_from_hf, lambda b: from_hf_moe_block(b, config=config)):
        with pytest.raises(SpecError, match=message):
            convert(block)
    with pytest.raises(SpecError, match=message):
        patch_model(model)
    assert not any(isinstance(m, MoekitMoEBlock) for m in model.modules())
    assert all(p.numel() > 0 for p in model.parameters())
    # A config that renormalizes, given with a block that does not, is refused as another model's.
    with pytest.raises(SpecError, match=r"config\.norm_topk_prob=True but the block's router has norm"):
        from_hf_moe_block(block, config=_config(Family.DEEPSEEK_V3))


# ----- patched blocks: shared experts in the module tree, the correction bias read and loaded -------------
@pytest.mark.parametrize("family", SHARED, ids=[f.value for f in SHARED])
def test_the_patched_block_runs_the_original_shared_experts(family: Family) -> None:
    model = _model(_config(family))
    original = model.model.layers[1].mlp
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2))
    expected = _block_forward(original, x[0])
    patch_model(model)
    block = model.model.layers[1].mlp
    assert isinstance(block, MoekitMoEBlock) and block.original is original
    shared = family.hf.shared
    for name in (shared.mlp, shared.gate):
        if name is not None:
            assert getattr(block, name) is getattr(original, name), name
            assert dict(block.named_children())[name] is getattr(original, name)
    with torch.no_grad():
        got = block(x)
    err = relative_l2_error(got[0], expected)
    print(f"\n{family.value}: patched block vs HF block rel L2 {err:.2e}")
    assert got.shape == x.shape and err < RTOL_FP32
    if family is Family.DEEPSEEK_V3:  # moekit's copy of the router's buffer, read when patched
        bias = block.gate.e_score_correction_bias
        assert torch.equal(block.moe.correction_bias, bias)
        assert block.moe.correction_bias.data_ptr() != bias.data_ptr()


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
@pytest.mark.parametrize("family", SHARED, ids=[f.value for f in SHARED])
def test_load_state_dict_loads_experts_shared_experts_and_correction_bias(
    family: Family, release: bool
) -> None:
    config = _config(family)
    source = _model(config)
    with torch.no_grad():
        expected = source(IDS).logits
    state = source.state_dict()
    model = _model(config, seed=5)
    patch_model(model, release_originals=release)
    shared = f"model.layers.0.mlp.{family.hf.shared.mlp}.down_proj.weight"
    assert not torch.equal(model.state_dict()[shared], state[shared])
    model.load_state_dict(state)
    with torch.no_grad():
        err = relative_l2_error(model(IDS).logits, expected)
    assert err < RTOL_FP32
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    if family is not Family.DEEPSEEK_V3:
        return
    key = "model.layers.0.mlp.gate.e_score_correction_bias"
    assert torch.equal(model.model.layers[0].mlp.moe.correction_bias, state[key])
    # The bias alone (strict=False): moekit routes with it, as the unpatched block then does.
    bias = torch.randn(E, generator=torch.Generator().manual_seed(9)) * 0.2
    model.load_state_dict({key: bias}, strict=False)
    assert torch.equal(model.model.layers[0].mlp.moe.correction_bias, bias)
    with torch.no_grad():
        patched = model(IDS).logits
        assert relative_l2_error(patched, expected) > 1e-3, "a new bias must change the routing"
    unpatch(model)
    with torch.no_grad():
        assert relative_l2_error(model(IDS).logits, patched) < RTOL_FP32


def test_a_non_finite_correction_bias_is_refused_and_changes_nothing() -> None:
    model = _model(_config(Family.DEEPSEEK_V3))
    state = model.state_dict()
    patch_model(model)
    with torch.no_grad():
        before = model(IDS).logits
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    bad = state[key].clone()
    bad[3] = float("nan")
    block = model.model.layers[1].mlp
    moe = block.moe
    with pytest.raises(NonFiniteError, match=r"correction_bias holds 1 of 8 values .* at expert 3"):
        model.load_state_dict(state | {key: bad})
    assert block.moe is moe and torch.equal(block.gate.e_score_correction_bias, state[key])
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, before, rtol=0, atol=0)


def test_a_bf16_deepseek_v3_model_with_its_fp32_router_and_dense_first_layer() -> None:
    """HF keeps DeepSeek-V3's router and correction bias in fp32 in a bf16 model; the act dtype is the
    experts'. The first `first_k_dense_replace` layers are dense MLPs, left alone. The patched block is
    held to bf16's tolerance against HF's, and to no more than HF's own distance from the same block in
    fp32 (moekit keeps fp32 intermediates; measured 4.2e-3 against HF's 5.0e-3)."""
    config = _config(Family.DEEPSEEK_V3, layers=3)
    config.first_k_dense_replace = 1
    model = _model(config, dtype=torch.bfloat16)
    block = model.model.layers[1].mlp
    assert block.gate.weight.dtype == torch.float32 and block.experts.gate_up_proj.dtype == torch.bfloat16
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16)
    with torch.no_grad():
        expected, exact = block(x), copy.deepcopy(block).float()(x.float())
    report = patch_model(model)
    assert [b.name for b in report.blocks] == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    spec = report.blocks[0].spec
    assert spec.act_dtype == torch.bfloat16 and spec.weight_format is WeightFormat.BF16
    with torch.no_grad():
        got = model.model.layers[1].mlp(x)
    err = relative_l2_error(got, expected)
    ours, theirs = relative_l2_error(got.float(), exact), relative_l2_error(expected.float(), exact)
    print(
        f"\nbf16 deepseek_v3: vs HF {err:.2e} (bound {tolerance(spec)}); vs fp32 {ours:.2e}, HF {theirs:.2e}"
    )
    assert err <= tolerance(spec) and ours <= theirs
