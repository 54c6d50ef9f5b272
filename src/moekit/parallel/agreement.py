"""What the ranks of a parallel group agree on before their collectives, so that no rank raising alone
leaves the others waiting in one.

Data flow, each forward of a parallel layer that is not being captured: this rank's verdict (its token
count, whether its router logits hold a non-finite value, and the moekit error its arguments were
refused with, if any) -> `agree`: one all-reduce(MAX) of four int64 values, read on the host -> the same
`Agreement` on every rank -> `Agreement.raise_for_group`: every rank raises the same error type (the
refused rank its own error, the others one that points at it), or none does.

A rank whose inputs are refused (a wrong hidden size, dtype or device, router logits of the wrong shape)
still joins the agreement its peers are waiting in, with its error's code (`refusal_code`), and then
raises; its peers raise the same type at once instead of waiting in the collective that follows. Errors
that are not moekit's (a bug, a CUDA error) are not caught: they propagate on their rank alone.

Which forwards agree: every eager forward of an expert-parallel layer (it needs the group's largest token
count anyway), and of a tensor-parallel layer with `check_values` on (the default: the all-reduce stands
in for the local finite-logits sync, and also refuses ranks passing different token counts). With
`check_values` off a tensor-parallel forward syncs nothing and agrees on nothing: a rank refusing its
inputs then raises alone, and its peers wait in the output's all-reduce until the backend's timeout.
`check_values` must be the same on every rank of a tensor-parallel group. Nothing agrees while a CUDA graph
is being captured (nothing may be read back): every rank must capture the same, valid, shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.checks import check_finite_logits, finite_as_routed
from moekit.errors import (
    ArgumentError,
    CheckpointError,
    DeviceError,
    DTypeError,
    ExpertIdError,
    FormatError,
    LayoutMismatchError,
    MoekitError,
    NonFiniteError,
    ShapeError,
    SpecError,
    UnsupportedSpecError,
)

# The types a refusal is sent as (its code is the position + 1; 0: nothing refused). When ranks refuse
# with different types, the largest code wins on the ranks that did not refuse.
REFUSALS: tuple[type[MoekitError], ...] = (
    ArgumentError,
    SpecError,
    ShapeError,
    DTypeError,
    DeviceError,
    ExpertIdError,
    LayoutMismatchError,
    FormatError,
    NonFiniteError,
    CheckpointError,
    UnsupportedSpecError,
)


def refusal_code(refused: MoekitError | None) -> int:
    """0 for None, else the code of `refused`'s type (a moekit error of no listed type: `ArgumentError`)."""
    if refused is None:
        return 0
    for code, kind in enumerate(REFUSALS, start=1):
        if isinstance(refused, kind):
            return code
    return 1


def raise_refusal(code: int, own: MoekitError | None, where: str) -> None:
    """Raise `own` (this rank's refusal), else, when another rank refused (`code` > 0), that type."""
    if own is not None:
        raise own
    if code:
        kind = REFUSALS[code - 1]
        raise kind(
            f"{where}: another rank of this group refused its arguments with {kind.__name__} (see that "
            "rank's error); every rank raises, so that none waits in a collective"
        )


@dataclass(frozen=True)
class Agreement:
    """The group's verdict on one forward, the same on every rank."""

    largest: int  # the largest per-rank token count
    smallest: int  # the smallest per-rank token count (a refused rank counts 0)
    non_finite: bool  # some rank's router logits hold NaN or +-inf
    refused: int  # `refusal_code` of some rank's refused arguments; 0: none

    def raise_for_group(self, logits: torch.Tensor | None, *, where: str, same_tokens: bool) -> None:
        """Raise on every rank when any rank refused its arguments, held non-finite logits, or (with
        `same_tokens`: tensor parallelism, whose activations are replicated) passed another token count.
        `logits`: this rank's, to say where its own non-finite value is."""
        raise_refusal(self.refused, None, where)
        if self.non_finite:
            if logits is not None and not bool(finite_as_routed(logits).all()):
                check_finite_logits(logits)  # this rank's own: say where
            raise NonFiniteError(
                f"{where}: router logits on another rank of this group hold NaN or +-inf (every rank "
                "raises, so none waits in a collective); see that rank's error for where"
            )
        if same_tokens and self.smallest != self.largest:
            raise ShapeError(
                f"{where}: the ranks passed {self.smallest} to {self.largest} tokens; tensor parallelism "
                "replicates activations, so every rank of the group passes the same tokens"
            )


def agree(
    rows: int,
    logits: torch.Tensor | None,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    refused: MoekitError | None = None,
) -> Agreement:
    """The group's `Agreement`: one all-reduce, read on the host. Without `logits` this rank counts as
    finite; a rank passing `refused` joins with its error's code (module docstring)."""
    state = torch.tensor([rows, -rows, 0, refusal_code(refused)], dtype=torch.int64, device=device)
    if logits is not None:
        state[2] = (~finite_as_routed(logits)).any().to(torch.int64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX, group=group)
    largest, negated_smallest, any_bad, code = state.tolist()
    return Agreement(largest, -negated_smallest, bool(any_bad), code)


@contextmanager
def refused_in_forward(group: dist.ProcessGroup | None, device: torch.device) -> Iterator[None]:
    """Around a forward's input checks: a moekit error raised inside joins `group`'s agreement, which the
    peers are waiting in, with its code before it propagates (None: no group agrees in this forward)."""
    try:
        yield
    except MoekitError as refused:
        if group is not None:
            agree(0, None, group=group, device=device, refused=refused)
        raise
