"""Routing in torch ops, the twin of every fast route: router logits `[T, E]` -> `RoutingResult` (fp32
weights `[T, K]`, int32 ids `[T, K]`).

Data flow: logits (float32, bfloat16, float16 or float64) are cast to fp32, scored per
`RoutingSpec.method`, the top K experts are selected with ties going to the lower expert index, weights
are normalized per method and multiplied by `routed_scaling_factor` (the only place it is applied).
`moekit.route` (in `moekit.ops`) checks the arguments and picks this or a fast route: on CUDA every
method runs as one Triton launch for E <= 1024 (`moekit.kernels.triton.route`) with the same ids and
weights within a few fp32 ulps.

Ties: `torch.topk` does not promise an order among equal values, so selection is done on a key that
breaks ties by index: a stable descending sort keeps the lower index first among equal scores.

Non-finite logits, the contract of every method (TOPK_SOFTMAX, SOFTMAX_TOPK with or without
renormalize, SIGMOID_GROUPED) and of every route (this twin, the Triton route, `FusedMoE`):
- Router logits must be finite, in float32 (a float64 value beyond its range counts as +-inf), and
  so must a correction bias (checked once when `FusedMoE` is built, and by `moekit.route` with the
  logits). NaN, +inf and -inf are all refused: `moekit.route` and `FusedMoE`
  raise `NonFiniteError` (naming the count, the first [token, expert] and its value) before anything
  runs, wherever they may read values: not while a CUDA graph is being captured (a captured forward
  never synchronizes with the host), and not when the caller turned value checks off
  (`route(..., check_values=False)`, `FusedMoE.check_values = False`). To mask an expert, give it a
  large finite negative logit (`torch.finfo(torch.float32).min`), not -inf.
- Where values are not read, the rule is computed on the device, without a sync: a token with any
  non-finite logit gets NaN for all K weights (its ids stay in [0, E)), so its output row is NaN on
  every rank that holds one of its experts, never a finite wrong answer. Other tokens are unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import DeviceError, DTypeError, ExpertIdError, ShapeError
from moekit.spec import RoutingMethod, RoutingSpec


@dataclass(frozen=True)
class RoutingResult:
    """Which experts each token goes to, and with what weight."""

    weights: torch.Tensor  # fp32 [T, K]
    ids: torch.Tensor  # int32 [T, K], global expert ids in [0, E)

    def __post_init__(self) -> None:
        for name, need in (("weights", "float32 [T, K]"), ("ids", "int32 [T, K]")):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                shown = "None" if value is None else f"a {type(value).__name__}"
                raise ShapeError(
                    f"RoutingResult.{name} must be a torch.Tensor {need}, got {shown}; convert it first "
                    "(or get the RoutingResult from moekit.route)"
                )
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


def route_torch(
    logits: torch.Tensor,
    *,
    top_k: int,
    spec: RoutingSpec,
    correction_bias: torch.Tensor | None = None,
) -> RoutingResult:
    """Select `top_k` experts per token from router logits `[T, E]` as `spec` says, in torch ops.

    The arguments are not checked here: `moekit.route` checks them (`moekit.checks.check_route`) before
    it picks this or a fast route. A token with a non-finite logit gets NaN weights (module docstring)."""
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
    # The contract for unchecked non-finite logits (module docstring): the whole token's weights are NaN.
    poisoned = ~torch.isfinite(scores).all(dim=-1, keepdim=True)
    weights = weights.masked_fill(poisoned, float("nan"))
    return RoutingResult(weights=weights.contiguous(), ids=ids.to(torch.int32).contiguous())


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


def count_per_expert(ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """`out` (int32 `[E]`) := how many (token, k) pairs `ids` (`[T, K]`, global ids) send to each expert.
    In place and without a host sync (no `bincount`, which reads the largest id back), so it can run in
    every forward and inside a captured CUDA graph."""
    flat = ids.reshape(-1).long()
    out.zero_()
    return out.scatter_add_(0, flat, torch.ones_like(flat, dtype=out.dtype))
