"""The one-launch softmax routing (`moekit.kernels.triton.route`) against the torch twin
(`moekit.routing.route_torch`, what `moekit.route` runs off CUDA): identical ids, weights within fp32
rounding. On the CPU under TRITON_INTERPRET=1 (set by conftest.py); on a GPU the same tests run compiled
and are marked `gpu`, and test_interpreter_suite.py also runs them interpreted in a child pytest with
CUDA hidden."""

import pytest
import torch

pytest.importorskip("triton")

from moekit import NonFiniteError, RoutingMethod, RoutingSpec, route  # noqa: E402
from moekit.kernels.triton.route import MAX_EXPERTS, fast_route_supported, route_softmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Compiled on a CUDA machine, so `pytest -m gpu` runs them there; interpreted anywhere else.
pytestmark = pytest.mark.gpu if DEVICE == "cuda" else pytest.mark.interpret

SPECS = [
    RoutingSpec(method=RoutingMethod.TOPK_SOFTMAX),
    RoutingSpec(method=RoutingMethod.SOFTMAX_TOPK, renormalize=True),
    RoutingSpec(method=RoutingMethod.SOFTMAX_TOPK, renormalize=False, routed_scaling_factor=2.5),
]


def _torch_route(logits, top_k, spec):
    """The torch path whatever the device: route() on a CPU copy (values unchecked, so that non-finite
    logits reach the twin's NaN rule instead of route's NonFiniteError)."""
    r = route(logits.cpu(), top_k=top_k, spec=spec, check_values=False)
    return r.weights, r.ids


@pytest.mark.parametrize("spec", SPECS, ids=["topk_softmax", "softmax_topk_renorm", "softmax_topk_scaled"])
@pytest.mark.parametrize(
    ("t", "e", "k", "dtype"),
    [
        (1, 128, 4, torch.bfloat16),
        (37, 6, 2, torch.float32),
        (130, 100, 8, torch.float16),
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
    from moekit import preset

    assert not fast_route_supported(preset("deepseek-v3").routing, 256)
    assert not fast_route_supported(SPECS[0], MAX_EXPERTS + 1)
    assert fast_route_supported(SPECS[0], 128) and fast_route_supported(SPECS[1], MAX_EXPERTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_route_uses_the_fast_path_on_cuda_at_gpt_oss_shape():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16384, 128, generator=gen).to(torch.bfloat16)
    got = route(logits.cuda(), top_k=4, spec=SPECS[0])
    want = route(logits, top_k=4, spec=SPECS[0])
    assert torch.equal(got.ids.cpu(), want.ids)
    torch.testing.assert_close(got.weights.cpu(), want.weights, rtol=2e-6, atol=1e-7)
