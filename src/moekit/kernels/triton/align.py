"""Device-side routing preparation for the grouped GEMMs: no host synchronization, graph-capturable.

Data flow:
  ids int32 [T, K] (global expert ids) -> optional expert map (int32 [E], -1 = another rank)
  -> local expert of each pair p = t*K + k (`pair_expert`, -1 = dropped: contributes zero)
  -> stable sort of the pairs by local expert (dropped pairs sort last and are left out)
  -> per-expert counts, each expert's segment padded to a multiple of BLOCK_M (`expert_offsets`)
  -> `sorted_pair_ids` (one pair id per padded row; padding rows hold P = T*K), the expert of every
     M-block (`block_expert`) and the number of valid M-blocks (`num_valid_blocks`, on the device).

Tail blocks (`split_tail_blocks`): an alignment at half the GEMM's block_m, walked two blocks at a
time per expert, plus each expert's odd last block alone (a second launch at the half size), so an
expert's last pairs fill half a block instead of padding a whole one. Two `BlockList`s, built on the
device by one Triton program (or torch ops, the specification).

Kernels are launched over `max_blocks` M-blocks, an upper bound known on the host without a sync;
programs past `num_valid_blocks` exit at once. Ids outside [0, E) (or mapped outside [0, E_local))
are dropped rather than read out of bounds; callers check ids once at the edge
(`RoutingResult.check_ids`), never here, because that check syncs.

Three implementations with identical results (`AlignMethod`): for P <= ONE_PROGRAM_MAX_PAIRS one
Triton program (`_details.align._align_pairs`: histogram, cumsum, bitonic sort; one launch, where torch
ops cost ~15 launches, about 45 us of a decode step on an H200); above, a counting sort in three
launches over chunks of pairs, each spread over many programs (on an H200 the one program's sort took
74.7 us at P = 4096, the chunked sort 11.2 us; at P = 32768, E = 128 the chunked sort takes 13.5 us
with L2 flushed, where torch's ops and routing together took 193 us); and torch ops with device-sized
results (sort, searchsorted, cumsum, scatter), the readable specification the tests hold the kernels
to. None waits for the GPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

import triton
from moekit.errors import DTypeError, ShapeError
from moekit.kernels.triton._details import align as _jit_align
from moekit.kernels.triton.block_choice import takes_one_block_per_pair
from moekit.kernels.triton.pdl import pdl_args

# One program sorts at most this many pairs (bitonic sort in registers); larger batches are chunked.
ONE_PROGRAM_MAX_PAIRS = 1024
# The one-program alignment's lanes for filling the padding rows, whatever the pair count (a power of two).
FILL_LANES = 1024
# Chunked counting sort: a chunk's one-hot [CHUNK, BLOCK_E] holds at most this many int32.
_ONE_HOT_ELEMENTS = 8192
# From this many experts (a power of two) a chunk step ranks its pairs by comparing them with each other
# (a step of S pairs costs S compares a pair, whatever E is) instead of by a one-hot over the experts (E a
# pair). H200, µs of the chunked alignment at 1024 chunks, one-hot / pairwise steps of 32 / 64 pairs:
# P 131072 E 128 32.6 / 13.8 / 16.5, E 256 36.6 / 17.4 / 18.3; P 524288 E 128 107.6 / 33.2 / 47.2;
# P 163840 E 512 73.5 / 38.5 / 30.7; P 16384 E 128 8.0 / 6.5 / 7.0; E 64: P 16384 6.9 / 6.2 / 6.8, P 98304
# 16.9 / 11.1 / 13.1, P 393216 61.2 / 25.5 / 34.7. At E 32 neither wins (P 32768 7.6 / 7.9, P 131072 13.9 /
# 11.8), at E 16 the one-hot does (P 131072 10.4 / 11.3): a 32-pair step costs what a 32-expert one-hot does.
_PAIRWISE_FROM_EXPERTS = 64
# Chunks (programs) at most: a chunk's one-hot steps run one after another, so fewer, longer chunks leave
# the GPU waiting on each program's chain. Measured on an H200 (P = T*K pairs, E experts, µs at 256 ->
# 1024): P 131072 E 128 35.6 -> 33.4, E 256 43.5 -> 35.8; P 163840 E 512 136.7 -> 73.2; P 524288 E 128
# 127.6 -> 109.1; 2048 or more was no faster, and slower at E 256 - 512.
_MAX_CHUNKS = 1024
# `_align_scan` holds at most this many int32 a program (a column over the chunks per expert);
# `_split_tail_blocks` places this many big blocks a program.
_SCAN_TILE = 4096
_BIG_TILE = 64


class AlignMethod(enum.Enum):
    ONE_PROGRAM = "one Triton program (P <= ONE_PROGRAM_MAX_PAIRS)"
    CHUNKED = "three Triton launches over chunks of pairs (any P)"
    TORCH = "torch ops (the specification)"

    @classmethod
    def for_pairs(cls, num_pairs: int) -> AlignMethod:
        return cls.ONE_PROGRAM if 0 < num_pairs <= ONE_PROGRAM_MAX_PAIRS else cls.CHUNKED


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cdiv_tensor(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + (b - 1)) // b


def max_blocks_bound(*, num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Host upper bound of the M-blocks: sum_e ceil(c_e / BM) <= ceil(P / BM) + E_local, and <= P
    because every block holds at least one pair."""
    return min(num_pairs, cdiv(num_pairs, block_m) + num_local_experts)


@dataclass(frozen=True)
class AlignedRouting:
    """The pairs of a batch grouped by local expert and padded to M-blocks (all tensors on the device)."""

    sorted_pair_ids: torch.Tensor  # int32 [max_blocks * block_m]; pair id t*K+k, or num_pairs for padding
    block_expert: torch.Tensor  # int32 [max_blocks]; local expert of each M-block (E_local past the last)
    num_valid_blocks: torch.Tensor  # int32 [1]; M-blocks that hold pairs
    expert_offsets: torch.Tensor  # int64 [E_local + 1]; padded start row of each expert, last = total rows
    expert_counts: torch.Tensor  # int32 [E_local]; pairs routed to each local expert
    pair_expert: torch.Tensor  # int32 [T*K]; local expert of each pair, -1 if dropped
    block_m: int
    max_blocks: int
    num_pairs: int  # P = T*K


def align_routing(
    ids: torch.Tensor,
    *,
    num_local_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
    method: AlignMethod | None = None,
) -> AlignedRouting:
    """Group the (token, k) pairs of `ids [T, K]` by local expert, padded to multiples of `block_m`.

    `method`: None picks `AlignMethod.for_pairs(T * K)`; every method gives the same tensors.
    """
    _check_ids_shape(ids)
    if block_m < 1 or num_local_experts < 1:
        raise ShapeError(f"need block_m >= 1 and num_local_experts >= 1, got {block_m}, {num_local_experts}")
    num_pairs = ids.numel()
    method = AlignMethod.for_pairs(num_pairs) if method is None else method
    if num_pairs == 0 or method is AlignMethod.TORCH:
        return _align_torch(ids, num_local_experts=num_local_experts, block_m=block_m, expert_map=expert_map)
    if method is AlignMethod.ONE_PROGRAM and num_pairs > ONE_PROGRAM_MAX_PAIRS:
        raise ShapeError(f"the one-program align takes 1..{ONE_PROGRAM_MAX_PAIRS} pairs, got {num_pairs}")
    run = _align_one_program if method is AlignMethod.ONE_PROGRAM else _align_chunked
    return run(ids, num_local_experts=num_local_experts, block_m=block_m, expert_map=expert_map)


def _check_ids_shape(ids: torch.Tensor) -> None:
    if ids.dim() != 2:
        raise ShapeError(f"routing ids must be [T, K], got shape {tuple(ids.shape)}")


def _expert_map_args(expert_map: torch.Tensor | None, e_local: int) -> dict:
    """The expert-map arguments `_align_count` and `_align_pairs` take under the same names."""
    return dict(
        expert_map_ptr=expert_map,  # int32 [E] or None
        num_experts=expert_map.numel() if expert_map is not None else e_local,
        NUM_LOCAL=e_local,
        HAS_MAP=expert_map is not None,
    )


def _outputs(device: torch.device, *, num_pairs: int, e_local: int, block_m: int, max_blocks: int) -> dict:
    return dict(
        sorted_pair_ids=torch.empty(max_blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(max_blocks, dtype=torch.int32, device=device),
        num_valid_blocks=torch.empty(1, dtype=torch.int32, device=device),
        expert_offsets=torch.empty(e_local + 1, dtype=torch.int64, device=device),
        expert_counts=torch.empty(e_local, dtype=torch.int32, device=device),
        pair_expert=torch.empty(num_pairs, dtype=torch.int32, device=device),
    )


def _count_step(block_e: int) -> tuple[bool, int]:
    """(pairwise, pairs a step) of `_align_count` for `block_e` experts (`_PAIRWISE_FROM_EXPERTS`)."""
    if block_e < _PAIRWISE_FROM_EXPERTS:
        return False, max(16, min(256, _ONE_HOT_ELEMENTS // block_e))
    return True, 32 if block_e <= 256 else 64


def _align_chunked(
    ids: torch.Tensor, *, num_local_experts: int, block_m: int, expert_map: torch.Tensor | None
) -> AlignedRouting:
    device, num_pairs, e_local = ids.device, ids.numel(), num_local_experts
    max_blocks = max_blocks_bound(num_pairs=num_pairs, num_local_experts=e_local, block_m=block_m)
    out = _outputs(device, num_pairs=num_pairs, e_local=e_local, block_m=block_m, max_blocks=max_blocks)
    block_e = triton.next_power_of_2(e_local)
    pairwise, sub = _count_step(block_e)
    # At most _MAX_CHUNKS chunks: `_align_scan` holds an expert's column over the chunks in one tile.
    n_sub = triton.next_power_of_2(cdiv(num_pairs, sub * _MAX_CHUNKS))
    num_chunks = cdiv(num_pairs, sub * n_sub)
    blocks_per_program = triton.next_power_of_2(cdiv(max_blocks, num_chunks))
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    num_warps = 8 if sub * (sub if pairwise else block_e) > 4096 else 4
    _jit_align._align_count[(num_chunks,)](
        **pdl_args(device),
        ids_ptr=ids,  # int32 [T, K] = [P]
        pair_expert_ptr=out["pair_expert"],  # int32 [P]
        rank_ptr=rank,  # int32 [P]
        chunk_counts_ptr=chunk_counts,  # int32 [num_chunks, BLOCK_E]
        num_pairs=num_pairs,
        **_expert_map_args(expert_map, e_local),
        SUB=sub,
        N_SUB=n_sub,
        BLOCK_E=block_e,
        PAIRWISE=pairwise,
        num_warps=num_warps,
    )
    chunks_bound = triton.next_power_of_2(num_chunks)
    scan_experts = min(block_e, max(1, _SCAN_TILE // chunks_bound))
    _jit_align._align_scan[(block_e // scan_experts,)](
        **pdl_args(device),
        chunk_counts_ptr=chunk_counts,  # int32 [num_chunks, BLOCK_E], counts -> first ranks
        expert_counts_ptr=out["expert_counts"],  # int32 [E_local]
        num_chunks=num_chunks,
        NUM_LOCAL=e_local,
        BLOCK_E=block_e,
        EXPERTS=scan_experts,
        CHUNKS_BOUND=chunks_bound,
        num_warps=4,
    )
    _jit_align._align_scatter[(num_chunks,)](
        **pdl_args(device),
        pair_expert_ptr=out["pair_expert"],  # int32 [P]
        rank_ptr=rank,  # int32 [P]
        chunk_first_ptr=chunk_counts,  # int32 [num_chunks, BLOCK_E]
        expert_counts_ptr=out["expert_counts"],  # int32 [E_local]
        sorted_pairs_ptr=out["sorted_pair_ids"],  # int32 [max_blocks * BLOCK_M]
        block_expert_ptr=out["block_expert"],  # int32 [max_blocks]
        num_blocks_ptr=out["num_valid_blocks"],  # int32 [1]
        expert_offsets_ptr=out["expert_offsets"],  # int64 [E_local + 1]
        num_pairs=num_pairs,
        max_blocks=max_blocks,
        NUM_LOCAL=e_local,
        BLOCK_M=block_m,
        SUB=sub,
        N_SUB=n_sub,
        BLOCK_E=block_e,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        BLOCK_TILE=min(blocks_per_program, max(1, 4096 // max(block_e, block_m))),
        num_warps=num_warps,
    )
    return AlignedRouting(block_m=block_m, max_blocks=max_blocks, num_pairs=num_pairs, **out)


def _align_one_program(
    ids: torch.Tensor, *, num_local_experts: int, block_m: int, expert_map: torch.Tensor | None
) -> AlignedRouting:
    device, num_pairs, e_local = ids.device, ids.numel(), num_local_experts
    max_blocks = max_blocks_bound(num_pairs=num_pairs, num_local_experts=e_local, block_m=block_m)
    block_p = triton.next_power_of_2(num_pairs)  # compiles once per power of two, not per T
    bound = max_blocks_bound(num_pairs=block_p, num_local_experts=e_local, block_m=block_m)
    out = _outputs(device, num_pairs=num_pairs, e_local=e_local, block_m=block_m, max_blocks=max_blocks)
    seg_start = torch.empty(e_local + 1, dtype=torch.int32, device=device)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    _jit_align._align_pairs[(1,)](
        **pdl_args(device),
        ids_ptr=ids,  # int32 [T, K] = [P]
        pair_expert_ptr=out["pair_expert"],  # int32 [P]
        sorted_pairs_ptr=out["sorted_pair_ids"],  # int32 [max_blocks * block_m]
        block_expert_ptr=out["block_expert"],  # int32 [max_blocks]
        num_blocks_ptr=out["num_valid_blocks"],  # int32 [1]
        expert_offsets_ptr=out["expert_offsets"],  # int64 [E_local + 1]
        expert_counts_ptr=out["expert_counts"],  # int32 [E_local]
        seg_start_ptr=seg_start,  # int32 [E_local + 1]
        num_pairs=num_pairs,
        max_blocks=max_blocks,
        **_expert_map_args(expert_map, e_local),
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        BLOCK_E=triton.next_power_of_2(e_local + 1),
        MAX_BLOCKS=bound,
        FILL=min(FILL_LANES, triton.next_power_of_2(bound * block_m)),
        num_warps=4 if block_p <= 1024 else 8,
    )
    return AlignedRouting(block_m=block_m, max_blocks=max_blocks, num_pairs=num_pairs, **out)


def _align_torch(
    ids: torch.Tensor, *, num_local_experts: int, block_m: int, expert_map: torch.Tensor | None
) -> AlignedRouting:
    device = ids.device
    num_pairs = ids.numel()
    e_local = num_local_experts
    max_blocks = max_blocks_bound(num_pairs=num_pairs, num_local_experts=e_local, block_m=block_m)
    max_rows = max_blocks * block_m

    flat = ids.reshape(-1).to(torch.int64)
    if expert_map is not None:
        num_global = expert_map.numel()
        in_range = (flat >= 0) & (flat < num_global)
        mapped = expert_map.to(torch.int64)[flat.clamp(0, max(num_global - 1, 0))]
        flat = torch.where(in_range, mapped, torch.full_like(mapped, -1))
    valid = (flat >= 0) & (flat < e_local)
    pair_expert = torch.where(valid, flat, torch.full_like(flat, -1)).to(torch.int32)
    key = torch.where(valid, flat, torch.full_like(flat, e_local))  # dropped pairs sort after every expert

    # Stable: pairs of one expert keep increasing pair order, so results never depend on sort internals.
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(e_local + 1, device=device, dtype=torch.int64)
    seg_start = torch.searchsorted(sorted_key, experts)  # [E_local + 1]; last entry = number of kept pairs
    counts = seg_start[1:] - seg_start[:-1]
    padded_end = torch.cumsum(_cdiv_tensor(counts, block_m) * block_m, dim=0)
    expert_offsets = torch.cat([padded_end.new_zeros(1), padded_end])  # int64 [E_local + 1]

    # Row of each sorted pair: its expert's padded start + its rank within the expert. Dropped pairs go
    # to distinct rows past max_rows (sliced off below), so every scatter index is unique.
    position = torch.arange(num_pairs, device=device, dtype=torch.int64)
    rank = position - seg_start[sorted_key]
    row = torch.where(sorted_key < e_local, expert_offsets[sorted_key] + rank, max_rows + position)
    rows = torch.full((max_rows + num_pairs,), num_pairs, dtype=torch.int32, device=device)
    rows.scatter_(0, row, order.to(torch.int32))

    block_start = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    num_valid_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    return AlignedRouting(
        sorted_pair_ids=rows[:max_rows],
        block_expert=block_expert,
        num_valid_blocks=num_valid_blocks,
        expert_offsets=expert_offsets,
        expert_counts=counts.to(torch.int32),
        pair_expert=pair_expert,
        block_m=block_m,
        max_blocks=max_blocks,
        num_pairs=num_pairs,
    )


@dataclass(frozen=True)
class BlockList:
    """M-blocks of one size over an alignment's `sorted_pair_ids`: what one launch of a GEMM walks."""

    block_m: int
    block_start: torch.Tensor | None  # int32 [max_blocks]: first sorted row of each block; None: b * block_m
    block_expert: torch.Tensor  # int32 [max_blocks]: local expert of each block (valid ones only)
    num_valid_blocks: torch.Tensor | None  # int32 [1]; None: every block of the grid holds pairs
    max_blocks: int  # host bound of the valid blocks (the launch grid)

    @classmethod
    def of(cls, aligned: AlignedRouting) -> BlockList:
        """The alignment's own blocks."""
        return cls(aligned.block_m, None, aligned.block_expert, aligned.num_valid_blocks, aligned.max_blocks)


def one_block_per_pair(ids: torch.Tensor, *, block_m: int) -> BlockList:
    """Pair b = t*K + k alone in M-block b (its first row; the kernels mask the others), expert ids[t, k]:
    no kernel launch, `ids [T, K]` (int32) read as they are. Every expert must be local; an id outside
    [0, E_local) (routing not checked) reads expert 0's weights and the finish kernels drop its pair."""
    if ids.dtype != torch.int32:
        raise DTypeError(f"one_block_per_pair reads ids as int32, got {ids.dtype}")
    return BlockList(block_m, None, ids.reshape(-1), None, ids.numel())  # a view of contiguous ids


@dataclass(frozen=True)
class GemmBlocks:
    """What the GEMM launches of one layer call walk: their block lists, the sorted pair list those index
    (None: one block a pair) and each pair's local expert (outside [0, E_local), -1 included: not computed
    here; one block a pair passes the routing ids as they are)."""

    block_lists: tuple[BlockList, ...]  # one launch of each GEMM per list, empty lists left out
    pair_expert: torch.Tensor  # int32 [T*K]
    aligned: AlignedRouting | None  # the alignment the lists walk; None: one block a pair

    @property
    def sorted_pair_ids(self) -> torch.Tensor | None:
        """The sorted pair list the block lists index, or None (one block a pair)."""
        return None if self.aligned is None else self.aligned.sorted_pair_ids


def gemm_blocks(
    ids: torch.Tensor,
    *,
    num_local_experts: int,
    block_m: int,
    tail_block_m: int | None,
    expert_map: torch.Tensor | None,
    expert_bytes: int,
    always_aligned: bool = False,
) -> GemmBlocks:
    """`one_block_per_pair` for a decode step of one token or of pairs sparse enough among the local
    experts (`takes_one_block_per_pair`; `expert_bytes`: one expert's weights, `MoESpec.expert_weight_bytes`),
    else the alignment: blocks of `block_m` rows, or with `tail_block_m` blocks of twice it and each
    expert's odd last block apart. `always_aligned`: the alignment at any T (for GEMMs that read the
    sorted rows)."""
    _check_ids_shape(ids)  # T and K are read before either path
    if not (tail_block_m or always_aligned) and takes_one_block_per_pair(
        num_tokens=ids.shape[0],
        top_k=ids.shape[1],
        num_local_experts=num_local_experts,
        has_expert_map=expert_map is not None,
        expert_bytes=expert_bytes,
    ):
        blocks = one_block_per_pair(ids, block_m=block_m)
        return GemmBlocks((blocks,), blocks.block_expert, None)  # every pair local: its expert is its id
    aligned = align_routing(
        ids, num_local_experts=num_local_experts, block_m=tail_block_m or block_m, expert_map=expert_map
    )
    lists = split_tail_blocks(aligned) if tail_block_m else (BlockList.of(aligned),)
    lists = tuple(b for b in lists if b.max_blocks > 0)
    return GemmBlocks(lists, aligned.pair_expert, aligned)


def split_tail_blocks(
    aligned: AlignedRouting, *, method: AlignMethod | None = None
) -> tuple[BlockList, BlockList]:
    """(blocks of 2 * block_m rows, tail blocks of block_m rows) over `aligned` (padded to block_m): each
    expert's padded segment taken two blocks at a time, its last block alone when their number is odd.
    An expert's last pairs then fill half a large block instead of wasting the other half on padding.
    TORCH computes the same lists with torch ops (the specification); otherwise Triton programs."""
    max_big, max_tail = aligned.max_blocks // 2, min(aligned.expert_counts.numel(), aligned.max_blocks)
    return _big_blocks(aligned, max_big=max_big, max_tail=max_tail, method=method)


def paired_blocks(aligned: AlignedRouting, *, method: AlignMethod | None = None) -> BlockList:
    """Blocks of 2 * block_m rows over `aligned` (padded to block_m): each expert's padded segment taken
    two blocks at a time, its odd last block (if any) as the first half of one more, in place, so
    that it runs in the same launch as, and next to, the expert's other blocks. The second half of such
    a block is another expert's rows or past the last: a GEMM walking this list must drop the rows at or
    past `aligned.expert_offsets[expert + 1]`."""
    e_local, max_blocks = aligned.expert_counts.numel(), aligned.max_blocks
    # sum over experts of ceil(blocks / 2) <= (valid blocks + experts with a block) / 2
    max_big = min(max_blocks, cdiv(max_blocks + min(e_local, max_blocks), 2))
    return _big_blocks(aligned, max_big=max_big, max_tail=None, method=method)[0]


def _big_blocks(
    aligned: AlignedRouting, *, max_big: int, max_tail: int | None, method: AlignMethod | None
) -> tuple[BlockList, BlockList | None]:
    """The big blocks and the tail blocks of `split_tail_blocks`, or with `max_tail` None the big blocks
    of `paired_blocks` (an odd last block among them) and no tail list."""
    t, e_local = aligned.block_m, aligned.expert_counts.numel()
    device = aligned.sorted_pair_ids.device
    half_last = max_tail is None
    if method is AlignMethod.TORCH or aligned.num_pairs == 0:
        return _big_blocks_torch(aligned, max_big=max_big, max_tail=max_tail)
    big_start = torch.empty(max(max_big, 1), dtype=torch.int32, device=device)
    big_expert = torch.empty_like(big_start)
    tail_start = None if half_last else torch.empty(e_local, dtype=torch.int32, device=device)
    tail_expert = None if half_last else torch.empty_like(tail_start)
    num_big = torch.empty(1, dtype=torch.int32, device=device)
    num_tail = None if half_last else torch.empty_like(num_big)
    big_bound = triton.next_power_of_2(max(max_big, 1))
    big_tile = min(big_bound, _BIG_TILE)
    _jit_align._split_tail_blocks[(big_bound // big_tile,)](
        **pdl_args(device),
        expert_offsets_ptr=aligned.expert_offsets,  # int64 [E_local + 1]
        expert_counts_ptr=aligned.expert_counts,  # int32 [E_local]
        big_start_ptr=big_start,
        big_expert_ptr=big_expert,
        num_big_ptr=num_big,
        tail_start_ptr=tail_start,
        tail_expert_ptr=tail_expert,
        num_tail_ptr=num_tail,
        max_big=max_big,
        NUM_LOCAL=e_local,
        TAIL_M=t,
        BLOCK_E=triton.next_power_of_2(e_local),
        BIG_TILE=big_tile,
        HALF_LAST=half_last,
    )
    big = BlockList(2 * t, big_start, big_expert, num_big, max_big)
    return big, None if half_last else BlockList(t, tail_start, tail_expert, num_tail, max_tail)


def _big_blocks_torch(
    aligned: AlignedRouting, *, max_big: int, max_tail: int | None
) -> tuple[BlockList, BlockList | None]:
    half_last = max_tail is None
    t, device = aligned.block_m, aligned.sorted_pair_ids.device
    e_local = aligned.expert_counts.numel()
    offset = aligned.expert_offsets[:-1]
    blocks = _cdiv_tensor(aligned.expert_counts.long(), t)
    pairs = (blocks + int(half_last)) // 2
    big_end = torch.cumsum(pairs, 0)
    i = torch.arange(max(max_big, 1), device=device)
    owner = torch.searchsorted(big_end, i, right=True)  # E_local past the last big block
    mine = owner.clamp(max=e_local - 1)
    big_start = offset[mine] + (i - (big_end - pairs)[mine]) * 2 * t
    num_big = pairs.sum().reshape(1).to(torch.int32)
    big = BlockList(2 * t, big_start.to(torch.int32), owner.to(torch.int32), num_big, max_big)
    if half_last:
        return big, None
    has_tail = blocks % 2 == 1
    # Tails in expert order: a stable sort puts the experts with one first (device-sized, no sync).
    order = torch.sort((~has_tail).to(torch.int8), stable=True).indices
    tail_start = (offset + (blocks - 1) * t)[order]
    num_tail = has_tail.sum().reshape(1).to(torch.int32)
    return big, BlockList(t, tail_start.to(torch.int32), order.to(torch.int32), num_tail, max_tail)


def pair_rows(aligned: AlignedRouting) -> torch.Tensor:
    """int32 [T*K]: the row of `aligned.sorted_pair_ids` that holds each kept pair (the inverse
    permutation; entries of dropped pairs are left unwritten: read them only where `pair_expert` >= 0)."""
    rows = torch.empty(aligned.num_pairs, dtype=torch.int32, device=aligned.sorted_pair_ids.device)
    if aligned.max_blocks > 0:
        _jit_align._pair_rows[(aligned.max_blocks,)](
            **pdl_args(aligned.sorted_pair_ids.device),
            sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [max_blocks * block_m]
            num_blocks_ptr=aligned.num_valid_blocks,  # int32 [1]
            pair_rows_ptr=rows,  # int32 [T*K]
            num_pairs=aligned.num_pairs,
            BLOCK_M=aligned.block_m,
        )
    return rows
