"""The E2M1 -> E4M3 byte-permute table of `w4a8_lut_probe.py`, in plain Python: the word layout
(`pack_words`), the two table words of a group (`lut_words`), a model of PTX prmt.b32 and the decode of one
word, `check`, which compares the decode with exact arithmetic, and the probes' random weights and their
dequantization. No GPU and no Triton needed.

A word holds 8 codes packed offline so that one prmt turns 4 codes into 4 E4M3 bytes through an 8-byte
table: E2M1 value times 2^(6 - d), d = the weight row's largest scale over the K-step minus the group's.
The table of a group is two integer multiply-adds of d; a code's sign is a bit already in its output
byte's place. It is exact for d <= 11 (the smallest magnitude, 0.5 * 2^(6 - d), is then still an E4M3
normal).

Usage: python3 tools/w4a8_lut.py   # exits 1 on any mismatch
"""

from __future__ import annotations

import torch

from moekit.formats.mxfp4_w4a8 import LUT_HI as _LUT_HI
from moekit.formats.mxfp4_w4a8 import LUT_LO as _LUT_LO
from moekit.formats.mxfp4_w4a8 import MAX_EXACT_DROP, SIGNS_INT32, _pack_words
from moekit.formats.mxfp4_w4a8 import SIGNS as _SIGNS
from moekit.formats.mxfp4_w4a8 import STEP_HI as _STEP_HI
from moekit.formats.mxfp4_w4a8 import STEP_LO as _STEP_LO

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_SIGNS_INT32 = SIGNS_INT32


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [N, K] (K % 8 == 0) -> int32 words [N, K / 8] (`mxfp4_w4a8`'s bit placement)."""
    return _pack_words(codes.reshape(codes.shape[0], -1, 8))


def dequantize(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of uint8 E2M1 codes [N, K] and E8M0 bytes [N, K / 32]: E2M1 value times 2^(s - 127)."""
    w = torch.tensor(E2M1)[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    return w * torch.pow(2.0, scale_bytes.float() - 127).repeat_interleave(32, dim=1)


def random_mxfp4(n: int, k: int, generator: torch.Generator | None = None):
    """Random codes [N, K] and scale bytes [N, K / 32] drawn within 10 binades (118 - 127), so that no group
    is flushed at a 4- or 8-group reference."""
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale_bytes = torch.randint(118, 128, (n, k // 32), generator=generator, dtype=torch.uint8)
    return codes, scale_bytes


def lut_words(d: int) -> tuple[int, int]:
    """The two table words (bytes 0-3, 4-7) of a group d binades below its row's largest."""
    return (_LUT_LO - d * _STEP_LO) & 0xFFFFFFFF, (_LUT_HI - d * _STEP_HI) & 0xFFFFFFFF


def prmt(lo: int, hi: int, selector: int) -> int:
    """PTX prmt.b32 in its default mode: byte i of the result is byte (selector nibble i) of hi:lo, the
    byte's sign replicated when the nibble's bit 3 is set."""
    source = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def decode_word(word: int, d: int) -> list[int]:
    """The kernel's decode of one word (uint32 bits) into 8 E4M3 bytes, in K order."""
    lo, hi = lut_words(d)
    first = prmt(lo, hi, word & 0x7777) | (word & _SIGNS)
    second = prmt(lo, hi, (word >> 16) & 0x7777) | ((word << 4) & _SIGNS)
    return [(first >> (8 * i)) & 0xFF for i in range(4)] + [(second >> (8 * i)) & 0xFF for i in range(4)]


def check(words: int = 20000, seed: int = 0) -> int:
    """Mismatches of `decode_word` against E2M1 * 2^(6 - d): every code at every exact d, then random
    words of 8 codes."""
    generator = torch.Generator().manual_seed(seed)
    cases = [
        (torch.full((8,), code, dtype=torch.uint8), d)
        for d in range(MAX_EXACT_DROP + 1)
        for code in range(16)
    ]
    random_codes = torch.randint(0, 16, (words, 8), generator=generator, dtype=torch.uint8)
    random_drops = torch.randint(0, MAX_EXACT_DROP + 1, (words,), generator=generator)
    cases += list(zip(random_codes, random_drops.tolist(), strict=True))
    bad = 0
    for codes, d in cases:
        word = int(pack_words(codes[None, :])[0, 0]) & 0xFFFFFFFF
        got = torch.tensor(decode_word(word, d), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        want = torch.tensor([E2M1[int(c) & 7] * 2.0 ** (6 - d) * (-1 if int(c) & 8 else 1) for c in codes])
        same_sign = torch.equal(torch.signbit(got), (codes & 8).bool())
        bad += int(not (torch.equal(got, want) and same_sign))
    return bad


if __name__ == "__main__":
    mismatches = check()
    print(f"mismatches: {mismatches}")
    raise SystemExit(1 if mismatches else 0)
