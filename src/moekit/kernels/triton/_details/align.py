"""Triton JIT code of the routing preparation (host side: `align.py`).

Data flow: ids [T, K] (through the optional expert map) -> each pair's local expert -> a stable counting
sort of the (token, k) pairs by local expert, padded per expert to BLOCK_M rows -> the M-block
metadata the GEMMs read. Two ways to the same result:
- `_align_pairs`: one program (histogram, cumsum, bitonic sort in registers); one launch, for small P.
- `_align_count` -> `_align_scan` -> `_align_scatter`: the pairs in chunks of CHUNK, one program per
  chunk, so the work spreads over the GPU whatever P is. `_align_count` finds each pair's local expert,
  its rank among the chunk's earlier pairs of that expert (a one-hot cumsum) and the chunk's histogram;
  `_align_scan` (one program per group of experts) turns the histograms into each chunk's first rank
  per expert and each expert's count; `_align_scatter` derives the padded expert offsets from the
  counts, writes each pair at its expert's offset + its chunk's first rank + its rank, the owner of
  every M-block and the padding rows.
"""

import triton
import triton.language as tl
from moekit.kernels.triton._details.pdl import _pdl_prologue


@triton.jit
def _is_local(expert, num_local):
    """Whether `expert` is one of this rank's [0, num_local): the one rule by which the alignment, the
    GEMMs' one-block-a-pair path and the finish kernels drop a pair (another rank's, or an id out of
    range in routing not checked)."""
    return (expert >= 0) & (expert < num_local)


@triton.jit
def _local_expert(
    ids_ptr, expert_map_ptr, p, in_p, num_experts, NUM_LOCAL: tl.constexpr, HAS_MAP: tl.constexpr
):
    """(local expert, kept) of pairs `p`: ids outside [0, E) or mapped outside [0, E_local) are dropped."""
    gid = tl.load(ids_ptr + p, mask=in_p, other=-1)
    if HAS_MAP:
        local = tl.load(expert_map_ptr + gid, mask=in_p & (gid >= 0) & (gid < num_experts), other=-1)
    else:
        local = gid
    return local, in_p & _is_local(local, NUM_LOCAL)


@triton.jit
def _align_pairs(
    ids_ptr,  # int32 [P] global expert ids (P = T*K pairs)
    expert_map_ptr,  # int32 [E] global -> local (-1 = another rank) or None
    pair_expert_ptr,  # out int32 [P]: local expert of each pair, -1 if dropped
    sorted_pairs_ptr,  # out int32 [max_blocks * BLOCK_M]: pair ids by expert, P for padding
    block_expert_ptr,  # out int32 [max_blocks]: local expert of each M-block (NUM_LOCAL past the last)
    num_blocks_ptr,  # out int32 [1]
    expert_offsets_ptr,  # out int64 [NUM_LOCAL + 1]: padded start row of each expert, last = total
    expert_counts_ptr,  # out int32 [NUM_LOCAL]
    seg_start_ptr,  # scratch int32 [NUM_LOCAL + 1]: unpadded start of each expert in sorted order
    num_pairs,
    max_blocks,
    num_experts,
    NUM_LOCAL: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
    FILL: tl.constexpr = 0,  # lanes of the padding fill (>= BLOCK_P); 0: BLOCK_P
):
    """align.py's routing preparation in one program (P <= BLOCK_P): one launch instead of ~15 torch ops.

    histogram -> padded counts -> cumsum (offsets) -> bitonic sort of (expert, pair) keys -> each sorted
    pair's row = its expert's padded start + its rank. MAX_BLOCKS is a constexpr bound of max_blocks.
    """
    _pdl_prologue(PDL)
    p = tl.arange(0, BLOCK_P)
    in_p = p < num_pairs
    local, valid = _local_expert(ids_ptr, expert_map_ptr, p, in_p, num_experts, NUM_LOCAL, HAS_MAP)
    tl.store(pair_expert_ptr + p, tl.where(valid, local, -1), mask=in_p)
    key = tl.where(valid, local, NUM_LOCAL)  # dropped pairs and lanes past P fall in bucket NUM_LOCAL
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e < NUM_LOCAL, tl.histogram(key, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    seg_start = tl.cumsum(counts, 0) - counts
    tl.store(expert_offsets_ptr + e, padded_start.to(tl.int64), mask=e <= NUM_LOCAL)
    tl.store(expert_counts_ptr + e, counts, mask=e < NUM_LOCAL)
    tl.store(seg_start_ptr + e, seg_start, mask=e <= NUM_LOCAL)
    tl.store(num_blocks_ptr, tl.sum(padded, 0) // BLOCK_M)
    # Padding rows hold P and blocks past the last hold NUM_LOCAL; real entries overwrite after the barrier.
    # FILL lanes, not BLOCK_P: a few pairs in 128-row blocks are hundreds of rows to fill (on an H200 this
    # loop at BLOCK_P = 4 lanes made the alignment 7.2 us of gpt-oss-120b's W4A8 layer at T = 1).
    LANES: tl.constexpr = FILL if FILL > BLOCK_P else BLOCK_P
    lanes = tl.arange(0, LANES)
    for r0 in range(0, MAX_BLOCKS * BLOCK_M, LANES):
        r = r0 + lanes
        tl.store(sorted_pairs_ptr + r, num_pairs, mask=r < max_blocks * BLOCK_M)
    for b0 in range(0, MAX_BLOCKS, LANES):
        b = b0 + lanes
        tl.store(block_expert_ptr + b, NUM_LOCAL, mask=b < max_blocks)
    tl.debug_barrier()
    first_block = padded_start // BLOCK_M
    end_block = padded_end // BLOCK_M
    for j in range(0, (BLOCK_P + BLOCK_M - 1) // BLOCK_M):  # expert e owns blocks [first_block, end_block)
        tl.store(block_expert_ptr + first_block + j, e, mask=(e < NUM_LOCAL) & (first_block + j < end_block))
    # Sort by (expert, pair): pairs of one expert stay in increasing pair order, as the torch path.
    order = tl.sort(key * BLOCK_P + p)
    s_expert = order // BLOCK_P
    keep = s_expert < NUM_LOCAL
    rank = p - tl.load(seg_start_ptr + s_expert, mask=keep, other=0)
    row = tl.load(expert_offsets_ptr + s_expert, mask=keep, other=0) + rank
    tl.store(sorted_pairs_ptr + row, order % BLOCK_P, mask=keep)


@triton.jit
def _align_count(
    ids_ptr,  # int32 [P] global expert ids
    expert_map_ptr,  # int32 [E] global -> local (-1 = another rank) or None
    pair_expert_ptr,  # out int32 [P]: local expert of each pair, -1 if dropped
    rank_ptr,  # out int32 [P]: rank of the pair among its chunk's pairs of the same expert
    chunk_counts_ptr,  # out int32 [num_chunks, BLOCK_E]: pairs of each expert in each chunk
    num_pairs,
    num_experts,
    NUM_LOCAL: tl.constexpr,
    HAS_MAP: tl.constexpr,
    SUB: tl.constexpr,  # pairs a step; a chunk is N_SUB steps
    N_SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PAIRWISE: tl.constexpr,  # a step's ranks from a [SUB, SUB] comparison instead of a [SUB, BLOCK_E] one-hot
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """Each pair's rank among its chunk's earlier pairs of the same expert, and the chunk's histogram.
    A step's ranks cost SUB x BLOCK_E (one-hot cumsum) or SUB x SUB (pairwise, for many experts)."""
    _pdl_prologue(PDL)
    chunk = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    i = tl.arange(0, SUB)
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)  # the chunk's pairs of each expert so far
    for step in range(N_SUB):
        p = (chunk * N_SUB + step) * SUB + i
        in_p = p < num_pairs
        local, kept = _local_expert(ids_ptr, expert_map_ptr, p, in_p, num_experts, NUM_LOCAL, HAS_MAP)
        tl.store(pair_expert_ptr + p, tl.where(kept, local, -1), mask=in_p)
        if PAIRWISE:
            same = (local[:, None] == local[None, :]) & kept[None, :] & (i[None, :] < i[:, None])
            expert = tl.where(kept, local, 0)  # an index in range for every pair; dropped ones masked
            rank = tl.where(kept, tl.gather(seen, expert, 0) + tl.sum(same.to(tl.int32), 1), 0)
            seen += tl.histogram(expert, BLOCK_E, mask=kept)
        else:
            onehot = ((local[:, None] == e[None, :]) & kept[:, None]).to(tl.int32)  # [SUB, BLOCK_E]
            earlier = seen[None, :] + tl.cumsum(onehot, 0) - onehot
            rank = tl.sum(earlier * onehot, 1)
            seen += tl.sum(onehot, 0)
        tl.store(rank_ptr + p, rank, mask=in_p)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + e, seen)


@triton.jit
def _align_scan(
    chunk_counts_ptr,  # in/out int32 [num_chunks, BLOCK_E]: counts in, each chunk's first rank out
    expert_counts_ptr,  # out int32 [NUM_LOCAL]
    num_chunks,
    NUM_LOCAL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EXPERTS: tl.constexpr,  # experts (columns) a program scans
    CHUNKS_BOUND: tl.constexpr,  # power of two >= num_chunks: the whole column in one tile
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """One program per EXPERTS experts: the exclusive cumsum of their histograms over the chunks, in one
    tile. One program walking the chunks tile by tile is a chain of dependent loads and scans (about
    25 us on an H200 at any P); the columns are independent."""
    _pdl_prologue(PDL)
    e = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    c = tl.arange(0, CHUNKS_BOUND)
    ptrs = chunk_counts_ptr + c[:, None] * BLOCK_E + e[None, :]
    in_c = (c < num_chunks)[:, None]
    tile = tl.load(ptrs, mask=in_c, other=0)
    tl.store(ptrs, tl.cumsum(tile, 0) - tile, mask=in_c)
    tl.store(expert_counts_ptr + e, tl.sum(tile, 0), mask=e < NUM_LOCAL)


@triton.jit
def _align_scatter(
    pair_expert_ptr,  # int32 [P]
    rank_ptr,  # int32 [P]
    chunk_first_ptr,  # int32 [num_chunks, BLOCK_E]: `_align_scan`'s first rank of each chunk; program c
    # adds the experts' padded offsets to row c, which no other program reads
    expert_counts_ptr,  # int32 [NUM_LOCAL]
    sorted_pairs_ptr,  # out int32 [max_blocks * BLOCK_M]: P on padding rows
    block_expert_ptr,  # out int32 [max_blocks]
    num_blocks_ptr,  # out int32 [1] (program 0)
    expert_offsets_ptr,  # out int64 [NUM_LOCAL + 1] (program 0)
    num_pairs,
    max_blocks,
    NUM_LOCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB: tl.constexpr,
    N_SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,  # program c also owns blocks [c, c + 1) * BLOCKS_PER_PROGRAM
    BLOCK_TILE: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    _pdl_prologue(PDL)
    chunk = tl.program_id(0)
    # The padded expert offsets from the counts: a cumsum over BLOCK_E, cheaper for every program to
    # compute than another launch.
    e = tl.arange(0, BLOCK_E)
    is_expert = e < NUM_LOCAL
    counts = tl.load(expert_counts_ptr + e, mask=is_expert, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    total = tl.sum(padded, 0)
    if chunk == 0:
        tl.store(expert_offsets_ptr + e, padded_start.to(tl.int64), mask=is_expert)
        tl.store(expert_offsets_ptr + NUM_LOCAL, total.to(tl.int64))
        tl.store(num_blocks_ptr, total // BLOCK_M)
    # A pair's row is its chunk's first row for its expert plus its rank: the offsets go into this
    # program's row of chunk_first once, so that each pair gathers one number. The barrier makes the
    # row's stores visible to every thread of the program before any reads it back.
    row_ptrs = chunk_first_ptr + chunk * BLOCK_E + e
    tl.store(row_ptrs, tl.load(row_ptrs) + padded_start)
    tl.debug_barrier()
    for step in range(N_SUB):
        p = (chunk * N_SUB + step) * SUB + tl.arange(0, SUB)
        local = tl.load(pair_expert_ptr + p, mask=p < num_pairs, other=-1)
        kept = local >= 0
        first = tl.load(chunk_first_ptr + chunk * BLOCK_E + local, mask=kept, other=0)
        rank = tl.load(rank_ptr + p, mask=kept, other=0)
        tl.store(sorted_pairs_ptr + first + rank, p, mask=kept)
    # This program's blocks: the owner of block b is the number of experts whose padded rows end at or
    # before its first row (NUM_LOCAL past the last block), as torch.searchsorted(padded_end, start,
    # right=True) in the torch path. Rows from the owner's last pair on are padding; past the last
    # block no expert owns the block and every row is.
    pad_start = padded_start + counts
    for b0 in range(0, BLOCKS_PER_PROGRAM, BLOCK_TILE):
        b = chunk * BLOCKS_PER_PROGRAM + b0 + tl.arange(0, BLOCK_TILE)
        before = (padded_end[None, :] <= (b * BLOCK_M)[:, None]) & is_expert[None, :]
        owner = tl.sum(before.to(tl.int32), 1)
        tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)
        mine = (e[None, :] == owner[:, None]) & is_expert[None, :]
        owner_pad = tl.sum(tl.where(mine, pad_start[None, :], 0), 1)  # 0 past the last block
        r = (b * BLOCK_M)[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_pairs_ptr + r, num_pairs, mask=(r >= owner_pad[:, None]) & (b < max_blocks)[:, None])


@triton.jit
def _split_tail_blocks(
    expert_offsets_ptr,  # int64 [NUM_LOCAL + 1]: padded start row of each expert (TAIL_M rows a block)
    expert_counts_ptr,  # int32 [NUM_LOCAL]
    big_start_ptr,  # out int32 [max_big]: first row of each 2 * TAIL_M block
    big_expert_ptr,  # out int32 [max_big]
    num_big_ptr,  # out int32 [1]
    tail_start_ptr,  # out int32 [NUM_LOCAL]: first row of each expert's odd last TAIL_M block
    tail_expert_ptr,  # out int32 [NUM_LOCAL]
    num_tail_ptr,  # out int32 [1]
    max_big,
    NUM_LOCAL: tl.constexpr,
    TAIL_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BIG_TILE: tl.constexpr,  # big blocks a program places
    HALF_LAST: tl.constexpr,  # an odd last block is a half-filled big block (no tail list: pointers None)
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """Expert e's nb = ceil(count / TAIL_M) blocks of an alignment at TAIL_M rows become nb // 2 blocks
    of 2 * TAIL_M rows and, when nb is odd, one tail block of TAIL_M rows: its last (with HALF_LAST,
    one more big block instead, starting there). Every program computes the per-expert sums (BLOCK_E
    wide) and places BIG_TILE big blocks; program 0 also writes the tails and the counts."""
    _pdl_prologue(PDL)
    e = tl.arange(0, BLOCK_E)
    is_expert = e < NUM_LOCAL
    offset = tl.load(expert_offsets_ptr + e, mask=is_expert, other=0).to(tl.int32)
    count = tl.load(expert_counts_ptr + e, mask=is_expert, other=0)
    blocks = (count + TAIL_M - 1) // TAIL_M
    if HALF_LAST:
        pairs = (blocks + 1) // 2
    else:
        pairs = blocks // 2
    big_end = tl.cumsum(pairs, 0)  # big block i belongs to the first expert whose big_end exceeds i
    if tl.program_id(0) == 0:
        tl.store(num_big_ptr, tl.sum(pairs, 0))
        if not HALF_LAST:
            has_tail = (blocks % 2 == 1) & is_expert
            tail_index = tl.cumsum(has_tail.to(tl.int32), 0) - 1
            tl.store(tail_start_ptr + tail_index, offset + (blocks - 1) * TAIL_M, mask=has_tail)
            tl.store(tail_expert_ptr + tail_index, e, mask=has_tail)
            tl.store(num_tail_ptr, tl.sum(has_tail.to(tl.int32), 0))
    big_begin = big_end - pairs
    i = tl.program_id(0) * BIG_TILE + tl.arange(0, BIG_TILE)
    owner = tl.sum(((big_end[None, :] <= i[:, None]) & is_expert[None, :]).to(tl.int32), 1)
    mine = e[None, :] == owner[:, None]  # [BIG_TILE, BLOCK_E]: one column per row, none past the last
    first = tl.sum(tl.where(mine, (offset - big_begin * 2 * TAIL_M)[None, :], 0), 1)
    live = (i < max_big) & (owner < NUM_LOCAL)
    tl.store(big_start_ptr + i, first + i * 2 * TAIL_M, mask=live)
    tl.store(big_expert_ptr + i, owner, mask=live)


@triton.jit
def _pair_rows(
    sorted_pairs_ptr,  # int32 [max_blocks * BLOCK_M]
    num_blocks_ptr,  # int32 [1]
    pair_rows_ptr,  # out int32 [P]: the sorted row of each kept pair (dropped pairs are not written)
    num_pairs,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel first (`_pdl_prologue`)
):
    """The inverse of `sorted_pair_ids` over the valid M-blocks: one program per block."""
    _pdl_prologue(PDL)
    block = tl.program_id(0)
    if block >= tl.load(num_blocks_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    tl.store(pair_rows_ptr + pairs, rows, mask=pairs < num_pairs)
