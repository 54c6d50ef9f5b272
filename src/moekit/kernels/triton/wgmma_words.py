"""The MXFP4 prefill path on Hopper: Gluon wgmma GEMMs over the word-packed weights, each K-step's decode
under the previous step's MMA (`_details.wgmma_words`).

Data flow of `wgmma_words_moe` (no host sync; graph-capturable):
  ids -> `align_routing` at BLOCK_M rows (both GEMMs' M-blocks)
  -> `_gemm1`: x's gathered rows x 128 w13 rows (the gate and up rows of 64 columns of h) -> b13,
     gated activation -> h [T*K, I] bf16 in pair order
  -> `_gemm2`: h's gathered rows x 128 w2 rows -> b2, router weight -> y [T*K, H] in pair order
  -> `sum_k.sum_top_k` -> out [T, H].
Both GEMMs run the half-wide kernels (blocks at most half full on a wgmma of BLOCK_M / 2 pairs) where
`runs_half_wide` expects enough such blocks from the tokens an expert.
Which specs it takes is `wgmma_words_reason`; the planner offers it only where that is None, and only
on sm_90 with enough tokens an expert (`tuning`).
"""

from __future__ import annotations

import functools
import math

import torch

from moekit.formats.mxfp4_words import layer_rows_reason
from moekit.kernels.triton._details.codes import activation_constexprs
from moekit.kernels.triton.align import align_routing, max_blocks_bound
from moekit.kernels.triton.sum_k import sum_top_k
from moekit.routing import RoutingResult
from moekit.spec import ActivationQuant, GateLayout, MoESpec, RouterWeightPlacement, WeightFormat
from moekit.weights import ExpertWeights

WEIGHT_ROWS = 128  # weight rows a program: two warpgroups of 64, the wgmma's register-A M side
K_STEP = 64  # columns of K a step: two 32-wide MX scale groups
NUM_WARPS = 8
# Sorted pairs a program (the wgmma's N side). Narrower tiles compile (no spill) but lose: on an H200, whole
# layer, 32 and 64 pairs were 8 - 60 % slower than the tl.dot tiles or 128 pairs at 16 - 128 tokens an
# expert (gpt-oss-120b / -20b, E 128 / K 8 / H 4096 / I 1536, E 256 / K 8 / H 7168 / I 2048): each K-step
# decodes 128 weight rows whatever the pairs, so the decode's issue slots and the weight stream are
# spent on fewer tokens.
BLOCK_MS = (128, 256)


# The half-wide kernels (a block at most half full runs a wgmma of BLOCK_M / 2 pairs) from this expected
# share of M-blocks at most half full (`half_full_share`); every other block runs a full-width loop a few
# instructions a step longer than the one-loop kernels'. On an H200 (whole layer, graph replay, L2
# flushed), against the one-loop kernels: 1 - 12 % faster at shares 0.32 - 0.99 (48 - 128 tokens an
# expert at 128 pairs a block, 256 at 256: gpt-oss-120b / -20b, E 64 / K 6 / H 2048 / I 1408, E 128 / K 8
# / H 4096 / I 1536, E 256 / K 8 / H 7168 / I 2048, E 8 / K 2 / H 4096 / I 14336); at shares 0.1 - 0.2
# 2 - 4 % slower at 128 pairs (256 and 512 tokens an expert: E 8 / K 2 / H 4096 / I 14336, E 128 / K 8 / H
# 4096 / I 1536) and 0.5 - 3 % faster at 256 (512 and 1024: gpt-oss-120b, E 8 / K 2); 5 % slower at 0.001
# (96 tokens an expert at 128 pairs, E 64 / K 6 / H 2048 / I 1408).
HALF_WIDE_MIN_SHARE = 0.25
_INT32_LIMIT = 2**31


def register_cap(block_m: int) -> int | None:
    """ptxas's register cap for a tile: 128 keeps two 8-warp programs an SM up to BLOCK_M 128 (compiled
    for sm_90: no spill in the K-loop); a 256-pair tile's accumulator alone takes 128 registers a
    thread, so it runs one program an SM, uncapped."""
    return 128 if block_m <= 128 else None


@functools.cache
def _kernels() -> tuple | None:
    """(`_gemm1`, `_gemm2`), or None where this Triton has no Gluon Hopper support."""
    try:
        from moekit.kernels.triton._details import wgmma_words
    except ImportError:
        return None
    return wgmma_words._gemm1, wgmma_words._gemm2


def gluon_words_reason(spec: MoESpec) -> str | None:
    """None if `spec` is what every Gluon kernel on the word-packed weights computes: MXFP4 W4A16 with bf16
    activations (their decode writes bf16 operands), weight rows in whole 16-row blocks of the words."""
    if spec.weight_format is not WeightFormat.MXFP4 or spec.act_quant is not ActivationQuant.NONE:
        return "it is the MXFP4 weight path with bf16 activations (W4A16)"
    if spec.act_dtype is not torch.bfloat16:
        return f"its decode writes bf16 MMA operands, activations are {spec.act_dtype}"
    if (reason := layer_rows_reason(intermediate=spec.I, hidden=spec.H)) is not None:
        return f"it reads MXFP4_MMA_WORDS weights: {reason}"
    return None


def wgmma_words_reason(spec: MoESpec) -> str | None:
    """None if the Gluon word-path kernels compute `spec` (shapes and math), else why not: a narrower
    `config.words_reason` (bf16 activations only). The weights must also be word-packed
    (MXFP4_MMA_WORDS), which their scale bytes decide at load time."""
    if (reason := gluon_words_reason(spec)) is not None:
        return reason
    if spec.router_weight_placement is not RouterWeightPlacement.OUTPUT:
        return "it applies the router weight to GEMM2's output"
    for name, size in (("H", spec.H), ("I", spec.I)):
        if size % K_STEP:
            return f"its K-loop runs {K_STEP}-wide steps: {name} must be a multiple of {K_STEP}, got {size}"
    if _kernels() is None:
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return None


@functools.lru_cache(maxsize=4096)  # one entry a distinct T (bounded: a server sees many)
def half_full_share(num_pairs: int, num_experts: int, block_m: int) -> float:
    """Expected share of the M-blocks of `block_m` pairs that are at most half full, with the pairs routed
    uniformly: an expert's count n ~ Binomial(num_pairs, 1 / num_experts) fills ceil(n / block_m)
    blocks, the last at most half full when 1 <= n mod block_m <= block_m / 2."""
    if num_experts == 1:  # every pair on the one expert (a binomial of probability 1)
        counts, weights = torch.tensor([num_pairs], dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    else:
        p = 1.0 / num_experts
        mean, spread = num_pairs * p, math.sqrt(num_pairs * p * (1 - p))
        low, high = max(1, int(mean - 12 * spread)), min(num_pairs, int(mean + 12 * spread) + 1)
        counts = torch.arange(low, high + 1, dtype=torch.float64)  # the counts with any weight
        weights = torch.distributions.Binomial(num_pairs, probs=torch.tensor(p, dtype=torch.float64))
        weights = weights.log_prob(counts).exp()
    last = counts.remainder(block_m)
    half_full = (weights * ((last >= 1) & (last <= block_m // 2))).sum()
    blocks = (weights * torch.ceil(counts / block_m)).sum()
    return float(half_full / blocks) if blocks > 0 else 0.0


def runs_half_wide(spec: MoESpec, num_tokens: int, block_m: int, x_row_stride: int) -> bool:
    """Whether a call launches the half-wide kernels: enough blocks expected at most half full
    (`HALF_WIDE_MIN_SHARE`), and every activation row's offset fits the int32 they compute it in."""
    pairs = num_tokens * spec.K
    fits = num_tokens * x_row_stride < _INT32_LIMIT and pairs * spec.I < _INT32_LIMIT
    return fits and half_full_share(pairs, spec.E, block_m) >= HALF_WIDE_MIN_SHARE


def wgmma_words_workspace_bytes(spec: MoESpec, num_tokens: int, block_m: int) -> int:
    """Device memory one `wgmma_words_moe` call allocates besides `out`: h and y in pair order and the
    routing metadata (at most `max_blocks_bound` blocks of `block_m` pairs)."""
    pairs = num_tokens * spec.K
    act = torch.empty((), dtype=spec.act_dtype).element_size()
    blocks = max_blocks_bound(num_pairs=pairs, num_local_experts=spec.E_local, block_m=block_m)
    return pairs * (spec.I + spec.H) * act + 16 * pairs + 4 * blocks * (block_m + 1)


def wgmma_words_moe(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    block_m: int,
    num_stages: int,
    group_m: int,
    expert_map: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer of `spec` into `out` [T, H] (T > 0); the caller checked the inputs, the spec
    (`wgmma_words_reason`), the weights' packing and the device (sm_90)."""
    gemm1, gemm2 = _kernels()
    aligned = align_routing(
        routing.ids, num_local_experts=spec.E_local, block_m=block_m, expert_map=expert_map
    )
    x = x if x.stride(1) == 1 else x.contiguous()
    h = torch.empty(aligned.num_pairs, spec.I, dtype=spec.act_dtype, device=x.device)
    y = torch.empty(aligned.num_pairs, spec.H, dtype=spec.act_dtype, device=x.device)
    half_wide = runs_half_wide(spec, x.shape[0], block_m, x.stride(0))
    tiles = dict(
        BLOCK_M=block_m, STAGES=num_stages, GROUP_M=group_m, HALF_WIDE=half_wide, num_warps=NUM_WARPS
    )
    if (cap := register_cap(block_m)) is not None:
        tiles["maxnreg"] = cap
    blocks = dict(
        sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [max_blocks * BLOCK_M]
        block_expert_ptr=aligned.block_expert,  # int32 [max_blocks]
        num_blocks_ptr=aligned.num_valid_blocks,  # int32 [1]
        num_pairs=aligned.num_pairs,
        num_pid_m=aligned.max_blocks,
    )
    gemm1[(aligned.max_blocks * (2 * spec.I // WEIGHT_ROWS),)](
        x_ptr=x,  # [T, H]
        w_ptr=weights.w13,  # int32 words [E_local, 2I/16, S, 8, 4, 8]
        s_ptr=weights.w13_scale,  # uint8 [E_local, 2I, H/32], N-major
        b_ptr=weights.b13,  # [E_local, 2I] or None
        h_ptr=h,  # [T*K, I], pair order
        stride_xm=x.stride(0),
        stride_hm=h.stride(0),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        INTERLEAVED=spec.gate_layout is GateLayout.INTERLEAVED,
        TOP_K=spec.K,
        **activation_constexprs(spec.activation),
        **blocks,
        **tiles,
    )
    gemm2[(aligned.max_blocks * -(-spec.H // WEIGHT_ROWS),)](
        h_ptr=h,
        w_ptr=weights.w2,  # int32 words [E_local, H/16, S, 8, 4, 8]
        s_ptr=weights.w2_scale,  # uint8 [E_local, H, I/32], N-major
        b_ptr=weights.b2,  # [E_local, H] or None
        route_w_ptr=routing.weights.contiguous().view(-1),  # fp32 [T*K]
        y_ptr=y,  # [T*K, H], pair order
        stride_hm=h.stride(0),
        stride_ym=y.stride(0),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        **blocks,
        **tiles,
    )
    return sum_top_k(y, pair_expert=aligned.pair_expert, out=out, spec=spec)
