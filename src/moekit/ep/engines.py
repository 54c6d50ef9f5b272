"""Expert-parallel engines: move each rank's tokens to the ranks owning their experts and the outputs back.

Data flow, every engine: x_local [T_r, H] and its routing (GLOBAL expert ids, [T_r, K]) on each rank ->
dispatch over `torch.distributed` -> `local_experts(x, routing)`, the caller's forward of this rank's
experts only (a `fused_moe` with the rank's expert map: other ranks' experts contribute zero) ->
combine -> out_local [T_r, H] in x's dtype, equal to the 1-rank layer on the concatenated batch.

- `AllGatherReduceScatter`: every rank's tokens are padded to one row count and all-gathered, every rank
  runs its experts on all of them, and a reduce-scatter sums the contributions back to each token's
  rank. Static shapes when the caller passes `max_tokens` (no count exchange: graph-capturable); without
  it the ranks agree on the largest T with one all-reduce read on the host.
- `AllToAll`: each token goes once to each rank owning at least one of its K experts (not once per k),
  with counts exchanged first (`all_to_all_single` with split sizes: data-dependent shapes, host sync);
  the outputs come back the same way and are summed per token in rank order 0..N-1 in fp32, so the
  result does not depend on arrival order.

A token's row travels as bytes with its routing: [x | weights | ids], the ids bit-cast (exact), so one
collective moves both while the payload is small (latency-bound: each NCCL collective costs tens of µs);
past `PACK_LIMIT_BYTES` x and the routing go in two collectives, which saves the unpacking copy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.ep.ownership import owner_of
from moekit.errors import ArgumentError, ShapeError, check_enum
from moekit.routing import RoutingResult

LocalExperts = Callable[[torch.Tensor, RoutingResult], torch.Tensor]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, as data: the planner refuses an engine whose capabilities do not fit."""

    graph_capturable: bool  # no host sync and no data-dependent shape inside `run`
    static_shapes: bool  # every tensor's shape follows from (T_r, max_tokens), never from routing values
    backends: frozenset[str]  # torch.distributed backends it runs on

    def reason(self, backend: str, *, capturing: bool = False) -> str | None:
        """Why this engine cannot run on `backend` (while capturing a CUDA graph), or None."""
        if backend not in self.backends:
            return f"backend {backend!r} is not one of {sorted(self.backends)}"
        if capturing and not self.graph_capturable:
            return "its shapes depend on routing values (host sync): not capturable in a CUDA graph"
        return None


_BOTH = frozenset({"gloo", "nccl"})


def _pack_routing(routing: RoutingResult) -> torch.Tensor:
    return torch.cat([routing.weights, routing.ids.view(torch.float32)], dim=1)


def _unpack_routing(meta: torch.Tensor, top_k: int) -> RoutingResult:
    return RoutingResult(
        weights=meta[:, :top_k].contiguous(), ids=meta[:, top_k:].contiguous().view(torch.int32)
    )


# Largest packed send buffer per rank (bytes) moved as one collective; above it the unpacking copy costs
# more than the latency of a second collective.
PACK_LIMIT_BYTES = 8 << 20


def packed_row_bytes(hidden: int, act_bytes: int, top_k: int) -> int:
    """Bytes of one token's packed row: its activations, then K fp32 weights and K int32 ids."""
    return hidden * act_bytes + top_k * 8


def moves_packed(rows: int, row_bytes: int) -> bool:
    """Whether `rows` packed rows go as one collective (else x and routing go in two)."""
    return rows * row_bytes <= PACK_LIMIT_BYTES


def _packed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """uint8 [T, H * itemsize + 8K]: each row's activations, K weights and K ids as bytes (one copy)."""
    parts = (x.contiguous(), weights.contiguous(), ids.contiguous())
    return torch.cat([t.view(torch.uint8) for t in parts], dim=1)


def _field(rows: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns [start, stop) of packed byte rows as `dtype`: a strided view where the bytes are aligned
    for it (the kernels read rows by stride), else a copy."""
    part = rows[:, start:stop]
    try:
        return part.view(dtype)
    except RuntimeError:
        return part.contiguous().view(dtype)


def _unpacked(
    rows: torch.Tensor, hidden: int, dtype: torch.dtype, top_k: int
) -> tuple[torch.Tensor, RoutingResult]:
    """Packed rows (`_packed`) -> x [T, H] and its routing, views into `rows` where aligned."""
    width = hidden * torch.empty(0, dtype=dtype).element_size()
    weights = _field(rows, width, width + 4 * top_k, torch.float32)
    ids = _field(rows, width + 4 * top_k, width + 8 * top_k, torch.int32)
    return _field(rows, 0, width, dtype), RoutingResult(weights=weights, ids=ids)


def _start_gather(x: torch.Tensor, routing: RoutingResult, *, world: int, group, async_op: bool):  # noqa: ANN001, ANN202
    """Start all-gathering rows of x and their routing (packed in one collective when small): the
    collectives' works (empty when synchronous) and a function giving (x_all, routing_all) once done."""
    rows, hidden = x.shape
    top_k = routing.top_k
    if moves_packed(rows, packed_row_bytes(hidden, x.element_size(), top_k)):
        send = _packed(x, routing.weights, routing.ids)
        gathered = send.new_empty(world * rows, send.shape[1])
        work = _all_gather(gathered, send, group=group, async_op=async_op)
        return [work] if async_op else [], lambda: _unpacked(gathered, hidden, x.dtype, top_k)
    meta = _pack_routing(routing)
    x_all = x.new_empty(world * rows, hidden)
    meta_all = meta.new_empty(world * rows, meta.shape[1])
    works = [
        _all_gather(x_all, x.contiguous(), group=group, async_op=async_op),
        _all_gather(meta_all, meta, group=group, async_op=async_op),
    ]
    return works if async_op else [], lambda: (x_all, _unpack_routing(meta_all, top_k))


def _padded(routing: RoutingResult, pad: int, *, num_experts: int) -> RoutingResult:
    """`routing` grown by `pad` rows of weight 0 whose K ids cycle through all experts: padding costs
    every rank the same few pairs instead of piling them on expert 0's owner. No copy when pad is 0."""
    if pad == 0:
        return routing
    device, top_k = routing.ids.device, routing.top_k
    ids = torch.arange(pad * top_k, dtype=torch.int32, device=device).remainder_(num_experts)
    weights = torch.zeros(pad, top_k, dtype=torch.float32, device=device)
    return RoutingResult(
        weights=torch.cat([routing.weights, weights]), ids=torch.cat([routing.ids, ids.view(pad, top_k)])
    )


def _rows(routing: RoutingResult, start: int, stop: int) -> RoutingResult:
    return RoutingResult(weights=routing.weights[start:stop], ids=routing.ids[start:stop])


def _check_inputs(x: torch.Tensor, routing: RoutingResult) -> None:
    if x.dim() != 2 or routing.num_tokens != x.shape[0]:
        raise ShapeError(
            f"x must be [T_r, H] with routing [T_r, K]; got x {tuple(x.shape)} and routing "
            f"[{routing.num_tokens}, {routing.top_k}]"
        )


def _check_output(y: torch.Tensor, rows: int, hidden: int) -> None:
    if y.shape != (rows, hidden):
        raise ShapeError(f"local_experts must return [{rows}, {hidden}], got {tuple(y.shape)}")


class EpEngine(enum.Enum):
    """The expert-parallel dispatch/combine engines (values: their names in `explain`)."""

    ALLGATHER_REDUCESCATTER = "allgather_reducescatter"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class AllGatherReduceScatter:
    """all_gather(x, routing) -> this rank's experts on every token -> reduce_scatter(sum) to the owners."""

    kind: EpEngine = EpEngine.ALLGATHER_REDUCESCATTER
    capabilities: EngineCapabilities = EngineCapabilities(
        graph_capturable=True, static_shapes=True, backends=_BOTH
    )
    # Per-rank activation bytes from which the batch runs in two overlapped halves (`_pieces`).
    overlap_min_bytes: int = 32 << 20

    def run(
        self,
        x: torch.Tensor,
        routing: RoutingResult,
        *,
        group: dist.ProcessGroup | None,
        local_experts: LocalExperts,
        num_experts: int,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """out_local [T_r, H]. `max_tokens`: a bound on every rank's T_r known to all (the same on every
        rank): shapes are then static and nothing syncs; without it the ranks agree on max T_r with one
        all-reduce read on the host. Padding rows carry weight 0 (`_padded`)."""
        _check_inputs(x, routing)
        world = dist.get_world_size(group)
        rows, hidden = x.shape
        if max_tokens is None:
            count = torch.tensor([rows], dtype=torch.int64, device=x.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
            max_tokens = int(count.item())
        elif rows > max_tokens:
            raise ShapeError(f"this rank has T_r={rows} tokens, more than max_tokens={max_tokens}")
        if max_tokens == 0:
            return x.new_zeros(0, hidden)
        pad = max_tokens - rows
        x_pad = x if pad == 0 else torch.nn.functional.pad(x, (0, 0, 0, pad))
        routing_pad = _padded(routing, pad, num_experts=num_experts)
        pieces = self._pieces(max_tokens, x)
        overlap = len(pieces) > 1  # collectives run asynchronously, each piece's experts between them
        gathers = [
            _start_gather(x_pad[a:b], _rows(routing_pad, a, b), world=world, group=group, async_op=overlap)
            for a, b in pieces
        ]
        out = x.new_empty(max_tokens, hidden)
        scatters = []
        for (a, b), (works, finish) in zip(pieces, gathers, strict=True):
            for work in works:
                work.wait()
            x_all, routing_all = finish()
            y = local_experts(x_all, routing_all)
            _check_output(y, world * (b - a), hidden)
            scatters.append(_reduce_scatter(out[a:b], y.contiguous(), group=group, async_op=overlap))
        for work in scatters:
            if work is not None:
                work.wait()
        return out[:rows]

    def _pieces(self, max_tokens: int, x: torch.Tensor) -> list[tuple[int, int]]:
        """Row ranges of the padded batch run one after another: two halves when the rows are large
        enough that a collective costs more than its latency (the second half's all-gather then runs
        during the first half's experts, the first half's reduce-scatter during the second's), one
        otherwise and while a CUDA graph is captured (asynchronous collectives stay out of graphs)."""
        row_bytes = x.shape[1] * x.element_size()
        if max_tokens < 2 or max_tokens * row_bytes < self.overlap_min_bytes:
            return [(0, max_tokens)]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return [(0, max_tokens)]
        half = max_tokens // 2
        return [(0, half), (half, max_tokens)]


def dispatch_mask(ids: torch.Tensor, *, num_experts: int, world_size: int) -> torch.Tensor:
    """bool [T, N]: token t goes to rank d iff d owns at least one of its K experts (once, not per k)."""
    owners = owner_of(ids, num_experts=num_experts, world_size=world_size)
    mask = torch.zeros(ids.shape[0], world_size, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, owners, True)


@dataclass(frozen=True)
class AllToAll:
    """Sparse dispatch: each token once per owning rank (exchanged counts) -> experts -> back, summed."""

    kind: EpEngine = EpEngine.ALL_TO_ALL
    capabilities: EngineCapabilities = EngineCapabilities(
        graph_capturable=False, static_shapes=False, backends=_BOTH
    )

    def run(
        self,
        x: torch.Tensor,
        routing: RoutingResult,
        *,
        group: dist.ProcessGroup | None,
        local_experts: LocalExperts,
        num_experts: int,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """out_local [T_r, H]; `max_tokens` is unused (shapes follow the routing) and kept for one
        `run` signature. Syncs once with the host (the split sizes)."""
        del max_tokens
        _check_inputs(x, routing)
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        rows, hidden = x.shape
        mask = dispatch_mask(routing.ids, num_experts=num_experts, world_size=world)
        dest, token = mask.t().nonzero(as_tuple=True)  # sorted by destination rank, then token
        # Row d of `counts`: how many rows this rank sends to d, and how many it sends in all. After the
        # exchange every rank knows what it receives and every rank's total, so all ranks take the same
        # packing decision (a mismatched pair of collectives would deadlock).
        send_counts = mask.sum(dim=0)
        counts = torch.stack([send_counts, send_counts.sum().expand(world)], dim=1)
        exchanged = torch.empty_like(counts)
        dist.all_to_all_single(exchanged, counts, group=group)
        exchanged = exchanged.tolist()
        send_splits, recv_splits = send_counts.tolist(), [c for c, _ in exchanged]
        largest_send = max(total for _, total in exchanged)
        received = sum(recv_splits)
        top_k = routing.top_k
        if moves_packed(largest_send, packed_row_bytes(hidden, x.element_size(), top_k)):
            send = _packed(x[token], routing.weights[token], routing.ids[token])
            rows_recv = send.new_empty(received, send.shape[1])
            dist.all_to_all_single(rows_recv, send, recv_splits, send_splits, group=group)
            x_recv, routing_recv = _unpacked(rows_recv, hidden, x.dtype, top_k)
        else:
            meta = _pack_routing(routing)[token]
            x_recv = x.new_empty(received, hidden)
            dist.all_to_all_single(x_recv, x[token].contiguous(), recv_splits, send_splits, group=group)
            meta_recv = meta.new_empty(received, meta.shape[1])
            dist.all_to_all_single(meta_recv, meta, recv_splits, send_splits, group=group)
            routing_recv = _unpack_routing(meta_recv, top_k)
        # Only this rank's experts are computed here: other ranks' (k) slots get weight zero, so a
        # local_experts that ignored the expert map would still add nothing for them.
        mine = owner_of(routing_recv.ids, num_experts=num_experts, world_size=world) == rank
        routing_recv = RoutingResult(
            weights=routing_recv.weights * mine.to(routing_recv.weights.dtype), ids=routing_recv.ids
        )
        y_recv = local_experts(x_recv, routing_recv)
        _check_output(y_recv, x_recv.shape[0], hidden)

        y_back = y_recv.new_empty(token.shape[0], hidden)
        dist.all_to_all_single(y_back, y_recv.contiguous(), send_splits, recv_splits, group=group)
        out = torch.zeros(rows, hidden, dtype=torch.float32, device=x.device)
        start = 0
        for count in send_splits:  # rank order: each token at most once per rank, no race, same sum
            part = slice(start, start + count)
            out.index_add_(0, token[part], y_back[part].float())
            start += count
        return out.to(x.dtype)


ENGINES: dict[EpEngine, AllGatherReduceScatter | AllToAll] = {
    engine.kind: engine for engine in (AllGatherReduceScatter(), AllToAll())
}


def engine_for(kind: EpEngine) -> AllGatherReduceScatter | AllToAll:
    """The engine of `kind`; anything but an `EpEngine` is an `ArgumentError` naming the choices."""
    check_enum("expert-parallel engine", kind, EpEngine, error=ArgumentError)
    return ENGINES[kind]
