"""Triton JIT code of the one-launch routings (host side: `route.py`): the softmax ones and DeepSeek-V3's
group-limited sigmoid.

Data flow: router logits [T, E] -> top-K ids and weights in one launch, where the torch ops of
`moekit.routing` take sorts, gathers, a softmax or sigmoid, masks and casts.

Selection orders experts exactly as `moekit.routing` does (a stable descending sort): on an int32 key
that is monotone in the fp32 score, with -0 equal to +0, every NaN above every number, and ties going to
the lower expert index. A token with a non-finite logit gets NaN weights, as in the torch twin (the
contract for logits that were not checked, `moekit.routing`).
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.pdl import _pdl_prologue

_INT_MIN = tl.constexpr(-(2**31))
_INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _order_key(score, live):
    """int32 keys that order fp32 `score` as torch.sort does (NaN highest); -2^31 where not `live`
    (below every real key, -inf included)."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)  # -0 -> +0
    key = tl.where(bits >= 0, bits, bits ^ _INT_MAX)  # negative floats: larger magnitude, smaller key
    key = tl.where(score != score, _INT_MAX, key)
    return tl.where(live, key, _INT_MIN)


@triton.jit
def _softmax_rows(x, columns):
    """Softmax of each row of `x` over its `columns` (a [1, N] mask; rows past T hold finite values)."""
    x = tl.where(columns, x, -float("inf"))
    e = tl.exp(x - tl.max(x, 1)[:, None])
    e = tl.where(columns, e, 0.0)
    return e / tl.sum(e, 1)[:, None]


@triton.jit
def _take_best(key, columns, values):
    """Per row: the highest `key` (the lowest column among ties), its `values` entry, the one-hot of that
    column, and `key` with it struck out (so that the next call takes the runner-up)."""
    best = tl.max(key, 1)
    pick = tl.min(tl.where(key == best[:, None], columns[None, :], 2**30), 1)
    hit = columns[None, :] == pick[:, None]
    value = tl.sum(tl.where(hit, values, 0.0), 1)
    return pick, value, hit, tl.where(hit, _INT_MIN, key)


@triton.jit
def _load_scores(
    logits_ptr, num_tokens, stride_lt, NUM_EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr
):
    """This program's rows, the expert columns, the [1, BLOCK_E] mask of real experts, the rows' logits in
    fp32 (0 outside) and which rows hold a non-finite logit (their weights become NaN)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    experts = (e < NUM_EXPERTS)[None, :]
    live = (rows < num_tokens)[:, None] & experts
    logit = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + e[None, :], mask=live, other=0.0)
    logit = logit.to(tl.float32)
    non_finite = (logit != logit) | (tl.abs(logit) == float("inf"))
    poisoned = tl.max(tl.where(live & non_finite, 1, 0), 1) > 0  # [BLOCK_T]
    return rows, e, experts, logit, poisoned


@triton.jit
def _top_k(key, e, values, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The TOP_K best columns of `key` in order (ids [BLOCK_T, BLOCK_K]) and their `values`."""
    kk = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pick, value, _, key = _take_best(key, e, values)
        chosen_ids = tl.where(kk[None, :] == k, pick[:, None], chosen_ids)
        chosen = tl.where(kk[None, :] == k, value[:, None], chosen)
    return chosen_ids, chosen


@triton.jit
def _renormalized(chosen, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's first TOP_K weights divided by their sum."""
    selected = (tl.arange(0, BLOCK_K) < TOP_K)[None, :]
    return chosen / tl.sum(tl.where(selected, chosen, 0.0), 1)[:, None]


@triton.jit
def _store_route(
    weights_ptr,
    ids_ptr,
    rows,
    num_tokens,
    chosen,
    chosen_ids,
    poisoned,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weights (NaN for poisoned rows) * scaling and ids of the rows' first TOP_K columns."""
    kk = tl.arange(0, BLOCK_K)
    chosen = tl.where(poisoned[:, None], float("nan"), chosen)
    out = rows[:, None].to(tl.int64) * TOP_K + kk[None, :]
    used = (rows < num_tokens)[:, None] & (kk < TOP_K)[None, :]
    tl.store(weights_ptr + out, chosen * scaling, mask=used)
    tl.store(ids_ptr + out, chosen_ids, mask=used)


@triton.jit
def _route_softmax(
    logits_ptr,  # [T, E] any float dtype
    weights_ptr,  # out fp32 [T, K]
    ids_ptr,  # out int32 [T, K]
    num_tokens,
    stride_lt,
    scaling,  # routed_scaling_factor
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    SOFTMAX_FIRST: tl.constexpr,  # SOFTMAX_TOPK (else TOPK_SOFTMAX)
    RENORMALIZE: tl.constexpr,  # SOFTMAX_TOPK's optional renormalization over the K selected
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    _pdl_prologue(PDL)
    rows, e, experts, score, poisoned = _load_scores(
        logits_ptr, num_tokens, stride_lt, NUM_EXPERTS, BLOCK_T, BLOCK_E
    )
    if SOFTMAX_FIRST:
        score = _softmax_rows(score, experts)
    chosen_ids, chosen = _top_k(_order_key(score, experts), e, score, TOP_K, BLOCK_T, BLOCK_K)
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            chosen = _renormalized(chosen, TOP_K, BLOCK_K)
    else:
        chosen = _softmax_rows(chosen, (tl.arange(0, BLOCK_K) < TOP_K)[None, :])
    _store_route(
        weights_ptr, ids_ptr, rows, num_tokens, chosen, chosen_ids, poisoned, scaling, TOP_K, BLOCK_K
    )


@triton.jit
def _route_sigmoid_grouped(
    logits_ptr,  # [T, E] any float dtype
    bias_ptr,  # [E] any float dtype (the correction bias), or None
    weights_ptr,  # out fp32 [T, K]
    ids_ptr,  # out int32 [T, K]
    num_tokens,
    stride_lt,
    scaling,  # routed_scaling_factor
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    N_GROUP: tl.constexpr,  # 1: no group limit
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= N_GROUP
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """DeepSeek-V3's routing as `moekit.routing._sigmoid_grouped` computes it: choose on sigmoid + bias,
    only among the experts of the TOPK_GROUP groups whose best two choices sum highest (the others at
    -inf, as the torch twin masks them), then weigh by the unbiased sigmoid, renormalized over the K."""
    _pdl_prologue(PDL)
    rows, e, experts, logit, poisoned = _load_scores(
        logits_ptr, num_tokens, stride_lt, NUM_EXPERTS, BLOCK_T, BLOCK_E
    )
    score = tl.sigmoid(logit)
    choice = score
    if bias_ptr is not None:
        choice = choice + tl.load(bias_ptr + e, mask=e < NUM_EXPERTS, other=0.0).to(tl.float32)[None, :]
    if N_GROUP > 1:
        PER_GROUP: tl.constexpr = NUM_EXPERTS // N_GROUP
        group_of = e // PER_GROUP
        g = tl.arange(0, BLOCK_G)
        group_score = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.float32)
        for i in tl.static_range(N_GROUP):
            key = _order_key(choice, experts & (group_of == i)[None, :])
            _, total, _, key = _take_best(key, e, choice)
            if PER_GROUP > 1:  # the group's best two, summed in the twin's order
                _, second, _, key = _take_best(key, e, choice)
                total = total + second
            group_score = tl.where(g[None, :] == i, total[:, None], group_score)
        group_key = _order_key(group_score, (g < N_GROUP)[None, :])
        allowed = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):  # each kept group's experts, by the group's index
            kept, _, _, group_key = _take_best(group_key, g, group_score)
            allowed = tl.where(group_of[None, :] == kept[:, None], 1, allowed)
        choice = tl.where(allowed > 0, choice, -float("inf"))
    chosen_ids, chosen = _top_k(_order_key(choice, experts), e, score, TOP_K, BLOCK_T, BLOCK_K)
    chosen = _renormalized(chosen, TOP_K, BLOCK_K)
    _store_route(
        weights_ptr, ids_ptr, rows, num_tokens, chosen, chosen_ids, poisoned, scaling, TOP_K, BLOCK_K
    )
