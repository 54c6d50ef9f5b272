"""The constexpr codes of every numeric switch of the fused-MoE kernels.

Data flow: `launch._KernelParams` maps the spec onto these codes -> the kernels take them as constexpr
arguments (W_FORMAT, FP8_SCALE, A_QUANT, ACTIVATION) -> each branch on a code is resolved at compile
time, so a compiled kernel holds the code of one format, scale granularity and activation only.
"""

import triton.language as tl
from moekit.spec import Activation, ActivationSpec

# Weight storage (W_FORMAT).
WFMT_FLOAT = tl.constexpr(0)  # bf16 / fp16 / fp32 [E, N, K]
WFMT_FP8 = tl.constexpr(1)  # float8_e4m3fn [E, N, K], fp32 scales per FP8_SCALE
WFMT_MXFP4 = tl.constexpr(2)  # uint8 blocks [E, N, ceil(K/32)*16] + E8M0 scales [E, N, ceil(K/32)]
# MXFP4 in WeightPacking.MXFP4_MMA_WORDS: int32 words [E, N/16, S, 8, 4, 8] in 1 KiB runs (see
# moekit.formats.mxfp4_words) + the same E8M0 scales, every scale byte <= 128.
WFMT_MXFP4_WORDS = tl.constexpr(3)
# FP8 weight scale granularity (FP8_SCALE).
FP8S_TENSOR = tl.constexpr(0)  # [E]
FP8S_CHANNEL = tl.constexpr(1)  # [E, N]
FP8S_BLOCK = tl.constexpr(2)  # [E, ceil(N/128), ceil(K/128)]
# Dynamic activation quantization of the A operand (A_QUANT).
AQ_NONE = tl.constexpr(0)
AQ_TOKEN = tl.constexpr(1)  # scale [rows, 1]
AQ_GROUP = tl.constexpr(2)  # scale [rows, ceil(K/128)]
# Gated activations (ACTIVATION).
ACT_SILU = tl.constexpr(0)
ACT_GELU = tl.constexpr(1)
ACT_GELU_TANH = tl.constexpr(2)
ACT_SWIGLU_OAI = tl.constexpr(3)
ACTIVATION_CODE = {
    Activation.SILU: ACT_SILU.value,
    Activation.GELU: ACT_GELU.value,
    Activation.GELU_TANH: ACT_GELU_TANH.value,
    Activation.SWIGLU_OAI: ACT_SWIGLU_OAI.value,
}


def activation_constexprs(act: ActivationSpec) -> dict:
    """The Gluon GEMM1s' activation arguments of `act` (`_details.activation._gated_activation`'s):
    ACTIVATION, ALPHA (0 where unused), HAS_LIMIT and LIMIT (0 without a clamp)."""
    return dict(
        ACTIVATION=ACTIVATION_CODE[act.kind],
        ALPHA=float(act.alpha) if act.alpha is not None else 0.0,
        HAS_LIMIT=act.limit is not None,
        LIMIT=float(act.limit) if act.limit is not None else 0.0,
    )
