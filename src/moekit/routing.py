"""Routing: router logits `[T, E]` -> `RoutingResult` (fp32 weights `[T, K]`, int32 ids `[T, K]`).

Data flow: logits (any float dtype) are upcast to fp32, scored per `RoutingSpec.method`, the top K
experts are selected with ties going to the lower expert index, weights are normalized per method and
multiplied by `routed_scaling_factor` (the only place it is applied). On CUDA the softmax methods run
as one Triton launch (`moekit.kernels.triton.route`): same ids, weights within a few fp32 ulps.

Ties: `torch.topk` does not promise an order among equal values, so selection is done on a key that
breaks ties by index: a stable descending sort keeps the lower index first among equal scores.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit.errors import DeviceError, DTypeError, ExpertIdError, ShapeError, SpecError
from moekit.spec import RoutingMethod, RoutingSpec


@dataclass(frozen=True)
class RoutingResult:
    """Which experts each token goes to, and with what weight."""

    weights: torch.Tensor  # fp32 [T, K]
    ids: torch.Tensor  # int32 [T, K], global expert ids in [0, E)

    def __post_init__(self) -> None:
        if self.weights.dim() != 2 or self.ids.shape != self.weights.shape:
            raise ShapeError(
                f"routing weights and ids must both be [T, K], got {tuple(self.weights.shape)} and "
                f"{tuple(self.ids.shape)}"
            )
        if self.weights.dtype != torch.float32:
            raise DTypeError(f"routing weights must be float32, got {self.weights.dtype}")
        if self.ids.dtype != torch.int32:
            raise DTypeError(f"routing ids must be int32, got {self.ids.dtype}")
        if self.weights.device != self.ids.device:
            raise DeviceError(f"routing weights on {self.weights.device} but ids on {self.ids.device}")

    @property
    def num_tokens(self) -> int:
        return self.weights.shape[0]

    @property
    def top_k(self) -> int:
        return self.weights.shape[1]

    def check_ids(self, num_experts: int) -> None:
        """Raise `ExpertIdError` if any id is outside `[0, E)`. Syncs with the device: call at the edge."""
        if self.ids.numel() == 0:
            return
        lo, hi = int(self.ids.min()), int(self.ids.max())
        if lo < 0 or hi >= num_experts:
            bad = ((self.ids < 0) | (self.ids >= num_experts)).nonzero()[0].tolist()
            raise ExpertIdError(
                f"expert ids must be in [0, E={num_experts}); found min={lo}, max={hi} "
                f"(first bad entry at [token, k]={bad})"
            )


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; among equal scores the lower index wins."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.gather(scores, -1, order), order


def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    spec: RoutingSpec,
    correction_bias: torch.Tensor | None = None,
) -> RoutingResult:
    """Select `top_k` experts per token from router logits `[T, E]` as `spec` says."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ShapeError(
            f"router logits must be a float [T, E] tensor, got {getattr(logits, 'shape', logits)!r}"
        )
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise SpecError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    grouped = spec.method is RoutingMethod.SIGMOID_GROUPED
    if spec.has_correction_bias != (correction_bias is not None):
        raise SpecError(
            f"spec.has_correction_bias={spec.has_correction_bias} but correction_bias "
            f"{'was' if correction_bias is not None else 'was not'} given"
        )
    if correction_bias is not None:
        if correction_bias.shape != (num_experts,):
            raise ShapeError(f"correction_bias must be [E={num_experts}], got {tuple(correction_bias.shape)}")
        if correction_bias.device != logits.device:
            raise DeviceError(f"correction_bias on {correction_bias.device} but logits on {logits.device}")
    if grouped and spec.n_group is not None and num_experts % spec.n_group:
        raise SpecError(f"E={num_experts} is not divisible by n_group={spec.n_group}")

    fast = _fast_softmax_route(logits, top_k=top_k, spec=spec)
    if fast is not None:
        return fast
    scores = logits.float()
    if spec.method is RoutingMethod.TOPK_SOFTMAX:
        top_logits, ids = _stable_topk(scores, top_k)
        weights = torch.softmax(top_logits, dim=-1)
    elif spec.method is RoutingMethod.SOFTMAX_TOPK:
        probs = torch.softmax(scores, dim=-1)
        weights, ids = _stable_topk(probs, top_k)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        weights, ids = _sigmoid_grouped(scores, top_k=top_k, spec=spec, correction_bias=correction_bias)
    weights = weights * spec.routed_scaling_factor
    return RoutingResult(weights=weights.contiguous(), ids=ids.to(torch.int32).contiguous())


def _fast_softmax_route(logits: torch.Tensor, *, top_k: int, spec: RoutingSpec) -> RoutingResult | None:
    """CUDA logits and a softmax routing: the same selection in one Triton launch, where the torch ops
    below took 13 us at T = 1 and 95 us of sorting at T = 16384 (gpt-oss-120b, H200, RESULTS.md).
    None otherwise."""
    if not logits.is_cuda:
        return None
    triton_route = _triton_route_module()
    if triton_route is None or not triton_route.fast_route_supported(spec, logits.shape[1]):
        return None
    weights, ids = triton_route.route_softmax(logits, top_k=top_k, spec=spec)
    return RoutingResult(weights=weights, ids=ids)


@functools.cache
def _triton_route_module():
    """`moekit.kernels.triton.route`, imported on first use (Triton is optional), or None without Triton."""
    try:
        from moekit.kernels.triton import route as triton_route
    except ImportError:
        return None
    return triton_route


def _sigmoid_grouped(
    logits: torch.Tensor, *, top_k: int, spec: RoutingSpec, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: select on sigmoid + bias within the best groups; weigh by the unbiased sigmoid."""
    scores = torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.n_group is not None and spec.n_group > 1:
        num_tokens, num_experts = choice.shape
        per_group = num_experts // spec.n_group
        grouped = choice.view(num_tokens, spec.n_group, per_group)
        # Group score = sum of its best two (one if a group has a single expert), as DeepSeek-V3 does.
        group_scores = _stable_topk(grouped, min(2, per_group))[0].sum(dim=-1)
        keep_groups = _stable_topk(group_scores, spec.topk_group)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = _stable_topk(choice, top_k)[1]
    weights = torch.gather(scores, 1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_expert_map(expert_map: torch.Tensor, *, num_experts: int, num_local_experts: int) -> None:
    """An expert map is int32 `[E]`, each entry -1 (another rank) or a distinct local id in `[0, E_local)`."""
    if expert_map.shape != (num_experts,) or expert_map.dtype != torch.int32:
        raise ExpertIdError(
            f"expert_map must be int32 [E={num_experts}], got {expert_map.dtype} {tuple(expert_map.shape)}"
        )
    local = expert_map[expert_map >= 0]
    if bool((expert_map < -1).any()) or (local.numel() and int(local.max()) >= num_local_experts):
        raise ExpertIdError(
            f"expert_map entries must be -1 or in [0, E_local={num_local_experts}); got min "
            f"{int(expert_map.min())}, max {int(expert_map.max())}"
        )
    if local.unique().numel() != local.numel():
        raise ExpertIdError("expert_map maps two global experts to the same local expert")
