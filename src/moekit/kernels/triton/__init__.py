"""The Triton fused-MoE path (Hopper; also runs under TRITON_INTERPRET=1 for tests).

Data flow: `launch.triton_fused_moe` checks the call, `align.align_routing` groups the (token, k) pairs
by expert on the device, and the kernels in `_jit` run the two grouped GEMMs and the top-k sum.
"""

from moekit.kernels.triton.launch import (
    TRITON_CAPABILITIES,
    TritonMoEConfig,
    default_config,
    triton_fused_moe,
    triton_supports,
    workspace_bytes,
)

__all__ = [
    "TRITON_CAPABILITIES",
    "TritonMoEConfig",
    "default_config",
    "triton_fused_moe",
    "triton_supports",
    "workspace_bytes",
]
