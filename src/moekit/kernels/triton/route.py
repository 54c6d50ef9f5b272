"""Host side of the one-launch routings (`_details.route`): `moekit.ops.route` runs them for CUDA logits
(`fast_route_supported`); `moekit.routing.route_torch` is their torch twin.

Data flow: logits [T, E] -> softmax routings: (SOFTMAX_TOPK: softmax over E) -> the top K by `_order_key`
-> weights (TOPK_SOFTMAX: softmax over the K; SOFTMAX_TOPK: optionally renormalized); SIGMOID_GROUPED:
sigmoid (+ correction bias) -> the best `topk_group` of `n_group` groups (sum of each group's best two)
-> the top K among their experts -> the unbiased sigmoid renormalized over the K. Then
* routed_scaling_factor. Ids are exactly those of the torch path. Weights agree with it to a few fp32
ulps (another exp), and so can the order of two experts whose scores are within those ulps. A token with
a non-finite logit gets NaN weights, as in the torch path (`moekit.routing`'s contract). Every launch
computes each token in its own program, so a token's route never depends on the rest of the batch.
"""

from __future__ import annotations

import torch

import triton
from moekit.kernels.triton._details import route as _jit_route
from moekit.kernels.triton.pdl import pdl_args
from moekit.spec import RoutingMethod, RoutingSpec

# One warp holds a token's E scores, E / 32 a thread. At E = 1024 the sm_90 code of the softmax routes
# takes 96 - 200 registers (K = 1 ... 64) and does not spill; the grouped route's takes 161 - 247 and,
# at K = 8 with 8 groups, stores and reloads one 8-byte value once a token. Wider routers stay on the
# torch path.
MAX_EXPERTS = 1024

# The launch geometry of every route and every E: one token a program, on one warp. The routes are chains
# of serial reductions over E (each of the K picks; the grouped route's 2 * n_group group picks and
# topk_group kept groups), which in one warp stay in the warp: no barrier. Tiles of several tokens on
# four warps put a CTA barrier in every reduction (15 - 156 a program at sm_90) and spill: the softmax
# route's 32-token tile at E = 128, K = 8 (Qwen3's router) with 369 local loads and stores, its tiles at
# K = 16 with E = 128 - 512 with a few. On an H200 (graph replay, L2 flushed, T = 1 ... 16384) one token
# a warp took 4.8 - 64.3 us for DeepSeek-V3's grouped route (16 tokens on 4 warps: 43.8 - 136.7 us)
# and 1.6 - 11.7 us for gpt-oss-120b's TOPK_SOFTMAX (32 tokens on 4 warps: 4.7 - 12.6 us).
TOKENS_A_PROGRAM = 1
WARPS_A_PROGRAM = 1


def fast_route_supported(spec: RoutingSpec, num_experts: int) -> bool:
    """Whether `moekit.route` takes the one-launch route (`route_one_launch`): every routing method, for
    E <= MAX_EXPERTS. Each launch matches the torch twin (ids bit for bit, weights within 2e-6) and is
    faster than it at every T measured on an H200 (graph replay, L2 flushed, T = 1 ... 16384):
    DeepSeek-V3's grouped sigmoid (E 256, K 8, 8 groups, 4 kept, correction bias) takes 4.8 us at
    T = 1 and 64.3 us at T = 16384 where the torch twin takes 85.2 and 1,017 us (16 - 22x faster at
    every T); gpt-oss-120b's TOPK_SOFTMAX (E 128, K 4) 2.0 and 11.7 us where the twin takes 29.5 and
    154 us (13 - 20x)."""
    return num_experts <= MAX_EXPERTS


def _launch(
    kernel, logits: torch.Tensor, top_k: int, spec: RoutingSpec, method_args: dict[str, object]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) from one launch of a route `kernel` at the one geometry
    (TOKENS_A_PROGRAM on WARPS_A_PROGRAM): the arguments every route takes, plus its own `method_args`."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    kernel[(triton.cdiv(num_tokens, TOKENS_A_PROGRAM),)](
        **pdl_args(logits.device),
        logits_ptr=logits,  # [T, E]
        weights_ptr=weights,  # fp32 [T, K]
        ids_ptr=ids,  # int32 [T, K]
        num_tokens=num_tokens,
        stride_lt=logits.stride(0),
        scaling=float(spec.routed_scaling_factor),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_T=TOKENS_A_PROGRAM,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=WARPS_A_PROGRAM,
        **method_args,
    )
    return weights, ids


def route_one_launch(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) of any routing `fast_route_supported` accepts, in one launch;
    the caller checked the arguments (`moekit.checks.check_route`)."""
    if spec.method is RoutingMethod.SIGMOID_GROUPED:
        return route_sigmoid_grouped(logits, top_k=top_k, spec=spec, correction_bias=correction_bias)
    return route_softmax(logits, top_k=top_k, spec=spec)


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
    return _launch(_jit_route._route_sigmoid_grouped, logits, top_k, spec, grouping)


def route_softmax(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, K], int32 ids [T, K]) of a softmax routing; the caller checked the arguments."""
    order = {"SOFTMAX_FIRST": spec.method is RoutingMethod.SOFTMAX_TOPK, "RENORMALIZE": spec.renormalize}
    return _launch(_jit_route._route_softmax, logits, top_k, spec, order)
