"""Triton JIT code of the softmax routings (host side: `route.py`).

Data flow: router logits [T, E] -> top-K ids and weights in one launch, where the torch ops of
`moekit.routing` take a sort, a gather, a softmax and casts.

Selection orders experts exactly as `moekit.routing` does (a stable descending sort): on an int32 key
that is monotone in the fp32 score, with -0 equal to +0, every NaN above every number, and ties going to
the lower expert index. A token with a non-finite logit gets NaN weights, as in the torch twin (the
contract for logits that were not checked, `moekit.routing`).
"""

import triton
import triton.language as tl

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
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    experts = (e < NUM_EXPERTS)[None, :]
    live = (rows < num_tokens)[:, None] & experts
    score = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + e[None, :], mask=live, other=0.0)
    score = score.to(tl.float32)
    non_finite = (score != score) | (tl.abs(score) == float("inf"))
    poisoned = tl.max(tl.where(live & non_finite, 1, 0), 1) > 0  # [BLOCK_T]
    if SOFTMAX_FIRST:
        score = _softmax_rows(score, experts)
    key = _order_key(score, experts)
    kk = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, 1)
        pick = tl.min(tl.where(key == best[:, None], e[None, :], BLOCK_E), 1)  # lowest index among ties
        hit = e[None, :] == pick[:, None]
        value = tl.sum(tl.where(hit, score, 0.0), 1)
        chosen_ids = tl.where(kk[None, :] == k, pick[:, None], chosen_ids)
        chosen = tl.where(kk[None, :] == k, value[:, None], chosen)
        key = tl.where(hit, _INT_MIN, key)
    selected = (kk < TOP_K)[None, :]
    used = (rows < num_tokens)[:, None] & selected
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            chosen = chosen / tl.sum(tl.where(selected, chosen, 0.0), 1)[:, None]
    else:
        chosen = _softmax_rows(chosen, selected)
    chosen = tl.where(poisoned[:, None], float("nan"), chosen)
    out = rows[:, None].to(tl.int64) * TOP_K + kk[None, :]
    tl.store(weights_ptr + out, chosen * scaling, mask=used)
    tl.store(ids_ptr + out, chosen_ids, mask=used)
