"""The gated activations in fp32 registers, shared by GEMM1's epilogue and the split-K finish.

Data flow: gate, up (fp32, after the router weight and the bias) -> the optional clamp -> act(gate) * up
(SWIGLU_OAI: gate * sigmoid(alpha * gate) * (up + 1)) -> h. The torch twin is
`moekit.reference.apply_activation`.
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.codes import ACT_GELU, ACT_SILU, ACT_SWIGLU_OAI


@triton.jit
def _gated_activation(
    gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr
):
    """moekit.reference.apply_activation in fp32 registers."""
    if HAS_LIMIT:  # every activation clamps the same way: gate from above, up on both sides
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if ACTIVATION == ACT_SWIGLU_OAI:
        out = gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)
    elif ACTIVATION == ACT_SILU:
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == ACT_GELU:
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): no tanh needed, and no cancellation near z = 0.
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = gate * tl.sigmoid(2.0 * z) * up
    return out
