"""Number formats: MXFP4 (OCP Microscaling v1.0, GPT-OSS checkpoint layout) and FP8 E4M3.

Data flow: float tensors -> quantize_* -> packed codes + scales (what checkpoints and kernels hold)
-> dequantize_* -> float tensors. Pure PyTorch; runs on any device.
"""

from moekit.formats.fp8 import (
    FP8_E4M3_MAX,
    Fp8Activation,
    Fp8Weight,
    check_fp8_codes,
    check_fp8_scales,
    dequantize_fp8_activation,
    dequantize_fp8_weight,
    find_fp8_nan_codes,
    fp8_weight_scale_shape,
    quantize_fp8_activation,
    quantize_fp8_weight,
)
from moekit.formats.mxfp4 import (
    DEFAULT_SCALE_RULE,
    FP4_E2M1_VALUES,
    MXFP4_BLOCK,
    Mxfp4ScaleRule,
    Mxfp4Weight,
    check_mxfp4_scales,
    decode_e8m0,
    dequantize_mxfp4,
    mxfp4_groups,
    quantize_mxfp4,
)

__all__ = [
    "DEFAULT_SCALE_RULE",
    "FP4_E2M1_VALUES",
    "FP8_E4M3_MAX",
    "MXFP4_BLOCK",
    "Fp8Activation",
    "Fp8Weight",
    "Mxfp4ScaleRule",
    "Mxfp4Weight",
    "check_fp8_codes",
    "check_fp8_scales",
    "find_fp8_nan_codes",
    "check_mxfp4_scales",
    "decode_e8m0",
    "dequantize_fp8_activation",
    "dequantize_fp8_weight",
    "dequantize_mxfp4",
    "fp8_weight_scale_shape",
    "mxfp4_groups",
    "quantize_fp8_activation",
    "quantize_fp8_weight",
    "quantize_mxfp4",
]
