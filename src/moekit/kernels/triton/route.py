"""Host side of the one-launch routings (`_details.route`): `moekit.ops.route` runs the softmax ones for
CUDA logits (`fast_route_supported`); `moekit.routing.route_torch` is their torch twin.

Data flow: logits [T, E] -> softmax routings: (SOFTMAX_TOPK: softmax over E) -> the top K by `_order_key`
-> weights (TOPK_SOFTMAX: softmax over the K; SOFTMAX_TOPK: optionally renormalized); SIGMOID_GROUPED:
sigmoid (+ correction bias) -> the best `topk_group` of `n_group` groups (sum of each group's best two)
-> the top K among their experts -> the unbiased sigmoid renormalized over the K. Then
* routed_scaling_factor. Ids are exactly those of the torch path. Weights agree with it to a few fp32
ulps (another exp), and so can the order of two experts whose scores are within those ulps. A token with
a non-finite logit gets NaN weights, as in the torch path (`moekit.routing`'s contract).
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
    """Whether `moekit.route` takes the one-launch route. Not SIGMOID_GROUPED: `route_sigmoid_grouped`
    matches the torch twin, but its H200 times (74 us at T = 1, 202 us at T = 16384 against about 800 us
    of torch sorting) are of a four-warp launch; its one-warp launch has not been timed against the twin."""
    return spec.method is not RoutingMethod.SIGMOID_GROUPED and num_experts <= MAX_EXPERTS


def _launch(
    kernel,
    logits: torch.Tensor,
    top_k: int,
    spec: RoutingSpec,
    method_args: dict[str, object],
    *,
    one_token_a_warp: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) from one launch of a route `kernel`: the arguments every
    route takes, plus its own `method_args`. A program holds [BLOCK_T, BLOCK_E] scores: one token on one
    warp, or as many tokens as fill 4096 scores on four warps."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    block_t = 1 if one_token_a_warp else max(1, min(64, _TILE_ELEMENTS // block_e))
    kernel[(triton.cdiv(num_tokens, block_t),)](
        logits_ptr=logits,  # [T, E]
        weights_ptr=weights,  # fp32 [T, K]
        ids_ptr=ids,  # int32 [T, K]
        num_tokens=num_tokens,
        stride_lt=logits.stride(0),
        scaling=float(spec.routed_scaling_factor),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=1 if one_token_a_warp else 4,
        **method_args,
    )
    return weights, ids


def route_sigmoid_grouped(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) of DeepSeek-V3's routing; the caller checked the arguments
    (E divisible by n_group, the bias [E] if and only if the spec has one)."""
    n_group = spec.n_group or 1
    grouping = {
        "bias_ptr": None if correction_bias is None else correction_bias.contiguous(),  # [E]
        "N_GROUP": n_group,
        "TOPK_GROUP": spec.topk_group or 1,
        "BLOCK_G": triton.next_power_of_2(n_group),
    }
    # Some 30 serial reductions over E (group scores, groups, the top K): on one warp a token's stay in the
    # warp. Four warps on 16 tokens compiled for sm_90 to 17,000 instructions with 224 barriers and
    # spills (74 us at T = 1 on an H200); one warp on one token to 1,900, no barrier, no spill.
    return _launch(_jit_route._route_sigmoid_grouped, logits, top_k, spec, grouping, one_token_a_warp=True)


def route_softmax(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) of a softmax routing; the caller checked the arguments."""
    order = {"SOFTMAX_FIRST": spec.method is RoutingMethod.SOFTMAX_TOPK, "RENORMALIZE": spec.renormalize}
    return _launch(_jit_route._route_softmax, logits, top_k, spec, order, one_token_a_warp=False)
