"""`FusedMoE` under torch.compile on the CPU: the custom op, fullgraph capture, and no recompiles across T.

Data flow: a small model (norm -> FusedMoE -> residual -> linear) in eager mode gives the expected
output; `torch.compile(fullgraph=True)` of the same module must trace the layer's forward (checks, router,
`torch.ops.moekit.fused_moe_layer`) into one graph with a symbolic token count, match eager, and compile
once for every T of a bucket (and, because the bucket is chosen inside the opaque op, across buckets).
T = 0 and 1 are avoided in the no-recompile checks: dynamo specializes sizes 0 and 1 by design.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from moekit import ActivationSpec, GateLayout, MoESpec, WeightFormat
from moekit.layer import FusedMoE
from moekit.synthetic import random_layer

SPEC = MoESpec(
    num_experts=8,
    top_k=4,
    hidden_size=64,
    intermediate_size=48,
    weight_format=WeightFormat.MXFP4,
    act_dtype=torch.float32,
    activation=ActivationSpec.gpt_oss(),
    gate_layout=GateLayout.INTERLEAVED,
    has_bias=True,
)


class TinyModel(torch.nn.Module):
    """A decoder-layer-shaped module holding the MoE layer, as a served model would."""

    def __init__(self, moe: FusedMoE) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(moe.spec.H)
        self.moe = moe
        self.head = torch.nn.Linear(moe.spec.H, 16)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden + self.moe(self.norm(hidden)))


@pytest.fixture(scope="module")
def model() -> TinyModel:
    layer = random_layer(SPEC, seed=3)
    bias = torch.randn(SPEC.E, generator=torch.Generator().manual_seed(4)) * 0.1
    moe = FusedMoE(spec=SPEC, weights=layer.weights, router_weight=layer.router_weight, router_bias=bias)
    torch.manual_seed(0)
    return TinyModel(moe).eval()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tokens(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, SPEC.H, generator=torch.Generator().manual_seed(seed))


def test_opcheck_of_the_custom_op(model: TinyModel) -> None:
    x = _tokens(13, seed=1)
    logits = torch.randn(13, SPEC.E)
    torch.library.opcheck(torch.ops.moekit.fused_moe_layer.default, (x, logits, model.moe.handle))


def test_fullgraph_inductor_matches_eager_without_recompiles_in_a_bucket(model: TinyModel) -> None:
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():
        for t in (9, 12, 16):  # one bucket (16)
            x = _tokens(t, seed=t)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            if t == 9:
                torch._dynamo.config.error_on_recompile = True  # any later recompile raises
    torch._dynamo.config.error_on_recompile = False
    assert counter.frame_count == 1
    assert 16 in model.moe.plans


def test_mark_dynamic_leading_dims_compile_once_across_buckets(model: TinyModel) -> None:
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for seq in (3, 17, 100):  # tokens 6, 34, 200: buckets 8, 64, 256
            x = _tokens(2, seq, seed=seq)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    assert {8, 64, 256} <= set(model.moe.plans)


def test_given_router_logits_compile(model: TinyModel) -> None:
    moe = model.moe
    compiled = torch.compile(
        lambda x, logits: moe(x, router_logits=logits), fullgraph=True, dynamic=True, backend="aot_eager"
    )
    with torch.no_grad():
        x, logits = _tokens(7, seed=7), torch.randn(7, SPEC.E)
        torch.testing.assert_close(compiled(x, logits), moe(x, router_logits=logits), rtol=0, atol=0)
