"""A layer's router: its logits (optionally batch-invariant) and whether its routing is per token.

Data flow: x `[T, H]` -> fp32 logits `[T, E]` = x @ W^T + b (`compute_router_logits`); for a batch-invariant
layer, `batch_invariant_routing_reason` says whether routing on a device computes each token alone.
"""

from __future__ import annotations

import torch

from moekit.spec import MoESpec

# Rows of each router matmul of a batch-invariant layer: a library GEMM picks its algorithm (tiles,
# split-K, and so the reduction order) by shape, so every token goes through a matmul of this one shape.
ROUTER_ROWS = 256


def compute_router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, batch_invariant: bool
) -> torch.Tensor:
    """fp32 logits `[T, E]` = x @ weight^T + bias, x `[T, H]`. Batch-invariant: x is padded to a multiple of
    `ROUTER_ROWS` and multiplied `ROUTER_ROWS` rows at a time (one matmul shape for every T; a row of a
    matmul never reads another row)."""
    x, weight = x.float(), weight.float()
    bias = None if bias is None else bias.float()
    if not batch_invariant:
        return torch.nn.functional.linear(x, weight, bias)
    num_tokens = x.shape[0]
    padded = torch.zeros(
        -(-num_tokens // ROUTER_ROWS) * ROUTER_ROWS, x.shape[1], dtype=x.dtype, device=x.device
    )
    padded[:num_tokens] = x
    out = torch.empty(padded.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    w_t = weight.t()
    for start in range(0, padded.shape[0], ROUTER_ROWS):
        torch.mm(padded[start : start + ROUTER_ROWS], w_t, out=out[start : start + ROUTER_ROWS])
    out = out[:num_tokens]
    return out if bias is None else out + bias  # elementwise: per token


def batch_invariant_routing_reason(spec: MoESpec, device: torch.device) -> str | None:
    """Why this layer's routing would not be per token on `device` (None: it is). On CUDA the one-launch
    Triton route (every routing method, E <= its MAX_EXPERTS) computes each token in its own program, one
    warp; the torch twin's reductions and sorts are tiled by the kernel launcher, by T, so a wider router
    is refused."""
    if device.type != "cuda":
        return None
    try:
        from moekit.kernels.triton.route import MAX_EXPERTS, fast_route_supported
    except ImportError:
        return "Triton is not installed, and the torch routing's reductions are tiled by T on CUDA"
    if fast_route_supported(spec.routing, spec.E):
        return None
    return (
        f"routing {spec.routing.method.name} with E={spec.E} runs through torch reductions tiled by T on "
        f"CUDA, not the per-token Triton route (E <= {MAX_EXPERTS})"
    )
