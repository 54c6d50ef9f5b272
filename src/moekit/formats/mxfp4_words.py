"""MXFP4 codes rearranged into 32-bit words that decode straight into Hopper MMA operand registers.

Data flow: checkpoint blocks uint8 [..., N, G, 16] (two E2M1 codes a byte, low nibble first)
-> `pack_mma_words` (once, at load time) -> int32 words [..., N/16, S, 8, 4, 8], S = ceil(2G / 8)
-> the Triton kernel loads 16 bytes (four words) per thread and turns each word into four bf16 pairs
   with about one rotation and one mask per pair; `unpack_mma_words` is the exact inverse.

Runs: the 16-column chunks of a 16-row block come in runs of 8 (128 columns), each run the 32 lanes'
8 words one after the other (1 KiB), the last run padded with zero words. A K-step of 128 columns then
reads one contiguous KiB per 16-row block, every lane one whole 32-byte sector; lane-major rows of
2G words (720 bytes for K = 2880) leave half the lanes straddling two sectors (measured on an H200:
an L2 hit rate of 48 % from those re-read sectors).

Why this arrangement: a Hopper warpgroup MMA (wgmma m64nNk16, bf16) takes its A operand from
registers. Lane (g, q) of a warp (g = lane // 4, q = lane % 4) holds, for each 16-row block and each
16-column chunk c, the elements (rows g and g + 8) x (columns 2q, 2q + 1, 2q + 8, 2q + 9): eight codes,
exactly one word here. Word [rb, g, q, c] holds eight codes, in slots:

    slot j:   0         1           2             3               4 .. 7
    element:  (r, k)    (r + 8, k)  (r, k + 8)    (r + 8, k + 8)  the same with k + 1

with r = 16 rb + g and k = 16 c + 2q (word [rb, c // 8, g, q, c % 8] of the stored tensor). Slots p
and p + 4 form pair p: the low and the high bf16 half of the p-th A register.

Bit placement: a decoded pair needs, in each 16-bit half, the E2M1 magnitude bits (mantissa m, exponent
e0 e1) at bf16 bits 6, 7, 8 and the sign at bit 15 (`PAIR_MASK`). Pair p's code bits are stored so that
rotating the word right by the rotations `PAIR_ROTATIONS[p]` puts them there: pairs 0 - 2 decode with
one rotation and one mask, pair 3 (whose bits fill what the other three leave) with two rotations, one
for its exponent and sign and one for its mantissa. No placement lets all four pairs use one rotation
each (an exhaustive search: at most three rotations of the pattern are disjoint), so this is the
cheapest: 4 rotations, 5 masks and 4 bf16x2 multiplies a word, where contiguous nibbles took two
shifts and two masks a pair.

Decoding (`_mxfp4_word_pair` in `moekit/kernels/triton/_details/mxfp4.py`): the E2M1 magnitude bits
(exponent e, mantissa m) at bf16 bits 8..6 and the sign at bit 15 read as the bf16 number value * 2^-126
exactly (e = 0, m = 1, the code 0.5, lands on the bf16 subnormal 2^-127); multiplying by 2^(s - 1)
applies the E8M0 scale 2^(s - 127) and the missing 2^126 in one step. 2^(s - 1) is a normal bf16 only
for s <= 128, so weights with a larger scale byte (a block maximum above 12) keep the checkpoint packing
(`scales_reason`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.errors import DTypeError, ShapeError

ROWS_PER_BLOCK = 16  # rows of one MMA A-fragment block
COLS_PER_CHUNK = 16  # columns (elements) per MMA k-step
CHUNKS_PER_RUN = 8  # 16-column chunks stored together: one run is 32 lanes x 8 words = 1 KiB
MAX_SCALE_BYTE = 128  # largest E8M0 byte whose combined factor 2^(s - 1) is a normal bf16 / fp32

# bf16 bit of E2M1 code bit 0 (mantissa), 1 and 2 (exponent), 3 (sign), in the low half of a pair.
_TARGET_BITS = (6, 7, 8, 15)
PAIR_MASK = 0x81C081C0  # the target bits of both halves
MANTISSA_MASK = 0x00400040
# (right rotation of the word that places pair p's exponent and sign bits, the one for its mantissa):
# the same rotation for pairs 0 - 2.
PAIR_ROTATIONS = ((0, 0), (4, 4), (10, 10), (6, 14))


def _bit_positions() -> tuple[tuple[int, ...], ...]:
    """Word bit of code bit b of slot j: rotating right by r moves bit (t + r) mod 32 to bit t."""
    positions = tuple(
        tuple(
            (t + 16 * (j // 4) + PAIR_ROTATIONS[j % 4][1 if b == 0 else 0]) % 32
            for b, t in enumerate(_TARGET_BITS)
        )
        for j in range(8)
    )
    assert sorted(sum(positions, ())) == list(range(32)), positions  # every bit holds one code bit
    return positions


BIT_POSITIONS = _bit_positions()

# Slot j of a word holds element (row offset, column offset) of the (g, q) lane's 16x16 fragment, in
# units of (8 rows, 8 columns) and (-, 1 column): slot -> (row_half, col_half, odd_column).
_SLOTS = tuple((j % 4 % 2, j % 4 // 2, j // 4) for j in range(8))


def rows_reason(n_rows: int) -> str | None:
    """None if a matrix of `n_rows` rows can use the word packing, else why not (a shape fact)."""
    if n_rows % ROWS_PER_BLOCK:
        return f"rows ({n_rows}) must be a multiple of {ROWS_PER_BLOCK}"
    return None


def layer_rows_reason(*, intermediate: int, hidden: int) -> str | None:
    """None if a layer's weight tiles all start on 16-row blocks of the word packing, else why not: w2's
    H rows, and each half of w13 (I rows: with CONCAT rows the up half starts at row I, and a tile
    starting inside a block would decode another block's rows)."""
    for name, rows in (("w13 (each gate/up half of I rows)", intermediate), ("w2", hidden)):
        reason = rows_reason(rows)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def scales_reason(scales: Tensor) -> str | None:
    """None if every E8M0 byte of `scales` is one the word decode applies exactly, else why not (a data
    fact). Reads every scale byte (a host sync): call once at load time."""
    if scales.numel() and int(scales.max()) > MAX_SCALE_BYTE:
        return f"a scale byte is {int(scales.max())} > {MAX_SCALE_BYTE} (a block maximum above 12)"
    return None


def fits_mma_words(n_rows: int, scales: Tensor) -> str | None:
    """None if a matrix of `n_rows` rows with these E8M0 `scales` can use the word packing, else why not."""
    return rows_reason(n_rows) or scales_reason(scales)


def _check_blocks(blocks: Tensor) -> None:
    if not isinstance(blocks, Tensor) or blocks.dtype != torch.uint8:
        got = blocks.dtype if isinstance(blocks, Tensor) else type(blocks).__name__
        raise DTypeError(f"MXFP4 blocks must be uint8 [..., N, G, 16], got {got}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16:
        raise ShapeError(f"MXFP4 blocks must be [..., N, G, 16], got {list(blocks.shape)}")
    if blocks.shape[-3] % ROWS_PER_BLOCK:
        raise ShapeError(f"the word packing needs N % {ROWS_PER_BLOCK} == 0, got N = {blocks.shape[-3]}")


def num_runs(num_groups: int) -> int:
    """Runs of CHUNKS_PER_RUN chunks that hold a row of `num_groups` 32-element groups."""
    return -(-2 * num_groups // CHUNKS_PER_RUN)


# Input bytes packed at a time: the packing's int64 intermediates take about 22x its input, so a layer's
# experts are packed a slice at a time (an E 256 / H 7168 / I 2048 layer's 5.6 GB of codes would otherwise
# need about 120 GB on the device at once).
PACK_CHUNK_BYTES = 32 << 20


def pack_mma_words(blocks: Tensor) -> Tensor:
    """Checkpoint blocks uint8 [..., N, G, 16] -> int32 words [..., N/16, S, 8, 4, 8] (see module doc),
    `PACK_CHUNK_BYTES` of blocks at a time along the leading (expert) dimensions."""
    _check_blocks(blocks)
    *lead, n, g, _ = blocks.shape
    if not lead:
        return _pack_mma_words(blocks)
    flat = blocks.reshape(-1, n, g, 16)
    per_chunk = max(1, PACK_CHUNK_BYTES // (n * g * 16))
    first = _pack_mma_words(flat[:per_chunk])
    if per_chunk >= flat.shape[0]:
        return first.reshape(*lead, *first.shape[1:])
    words = torch.empty((flat.shape[0], *first.shape[1:]), dtype=first.dtype, device=first.device)
    words[:per_chunk] = first
    for start in range(per_chunk, flat.shape[0], per_chunk):
        words[start : start + per_chunk] = _pack_mma_words(flat[start : start + per_chunk])
    return words.reshape(*lead, *words.shape[1:])


def _pack_mma_words(blocks: Tensor) -> Tensor:
    """`pack_mma_words` of all of `blocks` at once."""
    *lead, n, g, _ = blocks.shape
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).reshape(*lead, n, 2 * g, 16)  # [.., N, C, 16]
    # [.., rb, row_half, g8, C, col_half, q, odd]
    codes = codes.reshape(*lead, n // 16, 2, 8, 2 * g, 2, 4, 2).to(torch.int64)
    b = len(lead)
    word = torch.zeros(*lead, n // 16, 8, 4, 2 * g, dtype=torch.int64, device=blocks.device)
    code = torch.arange(16, device=blocks.device)
    for slot, (row_half, col_half, odd) in enumerate(_SLOTS):
        part = codes.select(b + 6, odd).select(b + 4, col_half).select(b + 1, row_half)  # [.., rb, g8, C, q]
        bits = sum(((code >> i) & 1) << p for i, p in enumerate(BIT_POSITIONS[slot]))  # code -> word bits
        word |= bits[part.transpose(-1, -2)]
    word = (word - ((word >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int
    runs = num_runs(g)
    word = torch.nn.functional.pad(word, (0, runs * CHUNKS_PER_RUN - 2 * g))  # zero words: code 0
    word = word.reshape(*lead, n // 16, 8, 4, runs, CHUNKS_PER_RUN)
    return word.movedim(-2, -4).contiguous()  # [.., rb, run, g8, q, chunk in run]


def unpack_mma_words(words: Tensor, *, num_groups: int) -> Tensor:
    """The exact inverse of `pack_mma_words`: int32 [..., N/16, S, 8, 4, 8] -> uint8 [..., N, G, 16]
    with G = `num_groups` (the padding words of the last run are dropped)."""
    if not isinstance(words, Tensor) or words.dtype != torch.int32 or words.dim() < 5:
        raise ShapeError(
            f"MXFP4 words must be int32 [..., N/16, S, 8, 4, 8], got {getattr(words, 'shape', words)}"
        )
    if tuple(words.shape[-4:]) != (num_runs(num_groups), 8, 4, CHUNKS_PER_RUN):
        raise ShapeError(
            f"MXFP4 words of {num_groups} groups must end in [{num_runs(num_groups)}, 8, 4, "
            f"{CHUNKS_PER_RUN}], got {list(words.shape)}"
        )
    *lead, nb, runs, _, _, _ = words.shape
    c = 2 * num_groups
    w = words.movedim(-4, -2).reshape(*lead, nb, 8, 4, runs * CHUNKS_PER_RUN)[..., :c]
    w = w.to(torch.int64) & 0xFFFFFFFF
    b = len(lead)
    codes = torch.zeros(*lead, nb, 2, 8, c, 2, 4, 2, dtype=torch.int64, device=words.device)
    for slot, (row_half, col_half, odd) in enumerate(_SLOTS):
        part = sum(((w >> p) & 1) << i for i, p in enumerate(BIT_POSITIONS[slot])).transpose(-1, -2)
        codes.select(b + 6, odd).select(b + 4, col_half).select(b + 1, row_half).copy_(part)
    codes = codes.reshape(*lead, nb * 16, c // 2, 16, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
