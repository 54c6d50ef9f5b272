"""`integrations.transformers.patch`: patched tiny HF models match unpatched logits; unpatch restores all.

Data flow per family: a tiny random GPT-OSS / Mixtral / Qwen3-MoE causal LM (fp32, CPU, 2 layers), its
expert and router weights redrawn large enough that routing and GPT-OSS's clamp matter -> logits and
router logits of the unpatched model -> `patch_model` (each MoE block becomes a `MoekitMoEBlock`) ->
logits again (moekit's CPU kernel, fp32: measured equal to the last bit) -> `unpatch` -> the original
module objects, parameters and values back, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fake_kernels import CudaOnlyGroupedKernel  # noqa: E402
from hf_tiny import randomize_correction_biases, routed_only_config, shared_expert_config  # noqa: E402
from moekit import MoekitError, RoutingMethod, SpecError, UnsupportedSpecError  # noqa: E402
from moekit.errors import ArgumentError  # noqa: E402
from moekit.integrations.transformers.patch import (  # noqa: E402
    Family,
    MoekitMoEBlock,
    patch_model,
    unpatch,
)
from moekit.kernels.registry import KernelRegistry  # noqa: E402
from moekit.layer import PlanOptions  # noqa: E402
from moekit.reference import relative_l2_error  # noqa: E402

H, I, E, VOCAB = 64, 48, 8, 48
_COMMON = dict(
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
)
RTOL = 1e-5  # fp32 end to end; measured 0


def _config(family: Family):
    if family.hf.shared is not None:  # Qwen2-MoE with its default norm_topk_prob=False (Qwen1.5-MoE's)
        return shared_expert_config(
            family,
            hidden=H,
            intermediate=I,
            experts=E,
            top_k=4,
            layers=2,
            heads=4,
            kv_heads=2,
            head_dim=16,
            vocab=VOCAB,
            norm_topk_prob=family.hf.routing_method is RoutingMethod.SIGMOID_GROUPED,
        )
    if family in (Family.OLMOE, Family.MINIMAX_M2):
        return routed_only_config(
            family, hidden=H, intermediate=I, experts=E, top_k=4, layers=2, heads=4, kv_heads=2,
            head_dim=16, vocab=VOCAB,
        )  # fmt: skip
    if family is Family.GPT_OSS:
        return transformers.GptOssConfig(
            intermediate_size=I, num_local_experts=E, num_experts_per_tok=4, **_COMMON
        )
    if family is Family.MIXTRAL:
        return transformers.MixtralConfig(
            intermediate_size=I, num_local_experts=E, num_experts_per_tok=2, **_COMMON
        )
    return transformers.Qwen3MoeConfig(
        moe_intermediate_size=I,
        intermediate_size=2 * I,
        num_experts=E,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        **_COMMON,
    )


def _model(family: Family, *, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    with torch.no_grad():  # the default init (std 0.02) barely routes; GPT-OSS's clamp at 7 should fire
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.2 if name.endswith("bias") else 0.5 if "gate_up" in name else 0.3)
    randomize_correction_biases(model)
    return model


def _snapshot(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the Parameter object, a copy of its values)."""
    return {n: (p, p.detach().clone()) for n, p in model.named_parameters()}


IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("family", list(Family), ids=[f.value for f in Family])
def test_patched_logits_match_and_unpatch_restores_exactly(family: Family) -> None:
    model = _model(family)
    blocks = {n: m for n, m in model.named_modules() if n.endswith(".mlp")}
    before = _snapshot(model)
    with torch.no_grad():
        expected = model(IDS, output_router_logits=True)

    report = patch_model(model)
    assert [b.name for b in report.blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(b.family is family and b.kernel == "torch_grouped" for b in report.blocks)
    assert all(b.released_original for b in report.blocks)
    assert all(isinstance(model.get_submodule(n), MoekitMoEBlock) for n in blocks)
    assert "model.layers.0.mlp" in report.explain()
    # The experts live once, in moekit's layout: the HF experts' storage was released.
    assert all(p.numel() == 0 for n, (p, _) in before.items() if ".experts." in n)
    with torch.no_grad():
        got = model(IDS, output_router_logits=True)
    err = relative_l2_error(got.logits, expected.logits)
    print(f"\n{family.value}: patched vs unpatched logits rel L2 {err:.2e}")
    assert err <= RTOL
    # Router logits are still recorded (the HF router module runs inside the patched block). The first
    # layer's router sees the same embeddings, so its logits are bit-identical; a later layer's router
    # sees the previous patched block's output, which equals HF's only to fp32 summation order (another
    # matmul split, e.g. another thread count, moves its last bits), so it is held to the same RTOL.
    assert len(got.router_logits) == 2
    torch.testing.assert_close(got.router_logits[0], expected.router_logits[0], rtol=0, atol=0)
    for a, b in zip(got.router_logits[1:], expected.router_logits[1:], strict=True):
        assert relative_l2_error(a, b) <= RTOL

    assert unpatch(model) == 2
    assert all(model.get_submodule(n) is m for n, m in blocks.items())
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, values) in before.items():
        assert after[name] is param, name  # the same Parameter objects
        assert param.stride() == values.stride() and torch.equal(param, values), name
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, expected.logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", [Family.GPT_OSS, Family.QWEN3_MOE], ids=["gpt_oss", "qwen3_moe"])
def test_greedy_generation_is_unchanged(family: Family) -> None:
    model = _model(family, seed=1)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(IDS[:1], **kwargs)
    patch_model(model)
    torch.testing.assert_close(model.generate(IDS[:1], **kwargs), expected, rtol=0, atol=0)
    unpatch(model)


def test_keeping_originals_and_patch_errors() -> None:
    model = _model(Family.MIXTRAL)
    before = _snapshot(model)
    report = patch_model(model, release_originals=False)
    assert not any(b.released_original for b in report.blocks)
    assert all(torch.equal(p, v) for p, v in before.values())
    with pytest.raises(SpecError, match="already patched"):
        patch_model(model)
    unpatch(model)
    assert unpatch(model) == 0
    with pytest.raises(SpecError, match="no Hugging Face MoE block"):
        patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(SpecError, match="itself an MoE block"):
        patch_model(model.model.layers[0].mlp)
    for flag in ("no", 0):  # "no" would read as True and release the originals
        with pytest.raises(ArgumentError, match=r"release_originals=...\) must be True or False"):
            patch_model(model, release_originals=flag)
    assert not any(isinstance(m, MoekitMoEBlock) for m in model.modules())


def test_a_model_that_is_not_a_module_is_refused_by_name() -> None:
    with pytest.raises(
        ArgumentError, match=r"patch_model\(model=...\) must be a Module, got 'model' \(str\)"
    ):
        patch_model("model")
    with pytest.raises(ArgumentError, match=r"unpatch\(model=...\) must be a Module, got None"):
        unpatch(None)


def test_a_block_that_cannot_be_planned_leaves_the_model_unpatched() -> None:
    model = _model(Family.GPT_OSS)
    before = _snapshot(model)
    refusing = PlanOptions(registry=KernelRegistry([CudaOnlyGroupedKernel()]), allow_reference=False)
    with pytest.raises(UnsupportedSpecError, match="no registered kernel"):
        patch_model(model, options=refusing)
    assert not any(isinstance(m, MoekitMoEBlock) for m in model.modules())
    assert all(torch.equal(p, v) and p.numel() > 0 for p, v in before.values())


# ----- saving and loading a patched model ------------------------------------------------------------------
def _saved_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors written to {directory}"
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.parametrize("family", list(Family), ids=[f.value for f in Family])
def test_save_pretrained_of_a_patched_model_writes_the_unpatched_checkpoint(family: Family, tmp_path) -> None:
    model = _model(family)
    with torch.no_grad():
        expected = model(IDS).logits
    unpatched_state = model.state_dict()
    model.save_pretrained(tmp_path / "unpatched")
    patch_model(model)
    state = model.state_dict()
    assert list(state) == list(unpatched_state)  # same names, same order
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in unpatched_state.items())

    model.save_pretrained(tmp_path / "patched")
    saved, reference = _saved_tensors(tmp_path / "patched"), _saved_tensors(tmp_path / "unpatched")
    assert saved.keys() == reference.keys()
    assert all(torch.equal(saved[k], v) for k, v in reference.items())
    # Compared with the unpatched save reloaded the same way, not with `expected`: from_pretrained leaves the
    # weights in the mmapped file, off 64-byte alignment, and the CPU GEMMs round differently there (one ulp
    # on a few logits with one thread a worker), so only two reloads of equal files are equal bit for bit.
    reloaded, unpatched_reloaded = (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        for name in ("patched", "unpatched")
    )
    with torch.no_grad():
        logits = reloaded(IDS).logits
        torch.testing.assert_close(logits, unpatched_reloaded(IDS).logits, rtol=0, atol=0)
        torch.testing.assert_close(logits, expected)  # and the reload is the model that was saved
    unpatch(model)  # saving left the patched model as it was
    assert all(torch.equal(p, unpatched_state[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family", [Family.GPT_OSS, Family.MIXTRAL], ids=["gpt_oss", "mixtral"])
@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
def test_load_state_dict_into_a_patched_model_loads_the_experts(family: Family, release: bool) -> None:
    source = _model(family)
    with torch.no_grad():
        expected = source(IDS).logits
    state = source.state_dict()
    patch_model(source)
    with torch.no_grad():
        expected_patched = source(IDS).logits

    model = _model(family, seed=5)
    patch_model(model, release_originals=release)
    assert not torch.equal(model(IDS).logits, expected_patched)
    model.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, expected_patched, rtol=0, atol=0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=0)


def test_a_bad_state_dict_is_refused_and_leaves_the_patched_model_as_it_was() -> None:
    model = _model(Family.QWEN3_MOE)
    state = model.state_dict()
    patch_model(model)
    with torch.no_grad():
        before = model(IDS).logits
    key = "model.layers.1.mlp.experts.down_proj"
    with pytest.raises(RuntimeError, match=f"Missing key.*{key}"):
        model.load_state_dict({k: v for k, v in state.items() if k != key})
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
        model.load_state_dict(state | {key: state[key][:, :-1]})
    with pytest.raises(RuntimeError, match="Unexpected key.*experts.bogus"):
        model.load_state_dict(state | {"model.layers.0.mlp.experts.bogus": torch.zeros(1)})
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, before, rtol=0, atol=0)


# ----- casts and moves -------------------------------------------------------------------------------------
def _every_tensor(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (moekit's non-persistent ones too) and every moekit weight tensor."""
    found = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, m in model.named_modules():
        if isinstance(m, MoekitMoEBlock):
            found |= {f"{name}.moe.weights.{n}": t for n, t in m.moe.weights.tensors().items()}
    return found


CASTS = {
    "half": lambda m: m.half(),
    "to_bf16": lambda m: m.to(torch.bfloat16),
    "to_fp16_cpu": lambda m: m.to("cpu", torch.float16),
    "double": lambda m: m.double(),
    "inner_model_half": lambda m: m.model.half(),
    "layers_half": lambda m: m.model.layers.half(),
    "block_half": lambda m: m.model.layers[1].mlp.half(),
    "to_meta": lambda m: m.to("meta"),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("family", list(Family), ids=[f.value for f in Family])
def test_a_refused_cast_leaves_every_tensor_as_it_was(family: Family, cast: str) -> None:
    model = _model(family)
    patch_model(model)
    with torch.no_grad():
        before_logits = model(IDS).logits
    before = {n: (t, t.dtype, t.device, t.detach().clone()) for n, t in _every_tensor(model).items()}
    with pytest.raises(MoekitError, match="act_dtype|cpu or cuda"):
        CASTS[cast](model)
    after = _every_tensor(model)
    assert after.keys() == before.keys()
    for name, (t, dtype, device, values) in before.items():
        assert after[name] is t and t.dtype == dtype and t.device == device, name
        assert torch.equal(t, values), name
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, before_logits, rtol=0, atol=0)


def test_same_dtype_casts_and_device_moves_work_and_unpatch_removes_the_guards() -> None:
    model = _model(Family.GPT_OSS)
    with torch.no_grad():
        expected = model(IDS).logits
    patch_model(model)
    with torch.no_grad():
        before = model(IDS).logits
    assert model.float() is model and model.to("cpu") is model and model.to(torch.float32) is model
    assert model.cpu() is model and model.to("cpu", torch.float32) is model
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, before, rtol=0, atol=0)
    unpatch(model)
    assert not any("_apply" in m.__dict__ for m in model.modules())
    model.half()  # the unpatched model casts as transformers does
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with torch.no_grad():
        torch.testing.assert_close(model.float()(IDS).logits, expected, rtol=2e-2, atol=2e-2)
