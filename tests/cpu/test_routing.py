"""Routing methods against hand-worked cases, independent spellings, and structural invariants."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit import (
    DTypeError,
    ExpertIdError,
    FusedMoE,
    MoESpec,
    NonFiniteError,
    RoutingMethod,
    RoutingResult,
    RoutingSpec,
    ShapeError,
    SpecError,
    WeightFormat,
    route,
)
from moekit.checks import check_expert_map
from moekit.errors import ArgumentError
from moekit.synthetic import random_layer

TOPK_SOFTMAX = RoutingSpec(RoutingMethod.TOPK_SOFTMAX)


def test_topk_softmax_hand_worked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    r = route(logits, top_k=2, spec=TOPK_SOFTMAX)
    assert r.ids.tolist() == [[1, 2]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(r.weights, (e / e.sum()).unsqueeze(0))
    assert r.weights.dtype == torch.float32 and r.ids.dtype == torch.int32


def test_ties_go_to_lower_index():
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, 1.0]])
    for spec in (
        TOPK_SOFTMAX,
        RoutingSpec(RoutingMethod.SOFTMAX_TOPK),
        RoutingSpec(RoutingMethod.SIGMOID_GROUPED),
    ):
        assert route(logits, top_k=2, spec=spec).ids.tolist() == [[1, 2]], spec.method


def test_softmax_topk_without_renormalize_keeps_full_softmax_mass():
    logits = torch.randn(7, 16)
    r = route(logits, top_k=3, spec=RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=False))
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(r.weights, torch.gather(probs, 1, r.ids.long()))
    assert (r.weights.sum(-1) < 1).all()


def test_softmax_topk_renormalized_equals_topk_softmax():
    # Mathematically identical (softmax is monotonic, and renormalizing the K kept probabilities is the
    # softmax over those K logits); the ids must agree exactly, weights to fp32 rounding.
    logits = torch.randn(33, 32)
    a = route(logits, top_k=4, spec=RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=True))
    b = route(logits, top_k=4, spec=TOPK_SOFTMAX)
    assert torch.equal(a.ids, b.ids)
    torch.testing.assert_close(a.weights, b.weights)


def _deepseek_v3_loop(logits, bias, *, k, n_group, topk_group, factor):
    """DeepSeek-V3's grouped routing spelled one token at a time in float64 (independent of route())."""
    ids_out, w_out = [], []
    for row in logits.double():
        s = torch.sigmoid(row)
        choice = s + bias.double()
        per = len(row) // n_group
        group_scores = [
            sorted(choice[g * per : (g + 1) * per].tolist(), reverse=True)[:2] for g in range(n_group)
        ]
        group_scores = [sum(v) for v in group_scores]
        keep = sorted(range(n_group), key=lambda g: (-group_scores[g], g))[:topk_group]
        cands = [e for e in range(len(row)) if e // per in keep]
        chosen = sorted(cands, key=lambda e: (-choice[e].item(), e))[:k]
        w = s[chosen]
        ids_out.append(chosen)
        w_out.append((w / w.sum() * factor).tolist())
    return torch.tensor(ids_out), torch.tensor(w_out)


def test_sigmoid_grouped_matches_deepseek_v3_loop():
    torch.manual_seed(0)
    logits, bias = torch.randn(9, 64), torch.randn(64) * 0.3
    spec = RoutingSpec(
        RoutingMethod.SIGMOID_GROUPED,
        n_group=8,
        topk_group=3,
        has_correction_bias=True,
        routed_scaling_factor=2.5,
    )
    r = route(logits, top_k=6, spec=spec, correction_bias=bias)
    ids, w = _deepseek_v3_loop(logits, bias, k=6, n_group=8, topk_group=3, factor=2.5)
    assert torch.equal(r.ids.long(), ids)
    torch.testing.assert_close(r.weights, w.float())
    torch.testing.assert_close(r.weights.sum(-1), torch.full((9,), 2.5))  # scaling applied exactly once


def test_sigmoid_grouped_weights_ignore_the_bias():
    # The bias steers selection only; the weights are the unbiased sigmoid scores renormalized.
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    spec = RoutingSpec(RoutingMethod.SIGMOID_GROUPED, has_correction_bias=True)
    r = route(logits, top_k=2, spec=spec, correction_bias=bias)
    assert r.ids.tolist() == [[0, 3]]
    s = torch.sigmoid(torch.tensor([0.0, 3.0]))
    torch.testing.assert_close(r.weights[0], s / s.sum())


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 9), e=st.integers(1, 24), data=st.data())
def test_routing_invariants(t, e, data):
    k = data.draw(st.integers(1, e))
    method = data.draw(st.sampled_from(list(RoutingMethod)))
    spec = RoutingSpec(method)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    r = route(logits, top_k=k, spec=spec)
    assert r.ids.shape == (t, k) and r.weights.shape == (t, k)
    if t:
        assert int(r.ids.min()) >= 0 and int(r.ids.max()) < e
        assert all(len(set(row)) == k for row in r.ids.tolist())  # no expert twice in a row
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(t))
        assert (r.weights > 0).all()


def test_route_refuses_bad_input():
    with pytest.raises(ShapeError, match="float \\[T, E\\]"):
        route(torch.zeros(3, 4, 5), top_k=1, spec=TOPK_SOFTMAX)
    with pytest.raises(SpecError, match="top_k must be in \\[1, E=4\\], got 5"):
        route(torch.zeros(3, 4), top_k=5, spec=TOPK_SOFTMAX)
    grouped = RoutingSpec(RoutingMethod.SIGMOID_GROUPED, has_correction_bias=True)
    with pytest.raises(SpecError, match="correction_bias was not given"):
        route(torch.zeros(3, 4), top_k=1, spec=grouped)
    with pytest.raises(ShapeError, match="correction_bias must be \\[E=4\\]"):
        route(torch.zeros(3, 4), top_k=1, spec=grouped, correction_bias=torch.zeros(5))


def test_routing_result_checks():
    with pytest.raises(DTypeError, match="int32"):
        RoutingResult(weights=torch.ones(2, 1), ids=torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ShapeError):
        RoutingResult(weights=torch.ones(2, 2), ids=torch.zeros(2, 1, dtype=torch.int32))
    r = RoutingResult(weights=torch.ones(2, 1), ids=torch.tensor([[0], [7]], dtype=torch.int32))
    with pytest.raises(ExpertIdError, match=r"max=7.*\[1, 0\]"):
        r.check_ids(4)


def test_expert_map_checks():
    check_expert_map(torch.tensor([-1, 0, 1, -1], dtype=torch.int32), num_experts=4, num_local_experts=2)
    with pytest.raises(ExpertIdError, match="same local expert"):
        check_expert_map(torch.tensor([0, 0, 1, -1], dtype=torch.int32), num_experts=4, num_local_experts=2)
    with pytest.raises(ExpertIdError, match="E_local=2"):
        check_expert_map(torch.tensor([0, 2, 1, -1], dtype=torch.int32), num_experts=4, num_local_experts=2)
    with pytest.raises(ExpertIdError, match="int32"):
        check_expert_map(torch.tensor([0, 1]), num_experts=2, num_local_experts=2)


# ----- non-finite logits: the contract in moekit.routing's docstring ------------------------------------
NON_FINITE_SPECS = {
    "topk_softmax": (TOPK_SOFTMAX, None),
    "softmax_topk_renorm": (RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=True), None),
    "softmax_topk_scaled": (
        RoutingSpec(RoutingMethod.SOFTMAX_TOPK, renormalize=False, routed_scaling_factor=2.5),
        None,
    ),
    "sigmoid_grouped": (
        RoutingSpec(RoutingMethod.SIGMOID_GROUPED, n_group=4, topk_group=2, has_correction_bias=True),
        0.1 * torch.arange(16.0),
    ),
}


@pytest.mark.parametrize("name", NON_FINITE_SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_non_finite_logits_are_refused_or_poison_exactly_their_token(name, bad):
    spec, bias = NON_FINITE_SPECS[name]
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    clean = route(logits, top_k=3, spec=spec, correction_bias=bias)
    logits[2, 5] = bad
    with pytest.raises(NonFiniteError, match=r"1 non-finite .*first -?(nan|inf) at \[token 2, expert 5\]"):
        route(logits, top_k=3, spec=spec, correction_bias=bias)
    # Unchecked (as while a CUDA graph is captured): token 2 gets NaN weights, valid ids; the rest as before.
    got = route(logits, top_k=3, spec=spec, correction_bias=bias, check_values=False)
    assert got.weights[2].isnan().all()
    assert 0 <= int(got.ids.min()) and int(got.ids.max()) < 16
    others = [0, 1, 3, 4, 5]
    assert torch.equal(got.ids[others], clean.ids[others])
    assert torch.equal(got.weights[others], clean.weights[others])


@pytest.mark.parametrize("top_k", [2.0, "2", True, 0, -1])
def test_route_refuses_a_top_k_that_is_not_a_positive_int(top_k):
    with pytest.raises(SpecError, match=r"route\(top_k=\.\.\.\)|top_k must be in"):
        route(torch.randn(3, 8), top_k=top_k, spec=RoutingSpec(RoutingMethod.TOPK_SOFTMAX))


# ----- the correction bias, the grouping, dtypes and argument types (route and FusedMoE alike) ---------
GROUPED_BIAS = RoutingSpec(RoutingMethod.SIGMOID_GROUPED, n_group=4, topk_group=2, has_correction_bias=True)
GROUPED_LAYER = MoESpec(
    16, 2, 64, 64, weight_format=WeightFormat.FP32, act_dtype=torch.float32, routing=GROUPED_BIAS
)
FP32_LAYER = MoESpec(4, 2, 64, 64, weight_format=WeightFormat.FP32, act_dtype=torch.float32)


def _bias_with(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bias = 0.1 * torch.arange(16.0, dtype=dtype)
    bias[5] = value
    return bias


@pytest.mark.parametrize(
    "bias",
    [*(_bias_with(float(v)) for v in ("nan", "inf", "-inf")), _bias_with(1e300, torch.float64)],
    ids=["nan", "+inf", "-inf", "float64-beyond-float32"],
)
def test_a_non_finite_correction_bias_is_refused_by_route_and_by_the_layer(bias):
    # A NaN bias would send every token to the same experts, with finite weights.
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    match = r"correction_bias holds 1 of 16 values that are not finite in float32 \(first .* at expert 5\)"
    with pytest.raises(NonFiniteError, match=match):
        route(logits, top_k=2, spec=GROUPED_BIAS, correction_bias=bias)
    route(logits, top_k=2, spec=GROUPED_BIAS, correction_bias=bias, check_values=False)  # values unread
    layer = random_layer(GROUPED_LAYER)
    with pytest.raises(NonFiniteError, match=match):
        FusedMoE(
            spec=GROUPED_LAYER, weights=layer.weights, router_weight=layer.router_weight, correction_bias=bias
        )


@pytest.mark.parametrize("dtype", [torch.int64, torch.float8_e4m3fn], ids=["int64", "fp8"])
def test_a_correction_bias_of_another_dtype_is_refused_by_route_and_by_the_layer(dtype):
    bias = torch.zeros(16).to(dtype)
    with pytest.raises(DTypeError, match=rf"correction_bias must be float32, .*float64, got {dtype}"):
        route(torch.randn(4, 16), top_k=2, spec=GROUPED_BIAS, correction_bias=bias, check_values=False)
    layer = random_layer(GROUPED_LAYER)
    with pytest.raises(DTypeError, match="correction_bias must be"):
        FusedMoE(
            spec=GROUPED_LAYER, weights=layer.weights, router_weight=layer.router_weight, correction_bias=bias
        )


def test_route_refuses_a_top_k_beyond_the_kept_groups_as_moespec_does():
    grouped = RoutingSpec(RoutingMethod.SIGMOID_GROUPED, n_group=4, topk_group=2)
    logits = torch.tensor([[0.0, 0.0, 5.0, 5.0, 4.0, 4.0, -9.0, -9.0]])
    rule = r"K=5 exceeds the experts in the 2 groups kept \(2 x 2\)"
    with pytest.raises(SpecError, match=rule):
        route(logits, top_k=5, spec=grouped)
    with pytest.raises(SpecError, match=rule):
        MoESpec(8, 5, 64, 64, routing=grouped)
    assert sorted(route(logits, top_k=4, spec=grouped).ids[0].tolist()) == [2, 3, 4, 5]  # the kept groups


def test_float64_logits_beyond_the_float32_range_are_refused_not_nan():
    logits = torch.tensor([[0.5, 0.0, 1.0, 2.0], [1e300, 0.0, 1.0, 2.0]], dtype=torch.float64)
    beyond = r"1 of 8 values that are not finite in float32, first 1e\+300 .*at \[token 1, expert 0\]"
    with pytest.raises(NonFiniteError, match=beyond):
        route(logits, top_k=2, spec=TOPK_SOFTMAX)
    # Unchecked: a non-finite logit's contract (routing computes in float32): NaN weights, that token only.
    got = route(logits, top_k=2, spec=TOPK_SOFTMAX, check_values=False)
    assert got.weights[1].isnan().all() and not got.weights[0].isnan().any()
    in_range = route(logits[:1], top_k=2, spec=TOPK_SOFTMAX)
    assert torch.equal(in_range.ids, route(logits[:1].float(), top_k=2, spec=TOPK_SOFTMAX).ids)
    layer = random_layer(FP32_LAYER)
    moe = FusedMoE(spec=FP32_LAYER, weights=layer.weights, router_weight=layer.router_weight)
    with pytest.raises(NonFiniteError, match=r"beyond the float32 range\) at \[token 1, expert 0\]"):
        moe(torch.randn(2, 64), router_logits=-logits)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_router_logits_are_a_dtype_error_naming_the_accepted_dtypes(dtype):
    accepted = rf"must be float32, bfloat16, float16 or float64, got {dtype}"
    with pytest.raises(DTypeError, match=rf"router logits {accepted}"):
        route(torch.zeros(2, 4).to(dtype), top_k=2, spec=TOPK_SOFTMAX)
    layer = random_layer(FP32_LAYER)
    moe = FusedMoE(spec=FP32_LAYER, weights=layer.weights, router_weight=layer.router_weight)
    with pytest.raises(DTypeError, match=rf"router_logits {accepted}"):
        moe(torch.randn(2, 64), router_logits=torch.zeros(2, 4).to(dtype))


@pytest.mark.parametrize("flag", [0, 1, "no", None], ids=["zero", "one", "no", "none"])
def test_route_refuses_check_values_that_is_not_a_bool(flag):
    # 0 would skip the check (NaN weights); "no" would run it, the opposite of what was asked.
    nan_logits = torch.tensor([[float("nan"), 0.0, 1.0, 2.0]])
    with pytest.raises(ArgumentError, match=r"route\(check_values=\.\.\.\) must be True or False"):
        route(nan_logits, top_k=2, spec=TOPK_SOFTMAX, check_values=flag)


@pytest.mark.parametrize(
    ("spec", "fix"),
    [(None, r"got None .*pass a moekit\.RoutingSpec"), (FP32_LAYER, r"got MoESpec.*; pass spec\.routing")],
    ids=["none", "moespec"],
)
def test_route_refuses_a_spec_that_is_not_a_routing_spec(spec, fix):
    with pytest.raises(ArgumentError, match=r"route\(spec=\.\.\.\) must be a RoutingSpec, " + fix):
        route(torch.randn(2, 4), top_k=2, spec=spec)


@pytest.mark.parametrize(
    ("weights", "ids", "field", "got"),
    [
        ([[0.5, 0.5]], torch.zeros(1, 2, dtype=torch.int32), "weights", "a list"),
        (None, torch.zeros(1, 2, dtype=torch.int32), "weights", "None"),
        (torch.full((1, 2), 0.5), [[0, 1]], "ids", "a list"),
        (torch.full((1, 2), 0.5), None, "ids", "None"),
    ],
    ids=["weights-list", "weights-none", "ids-list", "ids-none"],
)
def test_routing_result_refuses_fields_that_are_not_tensors(weights, ids, field, got):
    shown = rf"RoutingResult\.{field} must be a torch\.Tensor .*got {got}; convert"
    with pytest.raises(ShapeError, match=shown):
        RoutingResult(weights=weights, ids=ids)
