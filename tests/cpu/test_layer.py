"""`moekit.FusedMoE` on the CPU: early planning, forward against the reference, buckets, errors, constructors.

Data flow per case: a spec -> `random_layer` (weights never zero, gate and up distinct) -> `FusedMoE` ->
forward on random tokens -> compared with `fused_moe_reference` on the same router logits (fp32 router:
x @ W^T + b). Checkpoint constructors round-trip through `save_gpt_oss_layer` in both namings; the HF
constructor is compared with the HF block's own forward.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import replace

import pytest
import torch

from fake_kernels import CudaOnlyGroupedKernel
from moekit import (
    Activation,
    ActivationSpec,
    DeviceError,
    DTypeError,
    ExpertIdError,
    GateLayout,
    MoekitError,
    MoESpec,
    NonFiniteError,
    RoutingMethod,
    RoutingSpec,
    ShapeError,
    SpecError,
    UnsupportedSpecError,
    WeightFormat,
    fused_moe,
    fused_moe_reference,
    route,
)
from moekit.checkpoint import CheckpointNaming, GptOssLayer, save_gpt_oss_layer
from moekit.custom_op import live_handles, lookup_layer
from moekit.errors import ArgumentError
from moekit.integrations.transformers import fused_moe_from_hf
from moekit.kernels.base import DeviceInfo
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.layer import FusedMoE, PlanOptions
from moekit.planning.plan import plan
from moekit.planning.tuned import token_bucket
from moekit.reference import relative_l2_error
from moekit.routing import RoutingResult
from moekit.synthetic import random_layer, random_tokens

FP32 = MoESpec(
    num_experts=8,
    top_k=2,
    hidden_size=64,
    intermediate_size=48,
    weight_format=WeightFormat.FP32,
    act_dtype=torch.float32,
)
GPT_OSS_SMALL = MoESpec(
    num_experts=8,
    top_k=4,
    hidden_size=80,
    intermediate_size=48,
    weight_format=WeightFormat.MXFP4,
    act_dtype=torch.float32,
    activation=ActivationSpec.gpt_oss(),
    gate_layout=GateLayout.INTERLEAVED,
    has_bias=True,
)
SPECS = {
    # name: (spec, tolerance, why)
    "fp32-concat": (FP32, 1e-6, "exact-comparison path, SILU, CONCAT"),
    "gpt-oss-mxfp4": (GPT_OSS_SMALL, 1e-6, "MXFP4 + biases + SWIGLU_OAI, ragged MXFP4 tails (H=80, I=48)"),
    "bf16-swiglu-alpha1": (
        replace(
            FP32,
            weight_format=WeightFormat.BF16,
            act_dtype=torch.bfloat16,
            has_bias=True,
            activation=ActivationSpec(Activation.SWIGLU_OAI, alpha=1.0, limit=3.0),
        ),
        1e-2,
        "bf16 activations and biases, a non-default alpha and limit",
    ),
    "deepseek-grouped": (
        replace(
            FP32,
            num_experts=16,
            top_k=4,
            routing=RoutingSpec(
                RoutingMethod.SIGMOID_GROUPED,
                n_group=4,
                topk_group=2,
                has_correction_bias=True,
                routed_scaling_factor=2.5,
            ),
        ),
        1e-6,
        "sigmoid grouped routing, correction bias, scaling factor",
    ),
    "expert-parallel": (replace(FP32, num_local_experts=4), 1e-6, "E_local=4 of E=8 through an expert map"),
}
EXPERT_MAP = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)


def _layer(spec: MoESpec, *, seed: int = 0, **kwargs) -> tuple[FusedMoE, object]:
    layer = random_layer(spec, seed=seed)
    expert_map = EXPERT_MAP if spec.uses_expert_map else None
    bias = torch.randn(spec.E, generator=torch.Generator().manual_seed(seed)) * 0.1 if spec.has_bias else None
    moe = FusedMoE(
        spec=spec,
        weights=layer.weights,
        router_weight=layer.router_weight,
        router_bias=bias,
        correction_bias=layer.correction_bias,
        expert_map=expert_map,
        **kwargs,
    )
    return moe, layer


def _expected(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.reshape(-1, moe.spec.H)
    if logits is None:
        bias = None if moe.router_bias is None else moe.router_bias.float()
        logits = torch.nn.functional.linear(flat.float(), moe.router_weight.float(), bias)
    routing = route(
        logits.reshape(-1, moe.spec.E),
        top_k=moe.spec.K,
        spec=moe.spec.routing,
        correction_bias=moe.correction_bias,
    )
    out = fused_moe_reference(flat, moe.weights, routing, spec=moe.spec, expert_map=moe.expert_map)
    return out.reshape(x.shape)


# ----- construction plans early ----------------------------------------------------------------------------
def test_construction_plans_bucket_one_and_prepares_its_kernel() -> None:
    moe, _ = _layer(GPT_OSS_SMALL)
    assert list(moe.plans) == [1]
    assert moe.plans[1].kernel == "torch_grouped"  # the best capable kernel on a CPU
    assert moe.state_dict() == {}  # weights are rebuilt from checkpoints, never loaded into the module
    assert moe.handle in live_handles() and lookup_layer(moe.handle) is moe
    assert "bucket 1" in moe.explain() and "torch_grouped" in repr(moe)


@pytest.mark.parametrize(
    "registry",
    [
        KernelRegistry([CudaOnlyGroupedKernel()]),  # a capable kernel that this device refuses
        default_registry().without(
            "torch_grouped"
        ),  # the real registry: Triton (CUDA only) is all that is left
    ],
    ids=["cuda_only_kernel", "default_without_torch_grouped"],
)
def test_unsupported_spec_fails_at_construction_with_the_planners_message(registry: KernelRegistry) -> None:
    options = PlanOptions(registry=registry, allow_reference=False)
    with pytest.raises(UnsupportedSpecError) as from_planner:
        plan(
            GPT_OSS_SMALL, num_tokens=1, device=DeviceInfo.of("cpu"), registry=registry, allow_reference=False
        )
    before = set(live_handles())
    with pytest.raises(UnsupportedSpecError) as from_layer:
        _layer(GPT_OSS_SMALL, options=options)
    assert str(from_layer.value) == str(from_planner.value)
    assert "allow_reference=True" in str(from_layer.value)  # the planner's nearest alternative
    assert set(live_handles()) <= before  # nothing registered for a layer that was never built


# ----- forward ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SPECS))
def test_forward_matches_the_reference(name: str) -> None:
    spec, tol, _why = SPECS[name]
    moe, _ = _layer(spec, seed=len(name))
    x = random_tokens(spec, 37)
    got = moe(x)
    assert got.dtype == spec.act_dtype and got.shape == x.shape
    assert relative_l2_error(got, _expected(moe, x)) <= tol


def test_leading_dims_and_given_router_logits() -> None:
    moe, _ = _layer(FP32)
    x = random_tokens(FP32, 24).reshape(2, 3, 4, FP32.H)
    flat = moe(x.reshape(-1, FP32.H))
    torch.testing.assert_close(moe(x), flat.reshape(x.shape), rtol=0, atol=0)
    logits = torch.randn(2, 3, 4, FP32.E)
    expected = _expected(moe, x, logits)
    torch.testing.assert_close(moe(x, router_logits=logits), expected, rtol=1e-6, atol=1e-6)
    flat_logits = logits.reshape(-1, FP32.E)
    torch.testing.assert_close(moe(x, router_logits=flat_logits), expected, rtol=1e-6, atol=1e-6)
    assert moe(x[:, :, :0]).shape == (2, 3, 0, FP32.H)  # zero tokens


def test_tokens_per_expert_counts_the_last_forward_when_asked() -> None:
    moe, _ = _layer(FP32)
    x = random_tokens(FP32, 29)
    moe(x)
    assert moe.tokens_per_expert.tolist() == [0] * FP32.E  # off by default
    moe.count_tokens_per_expert = True
    logits = torch.randn(29, FP32.E)
    for rows in (29, 5):  # each forward replaces the counts, it does not add to them
        moe(x[:rows], router_logits=logits[:rows])
        ids = route(logits[:rows], top_k=FP32.K, spec=FP32.routing).ids
        expected = torch.bincount(ids.flatten().long(), minlength=FP32.E)
        assert moe.tokens_per_expert.tolist() == expected.tolist()
        assert int(moe.tokens_per_expert.sum()) == rows * FP32.K


def test_warmup_plans_every_bucket_and_forward_plans_lazily() -> None:
    moe, _ = _layer(FP32)
    moe(random_tokens(FP32, 40))
    assert sorted(moe.plans) == [1, 64]  # bucket 1 at construction, 64 at the first forward of 40 tokens
    report = moe.warmup(100)
    assert report.buckets == (1, 2, 4, 8, 16, 32, 64, 128) and sorted(moe.plans) == list(report.buckets)
    assert all(token_bucket(t) in report.buckets for t in report.token_counts)
    assert {token_bucket(t) for t in report.token_counts} == set(report.buckets)
    assert moe.warmup(3, execute=False).token_counts == ()


def test_warmup_token_counts_cover_every_triton_specialization() -> None:
    # K=4, E_local=8, block_m=16: in bucket 32 (T = 17..32) the pair count T*K is a multiple of 16 for
    # T % 4 == 0; the M-block bound min(P, ceil(P/16) + 8) is too for some T. Both classes must be run.
    triton = pytest.importorskip("moekit.kernels.triton.kernel")
    kernel = triton.TritonFusedKernel()
    counts = kernel.warmup_token_counts(32, GPT_OSS_SMALL, kernel.config_type(block_m=16))
    assert all(17 <= t <= 32 for t in counts) and 32 in counts
    classes = {((t * 4) % 16 == 0, (min(t * 4, -(-t * 4 // 16) + 8)) % 16 == 0) for t in range(17, 33)}
    assert {((t * 4) % 16 == 0, (min(t * 4, -(-t * 4 // 16) + 8)) % 16 == 0) for t in counts} == classes


def test_warmup_token_counts_of_a_kernel_that_compiles_nothing() -> None:
    # The default: one T per class of the pair count T*K (here P = 4T: P == 1 never, P % 16 == 0 for
    # T % 4 == 0), and T = 0 in bucket 1.
    kernel = default_registry().get("reference")
    config = kernel.config_type()
    assert kernel.warmup_token_counts(1, GPT_OSS_SMALL, config) == (0, 1)
    assert kernel.warmup_token_counts(32, GPT_OSS_SMALL, config) == (31, 32)


def test_workspace_bytes_grows_with_tokens_and_covers_the_output() -> None:
    moe, _ = _layer(GPT_OSS_SMALL)
    sizes = [moe.workspace_bytes(t) for t in (0, 1, 16, 17, 1024)]
    assert sizes[0] == 0 and sizes == sorted(sizes)
    spec = GPT_OSS_SMALL
    out_and_intermediates = 1024 * (spec.H * 4 + spec.K * (2 * spec.I + spec.H) * 4)
    assert out_and_intermediates <= sizes[-1] <= 4 * out_and_intermediates


# ----- errors before any compute ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make_input", "error"),
    [
        (lambda: torch.zeros(4, FP32.H + 1), ShapeError),  # wrong hidden size
        (lambda: torch.zeros(4, FP32.H, dtype=torch.bfloat16), DTypeError),  # wrong act dtype
        (lambda: torch.zeros(4, FP32.H, device="meta"), DeviceError),  # another device
        (lambda: torch.zeros(()), ShapeError),  # a scalar
    ],
    ids=["hidden", "dtype", "device", "scalar"],
)
def test_bad_hidden_states_raise_before_compute(make_input, error, monkeypatch) -> None:
    moe, _ = _layer(FP32)
    monkeypatch.setattr(FusedMoE, "run_flat", lambda *a: pytest.fail("computed despite bad input"))
    with pytest.raises(error):
        moe(make_input())


def test_bad_router_inputs_raise() -> None:
    moe, layer = _layer(FP32)
    x = random_tokens(FP32, 6)
    with pytest.raises(ShapeError, match="router_logits"):
        moe(x, router_logits=torch.zeros(6, FP32.E + 1))
    with pytest.raises(DTypeError, match="router_logits"):
        moe(x, router_logits=torch.zeros(6, FP32.E, dtype=torch.int64))
    with pytest.raises(ShapeError, match="router_weight"):
        FusedMoE(spec=FP32, weights=layer.weights, router_weight=layer.router_weight.T)
    with pytest.raises(SpecError, match="correction_bias"):
        FusedMoE(
            spec=FP32,
            weights=layer.weights,
            router_weight=layer.router_weight,
            correction_bias=torch.zeros(8),
        )
    with pytest.raises(SpecError, match="expert_map"):
        FusedMoE(
            spec=replace(FP32, num_local_experts=8), weights=layer.weights, router_weight=layer.router_weight
        )
    no_router = FusedMoE(spec=FP32, weights=layer.weights, router_weight=None)
    with pytest.raises(SpecError, match="router_logits"):
        no_router(x)
    ones = torch.ones(6, FP32.E)
    torch.testing.assert_close(no_router(x, router_logits=ones), moe(x, router_logits=ones))


ROUTINGS = {
    "topk_softmax": FP32,
    "softmax_topk": replace(FP32, routing=RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=False)),
    "sigmoid_grouped": SPECS["deepseek-grouped"][0],
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_non_finite_router_logits_raise_or_poison_only_their_row(name: str, bad: float) -> None:
    spec = ROUTINGS[name]
    moe, _ = _layer(spec)
    x = random_tokens(spec, 5)
    logits = torch.randn(5, spec.E, generator=torch.Generator().manual_seed(1))
    clean = moe(x, router_logits=logits)
    logits[3, 1] = bad
    with pytest.raises(NonFiniteError, match=r"\[token 3, expert 1\]"):
        moe(x, router_logits=logits)
    nan_token = x.clone()
    nan_token[2, 0] = bad  # through the layer's own router: every logit of token 2 is non-finite
    with pytest.raises(NonFiniteError, match=r"token 2"):
        moe(nan_token)
    # Value checks off (as while a CUDA graph is captured): NaN in exactly the poisoned token's row.
    moe.check_values = False
    got = moe(x, router_logits=logits)
    assert got[3].isnan().all()
    keep = [0, 1, 2, 4]  # same routing as before; the grouped GEMM's groups (and fp32 sums) may differ
    torch.testing.assert_close(got[keep], clean[keep], rtol=1e-5, atol=1e-6)


def _map(*ids: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(ids, dtype=dtype)


@pytest.mark.parametrize(
    ("expert_map", "fragment"),
    [
        ([-1, 0, -1, 1, 2, -1, 3, -1], r"must be an int32 torch.Tensor \[E=8\], got a list"),
        (_map(-1, 0, -1, 1, 2, -1, 3, -1, dtype=torch.int64), r"must be int32 \[E=8\], got torch.int64"),
        (_map(0, 1, 2, -1, -1, -1, -1, -1), r"leaves local experts \[3\] unmapped"),
        (_map(0, 1, 2, 2, -1, -1, -1, -1), r"same local expert \(local ids \[2\]\) and leaves .*\[3\]"),
    ],
    ids=["list", "int64", "fewer_local_ids", "duplicate"],
)
def test_a_malformed_expert_map_is_refused_by_the_layer_and_by_fused_moe(expert_map, fragment) -> None:
    spec = SPECS["expert-parallel"][0]
    layer = random_layer(spec)
    with pytest.raises(ExpertIdError, match=fragment):
        FusedMoE(spec=spec, weights=layer.weights, router_weight=layer.router_weight, expert_map=expert_map)
    routing = RoutingResult(weights=torch.full((1, 2), 0.5), ids=torch.tensor([[1, 3]], dtype=torch.int32))
    x, pl = random_tokens(spec, 1), plan(spec, num_tokens=1, device="cpu")
    with pytest.raises(ExpertIdError, match=fragment):
        fused_moe(x, layer.weights, routing, plan=pl, expert_map=expert_map)


def test_backward_says_the_layer_is_inference_only() -> None:
    moe, _ = _layer(FP32)
    x = random_tokens(FP32, 3).requires_grad_()
    y = moe(x)  # a forward under grad mode runs (an HF model evaluated without no_grad)
    with pytest.raises(ArgumentError, match="inference-only.*torch.no_grad"):
        y.sum().backward()
    with torch.no_grad():
        assert not moe(x).requires_grad


@pytest.mark.parametrize("switch", ["check_values", "count_tokens_per_expert"])
def test_layer_switches_take_only_a_bool(switch: str) -> None:
    moe, _ = _layer(FP32)
    with pytest.raises(ArgumentError, match=rf"FusedMoE.{switch} must be True or False.*reads 'no' as True"):
        setattr(moe, switch, "no")
    with pytest.raises(ArgumentError, match=rf"FusedMoE.{switch} must be True or False, got 0 \(int\)"):
        setattr(moe, switch, 0)
    default = getattr(moe, switch)
    setattr(moe, switch, not default)
    assert getattr(moe, switch) is (not default) and getattr(copy.deepcopy(moe), switch) is (not default)
    assert getattr(_layer(FP32)[0], switch) is default  # the setting belongs to one layer


# ----- module plumbing -------------------------------------------------------------------------------------
def test_casts_are_refused_and_same_device_moves_are_no_ops() -> None:
    moe, _ = _layer(GPT_OSS_SMALL)
    x = random_tokens(GPT_OSS_SMALL, 5)
    before = moe(x)
    wrapper = torch.nn.Sequential(moe)
    assert wrapper.to("cpu") is wrapper and wrapper.float() is wrapper  # act dtype is fp32: no-ops
    with pytest.raises(DTypeError, match="act_dtype"):
        wrapper.to(torch.bfloat16)
    with pytest.raises(DTypeError):
        moe.double()
    assert moe.weights.b13.dtype == GPT_OSS_SMALL.act_dtype
    torch.testing.assert_close(moe(x), before, rtol=0, atol=0)


def test_a_refused_move_leaves_the_layer_as_it_was() -> None:
    moe, _ = _layer(GPT_OSS_SMALL)
    x = random_tokens(GPT_OSS_SMALL, 5)
    before, plans = moe(x), moe.plans
    tensors = dict(moe.weights.tensors()) | dict(moe.named_buffers())
    with pytest.raises(DeviceError, match="meta"):
        torch.nn.Sequential(moe).to("meta")
    with pytest.raises(DeviceError, match="meta"):
        moe.check_conversion(lambda t: t.to("meta"))
    # A device whose planner refuses the spec (a CUDA one, on a CPU-only machine simulated): all or nothing.
    refusing = UnsupportedSpecError("no registered kernel supports this spec on the new device")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "plan_for", lambda n: (_ for _ in ()).throw(refusing))
        with pytest.raises(UnsupportedSpecError, match="new device"):
            moe._move(torch.device("cpu"))
    assert moe.device == torch.device("cpu") and moe.plans == plans
    after = dict(moe.weights.tensors()) | dict(moe.named_buffers())
    assert after.keys() == tensors.keys() and all(after[n] is t for n, t in tensors.items())
    torch.testing.assert_close(moe(x), before, rtol=0, atol=0)


def test_a_device_this_machine_lacks_is_plans_device_error_before_any_tensor_moves() -> None:
    missing = f"cuda:{torch.cuda.device_count()}"  # past the last GPU, or any GPU on a CPU-only machine
    with pytest.raises(DeviceError) as from_planner:
        plan(FP32, num_tokens=1, device=missing)
    with pytest.raises(DeviceError) as from_layer:
        _layer(FP32, device=missing)
    assert str(from_layer.value) == str(from_planner.value) and missing in str(from_layer.value)
    with pytest.raises(DeviceError, match="'gpu0' is not a device string"):
        _layer(FP32, device="gpu0")
    with pytest.raises(DeviceError, match="cpu or cuda devices, got meta"):  # before the MXFP4 scale scan
        _layer(GPT_OSS_SMALL, device="meta")
    moe, _ = _layer(FP32)
    x = random_tokens(FP32, 4)
    before = moe(x)
    for move in (lambda: moe.to(missing), lambda: torch.nn.Sequential(moe).to(torch.device(missing))):
        with pytest.raises(DeviceError) as from_move:
            move()
        assert "FusedMoE cannot move there: torch refused the device" in str(from_move.value)
    with pytest.raises(DeviceError, match="torch refused the device"):
        moe.cuda(torch.cuda.device_count())
    assert moe.device == torch.device("cpu")
    torch.testing.assert_close(moe(x), before, rtol=0, atol=0)


def test_copies_get_their_own_handle_and_freed_layers_leave_the_registry() -> None:
    moe, _ = _layer(FP32)
    x = random_tokens(FP32, 9)
    twin = copy.deepcopy(moe)
    assert twin.handle != moe.handle and lookup_layer(twin.handle) is twin
    torch.testing.assert_close(twin(x), moe(x), rtol=0, atol=0)
    handle = twin.handle
    del twin
    gc.collect()
    assert handle not in live_handles()
    with pytest.raises(MoekitError, match="no live moekit layer"):
        lookup_layer(handle)


# ----- constructors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("naming", list(CheckpointNaming))
def test_from_gpt_oss_checkpoint_in_both_namings(naming: CheckpointNaming, tmp_path) -> None:
    layer = random_layer(replace(GPT_OSS_SMALL, act_dtype=torch.bfloat16), seed=5)
    router_bias = (torch.randn(GPT_OSS_SMALL.E) * 0.1).to(torch.bfloat16)
    saved = GptOssLayer(
        weights=layer.weights,
        router_weight=layer.router_weight,
        router_bias=router_bias,
        naming=naming,
        layer=3,
    )
    path = save_gpt_oss_layer(tmp_path / "model.safetensors", saved, layer=3, naming=naming)
    moe = FusedMoE.from_gpt_oss_checkpoint(path, 3, act_dtype=torch.float32)
    assert moe.spec == saved.spec_for(act_dtype=torch.float32)
    x = random_tokens(moe.spec, 21)
    routing = route(saved.router_logits(x), top_k=4, spec=moe.spec.routing)
    expected = fused_moe_reference(x, saved.weights, routing, spec=moe.spec)
    assert relative_l2_error(moe(x), expected) < 1e-6


@pytest.mark.parametrize("kind", ["gpt_oss", "mixtral", "qwen3_moe"])
def test_from_hf_module_matches_the_hf_block(kind: str) -> None:
    pytest.importorskip("transformers")
    from test_hf_parity import hf_forward, make_block, make_config

    config = make_config(kind)
    block = make_block(config, impl="eager", seed=11)
    moe = fused_moe_from_hf(block)  # no config: sizes, top-k and activation read off the module
    assert moe.spec == fused_moe_from_hf(block, config=config).spec
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(2))
    expected = hf_forward(block, x.reshape(-1, config.hidden_size)).reshape(x.shape)
    assert relative_l2_error(moe(x), expected) < 1e-5
    with pytest.raises(SpecError, match="model_type"):
        fused_moe_from_hf(block, config=make_config("mixtral" if kind != "mixtral" else "gpt_oss"))
    with pytest.raises(SpecError, match="not a supported"):
        fused_moe_from_hf(block.experts)
