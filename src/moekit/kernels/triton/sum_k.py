"""The top-k sum, launched: out[t] = sum_k of GEMM2's rows of token t's pairs, in a fixed k order.

Shared by both engines' launches (`launch.triton_fused_moe`, `wgmma_fp8.wgmma_fp8_moe`); the JIT code is
`_details.reduce._moe_sum_k`.
"""

from __future__ import annotations

import torch

import triton
from moekit.kernels.triton._details.reduce import _moe_sum_k
from moekit.kernels.triton.pdl import pdl_args
from moekit.spec import MoESpec


def sum_top_k(
    y: torch.Tensor, *, pair_expert: torch.Tensor, out: torch.Tensor, spec: MoESpec
) -> torch.Tensor:
    """out[t] = sum_k y[t*K + k] over the pairs computed here (finished rows y [T*K, H]; `pair_expert`
    int32 [T*K], -1 for a pair not computed here); returns out."""
    sum_shares(
        y.unsqueeze(0),
        pair_expert=pair_expert,
        out=out,
        spec=spec,
        finish=False,
        bias=None,
        stride_be=0,
        route_w=None,
    )
    return out


def sum_shares(
    shares: torch.Tensor,
    *,
    pair_expert: torch.Tensor,
    out: torch.Tensor,
    spec: MoESpec,
    finish: bool,
    bias: torch.Tensor | None,
    stride_be: int,
    route_w: torch.Tensor | None,
) -> None:
    """`_moe_sum_k` over GEMM2's shares [S, T*K, H]: finished rows (S == 1, `finish` off), or split-K's raw
    fp32 shares, finished here with the bias and router weight (`finish`)."""
    block_h = min(1024, triton.next_power_of_2(spec.H))
    _moe_sum_k[(out.shape[0], triton.cdiv(spec.H, block_h))](
        **pdl_args(out.device),
        y_ptr=shares,  # [S, T*K, H]: GEMM2's raw fp32 shares, or its finished rows
        pair_expert_ptr=pair_expert,  # int32 [T*K], -1 for a pair not computed here
        b_ptr=bias,  # [E_local, H] or None
        route_w_ptr=route_w,  # fp32 [T*K] or None
        out_ptr=out,  # [T, H]
        num_local_experts=spec.E_local,
        stride_ys=shares.stride(0),
        stride_ym=shares.stride(1),
        stride_be=stride_be,
        stride_om=out.stride(0),
        HIDDEN=spec.H,
        TOP_K=spec.K,
        SHARES=shares.shape[0],
        HAS_BIAS=finish and bias is not None,
        ROUTE_ON_OUTPUT=finish and route_w is not None,
        BLOCK_H=block_h,
    )
