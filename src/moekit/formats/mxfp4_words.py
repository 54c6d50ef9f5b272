"""MXFP4 codes rearranged into 32-bit words that decode straight into Hopper MMA operand registers.

Data flow: checkpoint blocks uint8 [..., N, G, 16] (two E2M1 codes a byte, low nibble first)
-> `pack_mma_words` (once, at load time) -> int32 words [..., N/16, 8, 4, 2G]
-> the Triton kernel loads 16 bytes (four words) per thread and turns each word into four bf16 pairs
   with 11 shift / mask operations; `unpack_mma_words` is the exact inverse.

Why this arrangement: a Hopper warpgroup MMA (wgmma m64nNk16, bf16) takes its A operand from
registers. Lane (g, q) of a warp (g = lane // 4, q = lane % 4) holds, for each 16-row block and each
16-column chunk c, the elements (rows g and g + 8) x (columns 2q, 2q + 1, 2q + 8, 2q + 9): eight codes,
exactly one word here, as four pairs p = row_half + 2 * col_half (row r + 8 * row_half, columns
k + 8 * col_half and the next one; r = 16 rb + g, k = 16 c + 2q). A pair becomes one bf16x2 register: its
two codes' magnitude bits (3 each) land on bf16 bits 8..6 and 24..22 and their signs on 15 and 31 with
one shift for the magnitudes and one for the signs (`DECODE_SHIFTS`); the four pairs' stored bits tile
the 32-bit word, so decoding a word takes 11 shift / mask operations.

Decoding (see `_jit._mxfp4_word_pair`): the E2M1 magnitude bits (exponent e, mantissa m) moved to bf16
bits 8..6 and the sign to bit 15 read as the bf16 number value * 2^-126 exactly (e = 0, m = 1, the
code 0.5, lands on the bf16 subnormal 2^-127); multiplying by 2^(s - 1) applies the E8M0 scale 2^(s -
127) and the missing 2^126 in one step. 2^(s - 1) is a normal bf16 only for s <= 128, so weights with
a larger scale byte (a block maximum above 12) keep the checkpoint packing (`fits_mma_words`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.errors import DTypeError, ShapeError

ROWS_PER_BLOCK = 16  # rows of one MMA A-fragment block
COLS_PER_CHUNK = 16  # columns (elements) per MMA k-step
MAX_SCALE_BYTE = 128  # largest E8M0 byte whose combined factor 2^(s - 1) is a normal bf16 / fp32

# Pair p of a word (p = row_half + 2 * col_half) holds the codes of columns k and k + 1; the kernel
# moves its magnitude bits with one shift and its sign bits with another (`DECODE_SHIFTS`, left shifts,
# negative = right) into bf16 bits 8..6 / 24..22 and 15 / 31. Stored bit = target bit - shift; the four
# pairs tile all 32 bits, and pairs 0 and 1 share one shift for both parts (1 and 2 operations).
DECODE_SHIFTS = ((0, 0), (3, 3), (-3, 1), (6, 2))  # (magnitude, sign) per pair
_MAG_TARGET = (6, 22)  # lowest magnitude bit of the even / odd column's bf16 half
_SIGN_TARGET = (15, 31)


def fits_mma_words(n_rows: int, scales: Tensor) -> str | None:
    """None if a matrix of `n_rows` rows with these E8M0 `scales` can use the word packing, else why not.

    Reads every scale byte (a host sync): call once at load time."""
    if n_rows % ROWS_PER_BLOCK:
        return f"rows ({n_rows}) must be a multiple of {ROWS_PER_BLOCK}"
    if scales.numel() and int(scales.max()) > MAX_SCALE_BYTE:
        return f"a scale byte is {int(scales.max())} > {MAX_SCALE_BYTE} (a block maximum above 12)"
    return None


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
    for pair, (mag_shift, sign_shift) in enumerate(DECODE_SHIFTS):
        for odd in (0, 1):
            part = codes.select(b + 6, odd).select(b + 4, pair // 2).select(b + 1, pair % 2)
            part = part.transpose(-1, -2)  # [.., rb, g8, C, q] -> [.., rb, g8, q, C]
            word |= (part & 7) << (_MAG_TARGET[odd] - mag_shift)
            word |= (part >> 3) << (_SIGN_TARGET[odd] - sign_shift)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int


def unpack_mma_words(words: Tensor) -> Tensor:
    """The exact inverse of `pack_mma_words`: int32 [..., N/16, 8, 4, C] -> uint8 [..., N, C/2, 16]."""
    if not isinstance(words, Tensor) or words.dtype != torch.int32 or words.dim() < 4:
        got = getattr(words, "shape", words)
        raise ShapeError(f"MXFP4 words must be int32 [..., N/16, 8, 4, C], got {got}")
    *lead, nb, _, _, c = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    b = len(lead)
    codes = torch.zeros(*lead, nb, 2, 8, c, 2, 4, 2, dtype=torch.int64, device=words.device)
    for pair, (mag_shift, sign_shift) in enumerate(DECODE_SHIFTS):
        for odd in (0, 1):
            mag = (w >> (_MAG_TARGET[odd] - mag_shift)) & 7
            sign = (w >> (_SIGN_TARGET[odd] - sign_shift)) & 1
            part = (mag | (sign << 3)).transpose(-1, -2)  # [.., rb, g8, C, q]
            codes.select(b + 6, odd).select(b + 4, pair // 2).select(b + 1, pair % 2).copy_(part)
    codes = codes.reshape(*lead, nb * 16, c // 2, 16, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
