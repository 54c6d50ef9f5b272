"""MXFP4 codes rearranged into 32-bit words that decode straight into Hopper MMA operand registers.

Data flow: checkpoint blocks uint8 [..., N, G, 16] (two E2M1 codes a byte, low nibble first)
-> `pack_mma_words` (once, at load time) -> int32 words [..., N/16, 8, 4, 2G]
-> the Triton kernel loads 16 bytes (four words) per thread and turns each word into four bf16 pairs
   with two shifts and two masks per pair; `unpack_mma_words` is the exact inverse.

Why this arrangement: a Hopper warpgroup MMA (wgmma m64nNk16, bf16) takes its A operand from
registers. Lane (g, q) of a warp (g = lane // 4, q = lane % 4) holds, for each 16-row block and each
16-column chunk c, the elements (rows g and g + 8) x (columns 2q, 2q + 1, 2q + 8, 2q + 9): eight codes,
exactly one word here. Word [rb, g, q, c] holds, nibble by nibble (bits 4j .. 4j + 3):

    slot j:   0         1           2             3               4 .. 7
    element:  (r, k)    (r + 8, k)  (r, k + 8)    (r + 8, k + 8)  the same with k + 1

with r = 16 rb + g and k = 16 c + 2q. Slots j and j + 4 sit 16 bits apart, so one shift moves both
codes of a pair into the two bf16 halves of a register at once.

Decoding (see `_jit._mxfp4_word_pair`): the E2M1 magnitude bits (exponent e, mantissa m) moved to bf16
bits 8..6 and the sign to bit 15 read as the bf16 number value * 2^-126 exactly (e = 0, m = 1, the
code 0.5, lands on the bf16 subnormal 2^-127); multiplying by 2^(s - 1) applies the E8M0 scale 2^(s -
127) and the missing 2^126 in one step. 2^(s - 1) is a normal bf16 only for s <= 128, so weights with
a larger scale byte (a block maximum above 12) keep the checkpoint packing (`scales_reason`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.errors import DTypeError, ShapeError

ROWS_PER_BLOCK = 16  # rows of one MMA A-fragment block
COLS_PER_CHUNK = 16  # columns (elements) per MMA k-step
MAX_SCALE_BYTE = 128  # largest E8M0 byte whose combined factor 2^(s - 1) is a normal bf16 / fp32

# Slot j of a word holds element (row offset, column offset) of the (g, q) lane's 16x16 fragment, in
# units of (8 rows, 8 columns) and (-, 1 column): slot -> (row_half, col_half, odd_column).
_SLOTS = tuple((j % 4 % 2, j % 4 // 2, j // 4) for j in range(8))


def rows_reason(n_rows: int) -> str | None:
    """None if a matrix of `n_rows` rows can use the word packing, else why not (a shape fact)."""
    if n_rows % ROWS_PER_BLOCK:
        return f"rows ({n_rows}) must be a multiple of {ROWS_PER_BLOCK}"
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


def pack_mma_words(blocks: Tensor) -> Tensor:
    """Checkpoint blocks uint8 [..., N, G, 16] -> int32 words [..., N/16, 8, 4, 2G] (see module doc)."""
    _check_blocks(blocks)
    *lead, n, g, _ = blocks.shape
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).reshape(*lead, n, 2 * g, 16)  # [.., N, C, 16]
    # [.., rb, row_half, g8, C, col_half, q, odd]
    codes = codes.reshape(*lead, n // 16, 2, 8, 2 * g, 2, 4, 2).to(torch.int64)
    b = len(lead)
    word = torch.zeros(*lead, n // 16, 8, 4, 2 * g, dtype=torch.int64, device=blocks.device)
    for slot, (row_half, col_half, odd) in enumerate(_SLOTS):
        part = codes.select(b + 6, odd).select(b + 4, col_half).select(b + 1, row_half)  # [.., rb, g8, C, q]
        word |= part.transpose(-1, -2) << (4 * slot)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int


def unpack_mma_words(words: Tensor) -> Tensor:
    """The exact inverse of `pack_mma_words`: int32 [..., N/16, 8, 4, C] -> uint8 [..., N, C/2, 16]."""
    if not isinstance(words, Tensor) or words.dtype != torch.int32 or words.dim() < 4:
        raise ShapeError(
            f"MXFP4 words must be int32 [..., N/16, 8, 4, C], got {getattr(words, 'shape', words)}"
        )
    *lead, nb, _, _, c = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    b = len(lead)
    codes = torch.zeros(*lead, nb, 2, 8, c, 2, 4, 2, dtype=torch.int64, device=words.device)
    for slot, (row_half, col_half, odd) in enumerate(_SLOTS):
        part = ((w >> (4 * slot)) & 0xF).transpose(-1, -2)  # [.., rb, g8, C, q]
        codes.select(b + 6, odd).select(b + 4, col_half).select(b + 1, row_half).copy_(part)
    codes = codes.reshape(*lead, nb * 16, c // 2, 16, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
