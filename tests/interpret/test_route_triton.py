"""The one-launch routings (`moekit.kernels.triton.route`: softmax, DeepSeek-V3's grouped sigmoid)
against the torch twin (`moekit.routing.route_torch`, what `moekit.route` runs off CUDA): identical ids,
weights within fp32 rounding. On the CPU under TRITON_INTERPRET=1 (set by conftest.py); on a GPU the
same tests run compiled and are marked `gpu`, and test_interpreter_suite.py also runs them interpreted
in a child pytest with CUDA hidden."""

import pytest
import torch

pytest.importorskip("triton")

from moekit import NonFiniteError, RoutingMethod, RoutingSpec, route  # noqa: E402
from moekit.kernels.triton.route import (  # noqa: E402
    MAX_EXPERTS,
    fast_route_supported,
    route_one_launch,
    route_sigmoid_grouped,
    route_softmax,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Compiled on a CUDA machine, so `pytest -m gpu` runs them there; interpreted anywhere else.
pytestmark = pytest.mark.gpu if DEVICE == "cuda" else pytest.mark.interpret

SPECS = [
    RoutingSpec(method=RoutingMethod.TOPK_SOFTMAX),
    RoutingSpec(method=RoutingMethod.SOFTMAX_TOPK, renormalize=True),
    RoutingSpec(method=RoutingMethod.SOFTMAX_TOPK, renormalize=False, routed_scaling_factor=2.5),
]


def _torch_route(logits, top_k, spec, bias=None):
    """The torch path whatever the device: route() on CPU copies (values unchecked, so that non-finite
    logits reach the twin's NaN rule instead of route's NonFiniteError)."""
    cpu_bias = None if bias is None else bias.cpu()
    r = route(logits.cpu(), top_k=top_k, spec=spec, correction_bias=cpu_bias, check_values=False)
    return r.weights, r.ids


@pytest.mark.parametrize("spec", SPECS, ids=["topk_softmax", "softmax_topk_renorm", "softmax_topk_scaled"])
@pytest.mark.parametrize(
    ("t", "e", "k", "dtype"),
    [
        (1, 128, 4, torch.bfloat16),
        (37, 6, 2, torch.float32),
        (34, 100, 8, torch.float16),  # more tokens than a warp has lanes, a program each
        (5, 3, 3, torch.float32),
    ],
)
def test_matches_the_torch_path(spec, t, e, k, dtype):
    gen = torch.Generator().manual_seed(t * 7 + e)
    logits = (3 * torch.randn(t, e, generator=gen)).to(dtype).to(DEVICE)
    weights, ids = route_softmax(logits, top_k=k, spec=spec)
    want_w, want_ids = _torch_route(logits, k, spec)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("spec", SPECS[:2], ids=["topk_softmax", "softmax_topk"])
def test_ties_signed_zeros_and_infinities_order_as_torch_does(spec):
    """Integer logits tie everywhere; -0.0 equals +0.0; -inf is selectable; the lower index wins."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-2, 3, (64, 24), generator=gen).float()
    logits[0, :] = 0.0
    logits[0, 1::2] = -0.0
    logits[1, :] = -float("inf")
    logits[1, 5] = 1.0
    logits[2, ::3] = float("inf") if spec.method is RoutingMethod.TOPK_SOFTMAX else 0.0
    logits = logits.to(DEVICE)
    weights, ids = route_softmax(logits, top_k=5, spec=spec)
    want_w, want_ids = _torch_route(logits, 5, spec)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7, equal_nan=True)


def test_nan_logits_are_selected_first_as_torch_sorts_them():
    spec = SPECS[0]
    logits = torch.tensor([[0.5, float("nan"), 2.0, float("nan"), -1.0]]).to(DEVICE)
    _, ids = route_softmax(logits, top_k=3, spec=spec)
    assert ids.cpu().tolist() == _torch_route(logits, 3, spec)[1].tolist() == [[1, 3, 2]]


@pytest.mark.parametrize("spec", SPECS, ids=["topk_softmax", "softmax_topk_renorm", "softmax_topk_scaled"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_non_finite_logits_poison_their_token_as_the_twin_does(spec, bad):
    """Unchecked (as in a captured graph), a token with a non-finite logit gets NaN weights in the fast
    route too; every other token keeps its ids and weights. Checked, `route` refuses it on any device."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(40, 24, generator=gen)
    logits[7, 3] = bad
    logits[30, :] = bad  # a token with nothing finite
    logits = logits.to(DEVICE)
    weights, ids = route_softmax(logits, top_k=4, spec=spec)
    want_w, want_ids = _torch_route(logits, 4, spec)
    assert weights[[7, 30]].isnan().all() and want_w[[7, 30]].isnan().all()
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert torch.isfinite(weights[[i for i in range(40) if i not in (7, 30)]]).all()
    with pytest.raises(NonFiniteError, match=r"25 non-finite .*\[token 7, expert 3\]"):
        route(logits, top_k=4, spec=spec)


def test_zero_tokens_and_strided_logits():
    spec = SPECS[1]
    weights, ids = route_softmax(torch.empty(0, 8, device=DEVICE), top_k=2, spec=spec)
    assert weights.shape == ids.shape == (0, 2)
    wide = torch.randn(9, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, ids = route_softmax(wide[:, :16], top_k=3, spec=spec)  # row stride 32
    want_w, want_ids = _torch_route(wide[:, :16].contiguous(), 3, spec)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7)


def test_what_stays_on_the_torch_path():
    """Every method takes the one-launch route up to MAX_EXPERTS (DeepSeek-V3's grouped sigmoid
    included); only wider routers stay on the torch twin."""
    from moekit import preset

    grouped = preset("deepseek-v3").routing
    assert fast_route_supported(grouped, 256) and fast_route_supported(grouped, MAX_EXPERTS)
    assert not fast_route_supported(grouped, 2 * MAX_EXPERTS)
    assert not fast_route_supported(SPECS[0], MAX_EXPERTS + 1)
    assert fast_route_supported(SPECS[0], 128) and fast_route_supported(SPECS[1], MAX_EXPERTS)


def _grouped(n_group=None, topk_group=None, bias=False, scaling=1.0):
    return RoutingSpec(
        method=RoutingMethod.SIGMOID_GROUPED,
        n_group=n_group,
        topk_group=topk_group,
        has_correction_bias=bias,
        routed_scaling_factor=scaling,
    )


GROUPED = {
    # name: (spec, T, E, K, why)
    "deepseek-v3": (_grouped(8, 4, True, 2.5), 19, 256, 8, "8 groups of 32, 4 kept, bias, scaled"),
    "no-groups": (_grouped(bias=True), 33, 64, 6, "n_group None: top K over every expert"),
    "one-a-group": (_grouped(16, 5, False), 20, 16, 3, "groups of one expert: the group score is that one"),
    "ragged": (_grouped(4, 2, True), 41, 60, 4, "E = 60, not a power of two; groups of 15"),
}


def _grouped_case(name, dtype=torch.float32, seed=0):
    spec, t, e, k, _ = GROUPED[name]
    gen = torch.Generator().manual_seed(seed + t)
    logits = (2 * torch.randn(t, e, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(e, generator=gen)) if spec.has_correction_bias else None
    return spec, k, logits, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GROUPED))
def test_grouped_sigmoid_matches_the_torch_path(name, dtype):
    spec, k, logits, bias = _grouped_case(name, dtype)
    weights, ids = route_sigmoid_grouped(
        logits.to(DEVICE), top_k=k, spec=spec, correction_bias=None if bias is None else bias.to(DEVICE)
    )
    want_w, want_ids = _torch_route(logits, k, spec, bias)
    assert torch.equal(ids.cpu(), want_ids), GROUPED[name][4]
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7)


def test_grouped_sigmoid_ties_and_non_finite_logits_as_torch():
    """Integer logits tie within and across groups (lower index wins, group and expert); a token with a
    NaN or an infinity gets NaN weights and the twin's ids; the others keep theirs."""
    spec, k = _grouped(4, 2, True), 5
    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(-1, 2, (48, 32), generator=gen).float()
    logits[3, 7] = float("nan")
    logits[5, :] = float("inf")
    logits[9, 20] = -float("inf")
    bias = torch.zeros(32)
    bias[::5] = 0.5  # ties broken by the bias in some groups only
    on_device = dict(top_k=k, spec=spec, correction_bias=bias.to(DEVICE))
    weights, ids = route_sigmoid_grouped(logits.to(DEVICE), **on_device)
    want_w, want_ids = _torch_route(logits, k, spec, bias)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert weights[[3, 5, 9]].isnan().all() and not weights[[0, 1, 2, 4]].isnan().any()


WIDEST = {
    # name: (spec, K, why)
    "softmax_topk": (SPECS[1], 8, "softmax over 1024 experts in one warp, 32 scores a thread"),
    "topk_softmax": (SPECS[0], 4, "selection before the softmax, at the widest E"),
    "grouped": (_grouped(8, 4, True, 2.5), 8, "DeepSeek-V3's groups and bias at E = 1024: groups of 128"),
}


@pytest.mark.parametrize("name", list(WIDEST))
def test_route_one_launch_at_the_widest_e_matches_the_torch_path(name):
    """`route_one_launch` (what `moekit.route` runs on CUDA) picks each method's kernel and holds
    MAX_EXPERTS scores of a token in one program."""
    spec, k, why = WIDEST[name]
    gen = torch.Generator().manual_seed(9)
    logits = (2 * torch.randn(5, MAX_EXPERTS, generator=gen)).to(torch.bfloat16)
    bias = (0.1 * torch.randn(MAX_EXPERTS, generator=gen)) if spec.has_correction_bias else None
    weights, ids = route_one_launch(
        logits.to(DEVICE), top_k=k, spec=spec, correction_bias=None if bias is None else bias.to(DEVICE)
    )
    want_w, want_ids = _torch_route(logits, k, spec, bias)
    assert torch.equal(ids.cpu(), want_ids), why
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7)
