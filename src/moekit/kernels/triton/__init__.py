"""The Triton fused-MoE path (Hopper; also runs under TRITON_INTERPRET=1 for tests).

Data flow: `kernel.TritonFusedKernel` (what the planner sees) -> `config` (what the path computes, the
config type and its checks) and `tuning` (default configs, tuning spaces) -> `launch.triton_fused_moe`
-> `align.align_routing` groups the (token, k) pairs by expert on the device -> the kernels under
`_details/` run the two grouped GEMMs (`gemm`, with the K-loop in `matmul`), the FP8 activation quantization
(`quant`) and the fixed-order sums (`reduce`, launched by `sum_k`). A config whose `engine` is
`MatmulEngine.WGMMA_FP8` (block-128 or per-channel W8A8 prefill on sm_90) runs `wgmma_fp8.wgmma_fp8_moe`
instead: Gluon GEMMs under `_details/wgmma_fp8*`; `MatmulEngine.WGMMA_WORDS` (MXFP4 W4A16 prefill on sm_90)
runs `wgmma_words.wgmma_words_moe`, Gluon GEMMs in `_details/wgmma_words`; `MatmulEngine.WGMMA_BF16` (16-bit
float prefill on sm_90) runs GEMM2 as `wgmma_bf16.wgmma_bf16_gemm2`, a persistent Gluon kernel, and GEMM1 on
tl.dot or (`gemm1_gluon`) as `wgmma_bf16.wgmma_bf16_gemm1`, in `_details/wgmma_bf16_gemm*`.
`route` is the one-launch routing (softmax methods and DeepSeek-V3's grouped sigmoid).
"""

from moekit.kernels.triton.config import TRITON_CAPABILITIES, MatmulEngine, TritonMoEConfig, triton_supports
from moekit.kernels.triton.launch import triton_fused_moe, workspace_bytes
from moekit.kernels.triton.tuning import default_config

__all__ = [
    "TRITON_CAPABILITIES",
    "MatmulEngine",
    "TritonMoEConfig",
    "default_config",
    "triton_fused_moe",
    "triton_supports",
    "workspace_bytes",
]
