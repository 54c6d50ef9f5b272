"""Batch invariance of a whole `FusedMoE` forward, with the Triton kernel in the interpreter on the CPU.

Data flow: a tiny random layer (fp32 and fp16 activations: the interpreter's bf16 arithmetic is broken)
-> `FusedMoE(options=PlanOptions(batch_invariant=True))` with the Triton kernel registered for the CPU
-> one fixed token alone, then at once at the first, middle and last position of batches of T = 7, 40, 130
other random tokens (router, routing, both GEMMs, the top-k sum) -> its output row bitwise equal every time.

The interpreter computes `tl.dot` with numpy's matmul, whose BLAS gives a row different last bits by its
position in the tile (micro-kernel edges: measured on 20 of 32 positions); a GPU's MMA computes every
row of a tile alike. The test swaps in a product that, like the MMA, treats every row alike (einsum), so
that it checks everything else: one config for every T, padding, routing, the router and the top-k sum.
"""


# TRITON_INTERPRET is decided once per process, by tests/conftest.py (set without CUDA). Never here: on a
# CUDA machine, setting it while collecting this module would make every Triton module imported after it
# interpreted in the process that runs the compiled GPU tests.

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from moekit import Activation, ActivationSpec, GateLayout, MoESpec, WeightFormat  # noqa: E402
from moekit.kernels.base import DeviceKind, Problem  # noqa: E402
from moekit.kernels.registry import KernelRegistry  # noqa: E402
from moekit.kernels.triton._details import gemm as _jit  # noqa: E402
from moekit.kernels.triton.config import TRITON_CAPABILITIES, triton_supports  # noqa: E402
from moekit.kernels.triton.kernel import TritonFusedKernel  # noqa: E402
from moekit.layer import FusedMoE, PlanOptions  # noqa: E402
from moekit.synthetic import random_layer  # noqa: E402

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - layout of triton internals
    InterpretedFunction = None
if InterpretedFunction is None or not isinstance(_jit._moe_gemm1, InterpretedFunction):
    pytest.skip(
        "moekit's Triton kernels were imported without TRITON_INTERPRET=1 in this process (a CUDA "
        "machine): test_interpreter_suite.py runs this file in a child pytest with CUDA hidden",
        allow_module_level=True,
    )

pytestmark = pytest.mark.interpret


@pytest.fixture
def row_invariant_dot(monkeypatch):
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        product = np.einsum("mk,kn->mn", a.data.astype(acc), b.data.astype(acc))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


class InterpretedTritonKernel(TritonFusedKernel):
    """The Triton kernel, allowed on the CPU (where the interpreter runs it)."""

    name = "triton_interpreted"
    capabilities = replace(TRITON_CAPABILITIES, devices=frozenset(DeviceKind), min_compute_capability=None)

    def extra_check(self, spec: MoESpec, problem: Problem) -> str | None:
        return triton_supports(spec)  # the capability data without the device's


SPECS = {
    "fp32_swiglu_bias_interleaved": MoESpec(
        num_experts=8,
        top_k=2,
        hidden_size=64,
        intermediate_size=48,
        act_dtype=torch.float32,
        weight_format=WeightFormat.FP32,
        activation=ActivationSpec(Activation.SWIGLU_OAI, alpha=1.702, limit=7.0),
        gate_layout=GateLayout.INTERLEAVED,
        has_bias=True,
    ),
    "fp16_silu": MoESpec(
        num_experts=8,
        top_k=2,
        hidden_size=64,
        intermediate_size=48,
        act_dtype=torch.float16,
        weight_format=WeightFormat.FP16,
    ),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_a_tokens_output_is_bitwise_the_same_at_every_t_and_position(name: str, row_invariant_dot) -> None:
    spec = SPECS[name]
    layer = random_layer(spec, seed=3, weight_std=0.2)
    options = PlanOptions(registry=KernelRegistry([InterpretedTritonKernel()]), batch_invariant=True)
    moe = FusedMoE(spec=spec, weights=layer.weights, router_weight=layer.router_weight, options=options)
    gen = torch.Generator().manual_seed(11)
    token = torch.randn(1, spec.H, generator=gen).to(spec.act_dtype)
    with torch.no_grad():
        alone = moe(token)[0]
        assert torch.isfinite(alone).all() and alone.abs().max() > 0
        for num_tokens in (7, 40, 130):  # buckets 8, 64 and 256
            # The token at the first, a middle and the last position of one batch of other random tokens:
            # three rows of its experts' M-blocks in one call, each equal to the token alone.
            batch = torch.randn(num_tokens, spec.H, generator=gen).to(spec.act_dtype)
            positions = (0, num_tokens // 2, num_tokens - 1)
            batch[list(positions)] = token[0]
            out = moe(batch)
            for pos in positions:
                got = out[pos]
                assert torch.equal(got, alone), (num_tokens, pos, (got - alone).abs().max().item())
    configs = {p.config for p in moe.plans.values()}
    assert len(configs) == 1 and len(moe.plans) == 4  # buckets 1, 8, 64, 256: one config
    assert "batch-invariant: yes" in moe.explain()
