"""The fixed-order sums after the GEMMs: split-K shares and the top-k sum (deterministic, no atomics).

Data flow:
  GEMM1 split-K: raw fp32 shares [S, P, 2I] -> `_moe_gemm1_splits` (shares summed in order, router
    weight, bias, gated activation) -> h [P, I];
  GEMM2: finished rows y [P, H] (one share), or split-K raw fp32 shares [S, P, H] -> `_moe_sum_k` (per
    token, k = 0..K-1 in order; split-K: bias and router weight applied here) -> out [T, H].
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.align import _is_local
from moekit.kernels.triton._details.pdl import _pdl_prologue


@triton.jit
def _moe_gemm1_splits(
    part_ptr,  # fp32 [SPLIT_K, T*K, 2I] raw GEMM1 sums of each share of H
    pair_expert_ptr,  # int32 [T*K] local expert of each pair, -1 if it is not computed here
    b_ptr,  # b13 [E_local, 2I] or None
    route_w_ptr,  # fp32 [T*K] router weights (INPUT placement) or None
    h_ptr,  # [T*K, I]
    num_local_experts,  # a pair's expert outside [0, it) is not computed (unaligned routing ids as given)
    stride_part_split,
    stride_part_m,
    stride_be,
    stride_hm,
    INTER_SIZE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_INPUT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ALPHA: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """h[p, cols] = act(sum over s = 0..SPLIT_K-1, in that order, of the GEMM1 shares (+ b13)): the
    epilogue `_moe_gemm1` applies when it sums all of H itself."""
    _pdl_prologue(PDL)
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(pair_expert_ptr + p).to(tl.int64)
    if not _is_local(expert, num_local_experts):
        return  # a pair no M-block holds: its h row is never read
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < INTER_SIZE
    if INTERLEAVED:  # rows 2n (gate n) and 2n+1 (up n)
        gate_rows = 2 * cols
        up_rows = 2 * cols + 1
    else:  # rows n and I + n
        gate_rows = cols
        up_rows = cols + INTER_SIZE
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        row = part_ptr + s * stride_part_split + p * stride_part_m
        gate += tl.load(row + gate_rows, mask=mask, other=0.0)
        up += tl.load(row + up_rows, mask=mask, other=0.0)
    if ROUTE_ON_INPUT:
        w = tl.load(route_w_ptr + p)
        gate, up = gate * w, up * w
    if HAS_BIAS:
        gate += tl.load(b_ptr + expert * stride_be + gate_rows, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + expert * stride_be + up_rows, mask=mask, other=0.0).to(tl.float32)
    out = _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
    tl.store(h_ptr + p * stride_hm + cols, out.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_sum_k(
    y_ptr,  # [SHARES, T*K, H] per-pair rows (rows of dropped pairs are never written)
    pair_expert_ptr,  # int32 [T*K] local expert of each pair, -1 if another rank owns it
    b_ptr,  # b2 [E_local, H] or None
    route_w_ptr,  # fp32 [T*K] router weights (OUTPUT placement) or None
    out_ptr,  # [T, H] act dtype
    num_local_experts,  # a pair's expert outside [0, it) adds zero (unaligned routing ids as given)
    stride_ys,
    stride_ym,
    stride_be,
    stride_om,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    SHARES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_OUTPUT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """out[t] = sum over k = 0..K-1, in that order, of y[p] (+ b2[e]) (times w[p]) for p = t*K + k, where
    y[p] sums the SHARES rows of p in order; dropped pairs add zero. One share of finished rows (GEMM2
    added b2 and the router weight) or, split-K, GEMM2's raw fp32 shares with its epilogue here."""
    _pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        p = t * TOP_K + k
        expert = tl.load(pair_expert_ptr + p).to(tl.int64)
        # tl.where keeps the mask int1 under every Triton's interpreter (3.9's makes `mask & scalar` int32).
        keep = tl.where(_is_local(expert, num_local_experts), mask, False)
        y = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SHARES):
            y += tl.load(y_ptr + s * stride_ys + p * stride_ym + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + expert * stride_be + cols, mask=keep, other=0.0).to(tl.float32)
        if ROUTE_ON_OUTPUT:
            y = y * tl.load(route_w_ptr + p)
        acc += y
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
