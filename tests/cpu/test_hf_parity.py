"""moekit against Hugging Face transformers' MoE blocks, and the reference against its per-token spelling.

Tiers:
1. Float parity: a tiny random GptOss / Mixtral / Qwen3-MoE model (fp32, CPU, one layer) has its MoE
   block's weights set to random non-zero values (gate and up distinct, biases random for GPT-OSS);
   `integrations.transformers.convert` converts them; route(logits) + `fused_moe_reference` must match the
   block's output to fp32 rounding (rel L2 < 1e-5; measured 0 to ~1e-7), for both HF expert backends.
2. MXFP4 checkpoint parity: moekit writes an HF-named MXFP4 checkpoint; transformers' own loader
   (`Mxfp4Config(dequantize=True)`) dequantizes it bit-identically to moekit, and its block output
   matches moekit's reference on the layer `load_gpt_oss_layer` reads back.
3. `fused_moe_reference` (fp32, expert-major) against `fused_moe_per_token_loop` (fp64, token-major)
   over formats, biases, layouts and clamp limits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from moekit import (  # noqa: E402
    ActivationSpec,
    ExpertWeights,
    FormatError,
    GateLayout,
    MoESpec,
    RoutingMethod,
    RoutingSpec,
    SpecError,
    WeightFormat,
    route,
)
from moekit.checkpoint import CheckpointNaming, GptOssLayer, gpt_oss_layer_tensors, load_gpt_oss_layer  # noqa: E402
from moekit.integrations.transformers.convert import (  # noqa: E402
    from_hf_mixtral_experts,
    from_hf_moe_block,
    spec_from_hf_config,
)
from moekit.integrations.transformers.patch import hf_layer_of  # noqa: E402
from moekit.reference import fused_moe_reference, relative_l2_error  # noqa: E402
from moekit.spec import Activation, Fp8Scale  # noqa: E402
from oracle_loop import fused_moe_per_token_loop  # noqa: E402

H, I, E, T = 64, 48, 8, 40  # H != I so a transposed weight cannot pass; I = 48 leaves a ragged MXFP4 block
RTOL_FP32 = 1e-5
_LAYER = dict(
    hidden_size=H,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=32,
)


def make_config(kind: str, *, intermediate: int = I, norm_topk_prob: bool = True):
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            intermediate_size=intermediate, num_local_experts=E, num_experts_per_tok=4, **_LAYER
        )
    if kind == "mixtral":
        return transformers.MixtralConfig(
            intermediate_size=intermediate, num_local_experts=E, num_experts_per_tok=2, **_LAYER
        )
    return transformers.Qwen3MoeConfig(
        moe_intermediate_size=intermediate,
        intermediate_size=2 * intermediate,
        num_experts=E,
        num_experts_per_tok=4,
        norm_topk_prob=norm_topk_prob,
        **_LAYER,
    )


# Standard deviations per parameter: GPT-OSS's gate_up is large enough that the clamp at 7 fires.
_STD = {
    "gate_up_proj": 0.6,
    "down_proj": 0.1,
    "gate_up_proj_bias": 0.5,
    "down_proj_bias": 0.5,
    "weight": 0.3,
    "bias": 0.2,
}


def make_block(config, *, impl: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, experts_implementation=impl
    )
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for name, p in block.named_parameters():
            std = _STD[name.rsplit(".", 1)[-1]]
            if name.endswith("down_proj") and config.model_type != "gpt_oss":
                std = 0.3
            p.copy_(torch.randn_like(p) * std)
    return block


def hf_forward(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]  # GptOssMLP returns (out, router_scores)


def hf_routing(block: torch.nn.Module, x: torch.Tensor, model_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    router = block.router if model_type == "gpt_oss" else block.gate
    with torch.no_grad():
        _, weights, ids = router(x)
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


CASES = [("gpt_oss", True), ("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize(("kind", "norm"), CASES, ids=["gpt_oss", "mixtral", "qwen3_norm", "qwen3_no_norm"])
def test_float_parity_with_hf_block(kind: str, norm: bool, impl: str) -> None:
    config = make_config(kind, norm_topk_prob=norm)
    block = make_block(config, impl=impl, seed=CASES.index((kind, norm)))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    layer = from_hf_moe_block(block, config=config)
    spec = layer.spec
    assert (spec.E, spec.H, spec.I, spec.K) == (E, H, I, config.num_experts_per_tok)
    assert spec.weight_format is WeightFormat.FP32 and spec.act_dtype == torch.float32
    if kind == "gpt_oss":
        assert spec.routing.method is RoutingMethod.TOPK_SOFTMAX
        assert spec.gate_layout is GateLayout.INTERLEAVED and spec.has_bias
        assert spec.activation == ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0)
        h = torch.einsum("th,enh->ten", x, layer.weights.w13) + layer.weights.b13
        assert (h[..., 0::2] > 7).any() and (h[..., 1::2].abs() > 7).any(), "the clamp must be exercised"
    else:
        assert spec.routing == RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=norm)
        assert spec.gate_layout is GateLayout.CONCAT and not spec.has_bias

    routing = layer.route(x)
    ids, weights = hf_routing(block, x, kind)
    order = routing.ids.argsort(dim=-1)
    assert torch.equal(routing.ids.gather(1, order).long(), ids.long())
    torch.testing.assert_close(routing.weights.gather(1, order), weights, rtol=1e-6, atol=1e-7)

    expected = hf_forward(block, x)
    got = fused_moe_reference(x, layer.weights, routing, spec=spec)
    err = relative_l2_error(got, expected)
    max_abs = (got - expected).abs().max()
    print(f"\n{kind} (norm_topk_prob={norm}) {impl}: rel L2 {err:.3e}, max abs {max_abs:.3e}")
    assert err < RTOL_FP32


@pytest.mark.parametrize("kind", ["gpt_oss", "mixtral"])
def test_converted_layout_does_not_change_the_output(kind: str) -> None:
    config = make_config(kind)
    block = make_block(config, impl="eager", seed=3)
    x = torch.randn(T, H)
    native = from_hf_moe_block(block, config=config)
    other = GateLayout.CONCAT if native.spec.gate_layout is GateLayout.INTERLEAVED else GateLayout.INTERLEAVED
    swapped = from_hf_moe_block(block, config=config, gate_layout=other)
    assert swapped.spec.gate_layout is other and swapped.weights.gate_layout is other
    assert relative_l2_error(swapped.reference(x), native.reference(x)) < 1e-6


def test_legacy_per_expert_modules_match_fused_parameters() -> None:
    """transformers 4.x Mixtral kept one MLP per expert (w1 gate, w3 up, w2 down)."""
    block = make_block(make_config("mixtral"), impl="eager", seed=4)
    fused = from_hf_mixtral_experts(block.experts)
    experts = torch.nn.ModuleList()
    for e in range(E):
        mlp = torch.nn.Module()
        mlp.w1, mlp.w3 = torch.nn.Linear(H, I, bias=False), torch.nn.Linear(H, I, bias=False)
        mlp.w2 = torch.nn.Linear(I, H, bias=False)
        with torch.no_grad():
            gate, up = block.experts.gate_up_proj[e].chunk(2)
            mlp.w1.weight.copy_(gate)
            mlp.w3.weight.copy_(up)
            mlp.w2.weight.copy_(block.experts.down_proj[e])
        experts.append(mlp)
    legacy = from_hf_mixtral_experts(experts)
    assert torch.equal(legacy.w13, fused.w13) and torch.equal(legacy.w2, fused.w2)


def test_conversion_errors() -> None:
    with pytest.raises(SpecError, match="unsupported HF model_type"):
        spec_from_hf_config(
            transformers.LlamaConfig(), weight_format=WeightFormat.BF16, act_dtype=torch.bfloat16
        )
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8)
    experts.down_proj = torch.zeros(E, H, I // 2, dtype=torch.uint8)
    with pytest.raises(FormatError, match="quantized experts"):
        from_hf_mixtral_experts(experts)


def test_mxfp4_checkpoint_parity_with_transformers_loader(tmp_path: Path) -> None:
    """moekit-written HF MXFP4 tensors, read by transformers' own MXFP4 loader and by moekit's.

    I = 96 here: transformers' dequantizer keeps every padded element of the last block, so it needs
    in_dim % 32 == 0 (true of gpt-oss, H = I = 2880), while moekit's loader handles ragged tails.
    """
    config = make_config("gpt_oss", intermediate=96)
    block = make_block(config, impl="eager", seed=5)
    quant = from_hf_moe_block(block, config=config, format=WeightFormat.MXFP4)
    layer = GptOssLayer(
        weights=quant.weights,
        router_weight=quant.router_weight,
        router_bias=quant.router_bias,
        naming=CheckpointNaming.HF,
        layer=0,
    )
    full = transformers.GptOssForCausalLM(config)
    tensors = {k: v for k, v in full.state_dict().items() if ".mlp." not in k}
    tensors |= gpt_oss_layer_tensors(layer, layer=0, naming=CheckpointNaming.HF)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    saved = transformers.GptOssConfig.from_dict(config.to_dict())
    saved.quantization_config = {"quant_method": "mxfp4"}
    saved.save_pretrained(tmp_path)

    hf = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    hf_experts = hf.model.layers[0].mlp.experts
    loaded = load_gpt_oss_layer(tmp_path, layer=0)  # naming auto-detected from the HF keys
    assert loaded.naming is CheckpointNaming.HF
    w = loaded.weights
    for e in range(E):  # transformers keeps gate_up_proj [E, H, 2I] and down_proj [E, I, H]
        assert torch.equal(hf_experts.gate_up_proj[e], w.dequantize_w13(e).T)
        assert torch.equal(hf_experts.down_proj[e], w.dequantize_w2(e).T)
    assert torch.equal(hf_experts.gate_up_proj_bias, w.b13) and torch.equal(hf_experts.down_proj_bias, w.b2)

    x = torch.randn(T, H)
    spec = loaded.spec_for(top_k=config.num_experts_per_tok, act_dtype=torch.float32)
    routing = route(loaded.router_logits(x), top_k=spec.K, spec=spec.routing)
    got = fused_moe_reference(x, w, routing, spec=spec)
    err = relative_l2_error(got, hf_forward(hf.model.layers[0].mlp, x))
    print(f"\nMXFP4 checkpoint through transformers' loader: rel L2 {err:.3e}")
    assert err < RTOL_FP32


# ----- reference against the per-token loop -----------------------------------------------------------
FORMATS = [
    (WeightFormat.MXFP4, None),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_CHANNEL),
    (WeightFormat.FP8_E4M3, Fp8Scale.BLOCK_128),
    (WeightFormat.BF16, None),
]
ACTIVATIONS = [
    ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0),
    ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=None),
    ActivationSpec(Activation.SILU, limit=None),
]


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.describe().replace(" ", "_"))
@pytest.mark.parametrize("layout", list(GateLayout), ids=lambda g: g.name)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(("fmt", "fp8_scale"), FORMATS, ids=["mxfp4", "fp8_channel", "fp8_block", "bf16"])
def test_reference_matches_per_token_loop(fmt, fp8_scale, bias, layout, activation) -> None:
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(E, I, H, generator=g) * 0.6
    up = torch.rand(E, I, H, generator=g) - 0.4  # distinct from gate in distribution, not just values
    rows = (
        torch.stack([gate, up], 2).reshape(E, 2 * I, H)
        if layout is GateLayout.INTERLEAVED
        else torch.cat([gate, up], 1)
    )
    biases = dict(b13=torch.randn(E, 2 * I, generator=g), b2=torch.randn(E, H, generator=g)) if bias else {}
    weights = ExpertWeights.from_float(
        w13=rows,
        w2=torch.randn(E, H, I, generator=g) * 0.2,
        format=fmt,
        gate_layout=layout,
        fp8_scale=fp8_scale,
        **biases,
    )
    spec = MoESpec(
        num_experts=E,
        top_k=2,
        hidden_size=H,
        intermediate_size=I,
        weight_format=fmt,
        fp8_scale=fp8_scale,
        act_dtype=torch.float32,
        activation=activation,
        gate_layout=layout,
        has_bias=bias,
        routing=RoutingSpec(RoutingMethod.TOPK_SOFTMAX),
    )
    x = torch.randn(12, H, generator=g)
    routing = route(torch.randn(12, E, generator=g), top_k=2, spec=spec.routing)
    got = fused_moe_reference(x, weights, routing, spec=spec)
    expected = fused_moe_per_token_loop(x, weights, routing, spec=spec)
    assert relative_l2_error(got, expected) < RTOL_FP32


# A config of another model, passed with a block, must not silently change the function: each field the
# block holds itself (router top-k and renormalize flag, SwiGLU alpha and clamp, the activation, the
# experts' sizes) is checked against the config.
MISMATCHES = [
    ("gpt_oss", "num_experts_per_tok", 3, "num_experts_per_tok=3 but the block's router selects top_k=4"),
    ("gpt_oss", "swiglu_limit", 1.0, "swiglu_limit=1.0 but the block's experts clamp at limit=7.0"),
    ("gpt_oss", "swiglu_alpha", 1.0, "swiglu_alpha=1.0 but the block's experts use alpha=1.702"),
    ("gpt_oss", "num_local_experts", 4, "num_local_experts=4 but the block's experts hold E=8"),
    ("gpt_oss", "intermediate_size", 32, "intermediate_size=32 but the block's experts have I=48"),
    ("mixtral", "num_experts_per_tok", 3, "num_experts_per_tok=3 but the block's router selects top_k=2"),
    ("mixtral", "hidden_act", "gelu", "hidden_act='gelu' but the block's experts compute 'silu'"),
    ("mixtral", "hidden_size", 32, "hidden_size=32 but the block's experts have H=64"),
    ("qwen3_moe", "num_experts_per_tok", 2, "num_experts_per_tok=2 but the block's router selects top_k=4"),
    (
        "qwen3_moe",
        "norm_topk_prob",
        False,
        "norm_topk_prob=False but the block's router has norm_topk_prob=True",
    ),
    ("qwen3_moe", "moe_intermediate_size", 32, "moe_intermediate_size=32 but the block's experts have I=48"),
    (
        "qwen3_moe",
        "hidden_act",
        "gelu_pytorch_tanh",
        "hidden_act='gelu_pytorch_tanh' but the block's experts",
    ),
]


@pytest.mark.parametrize(("kind", "field", "value", "message"), MISMATCHES, ids=lambda v: str(v))
def test_config_that_disagrees_with_the_block_is_refused(kind: str, field: str, value, message: str) -> None:
    config = make_config(kind)
    block = make_block(config, impl="eager", seed=0)
    other = make_config(kind)
    setattr(other, field, value)
    with pytest.raises(SpecError, match=rf"config\.{message}.*pass the config of the model"):
        from_hf_moe_block(block, config=other)
    # The block's own config is accepted, and `hf_layer_of` reads the block whatever config it is given.
    assert from_hf_moe_block(block, config=config).spec == hf_layer_of(block, config=other).spec
