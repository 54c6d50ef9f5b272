"""Host side of the one-launch softmax routings (`_details.route._route_softmax`), used by
`moekit.ops.route` for CUDA logits (`moekit.routing.route_torch` is its torch twin).

Data flow: logits [T, E] -> (SOFTMAX_TOPK: softmax over E) -> the top K by `_order_key` -> weights
(TOPK_SOFTMAX: softmax over the K; SOFTMAX_TOPK: optionally renormalized) * routed_scaling_factor.
Ids are exactly those of the torch path. Weights agree with it to a few fp32 ulps (another exp), and
so, for SOFTMAX_TOPK, can the order of two experts whose probabilities are within those ulps. A token
with a non-finite logit gets NaN weights, as in the torch path (`moekit.routing`'s contract).
"""

from __future__ import annotations

import torch

import triton
from moekit.kernels.triton._details import route as _jit_route
from moekit.spec import RoutingMethod, RoutingSpec

# One program holds a [BLOCK_T, BLOCK_E] tile of scores: wider routers stay on the torch path.
MAX_EXPERTS = 1024
_TILE_ELEMENTS = 4096


def fast_route_supported(spec: RoutingSpec, num_experts: int) -> bool:
    return spec.method is not RoutingMethod.SIGMOID_GROUPED and num_experts <= MAX_EXPERTS


def route_softmax(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) of a softmax routing; the caller checked the arguments."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(64, _TILE_ELEMENTS // block_e))
    _jit_route._route_softmax[(triton.cdiv(num_tokens, block_t),)](
        logits_ptr=logits,  # [T, E]
        weights_ptr=weights,  # fp32 [T, K]
        ids_ptr=ids,  # int32 [T, K]
        num_tokens=num_tokens,
        stride_lt=logits.stride(0),
        scaling=float(spec.routed_scaling_factor),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        SOFTMAX_FIRST=spec.method is RoutingMethod.SOFTMAX_TOPK,
        RENORMALIZE=spec.renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=4,
    )
    return weights, ids
