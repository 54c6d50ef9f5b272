"""MXFP4 weights packed for W4A8 on FP8 tensor cores: each weight code decodes into one E4M3 byte of the
wgmma's register-A fragment through one byte permute (prmt) of an 8-byte table.

Data flow: checkpoint blocks uint8 [E, N, G, 16] (two E2M1 codes a byte, low nibble first) and E8M0 scales
[E, N, G] -> `pack_w4a8` (once, at load time) -> words int32 [E, N' / 16, S, 32, 8] and drops int32
[E, N', S + R] -> the WGMMA_W4A8 engine's kernels; `unpack_w4a8` gives the checkpoint bytes back (the
weights the kernels compute with: flushed groups' codes are zero).

- N' is N padded to whole programs of `PROGRAM_ROWS` rows, S the 128-column K-steps (K padded with zero
  codes), R = ceil(S / 2) references: a reference is the largest scale byte s_ref of a row over two K-steps
  (8 groups). The kernel multiplies both steps' codes as E2M1 * 2^(6 - d) in E4M3, d = s_ref - the group's
  byte (its drop), sums both wgmmas in the tensor cores, and promotes the pair into fp32 times the row's
  2^(s_ref - 133) = 2^(s_ref - 127) / 2^6.
- The table is exact for d <= `MAX_EXACT_DROP` (0.5 * 2^(6 - 11) is still an E4M3 normal). A group further
  below its reference is flushed: its codes are stored as zeros. Such a group holds values below
  2^-11 of the largest of the 256 columns around it, which rounds them away in an fp32 sum of those
  columns only partly: `flushed_groups` counts them, the layer says how many at load.
- drops[e, n, t] holds the 4 drops of step t's groups (byte c: group 4 t + c); drops[e, n, S + r] the fp32
  bits of reference r's 2^(s_ref - 133).
- Words: row block rb (16 rows), step t, lane l = 4 g + q and slot j = 2 c + h: the word holds row
  16 rb + 8 h + g's codes at columns 128 t + 32 c + 4 q + (0..3) and + 16 + (0..3), which is exactly what
  lane l's FP8 A-fragment registers hold of group c (rows g and g + 8, a k-half each). In a word the
  magnitudes of its first 4 codes sit at bits 4 i .. 4 i + 2 and of its last 4 at 16 + 4 i; the sign of
  code i < 4 at bit 8 i + 7 and of code 4 + i at bit 8 i + 3, so that each sign is already in place in its
  output byte (one AND and one OR a word put them there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.errors import ShapeError

MAX_EXACT_DROP = 11  # binades below the reference a group decodes exactly
STEP_K = 128  # columns of a K-step: four MX groups
STEPS_PER_REFERENCE = 2
PROGRAM_ROWS = 128  # weight rows a program of the kernels: N is padded to whole programs
_GROUPS_PER_STEP = STEP_K // 32
# The 8-byte table at d = 0: E4M3 bytes of the magnitudes 0, 0.5 .. 6 times 2^6, low word bytes 0 - 3;
# each binade of d lowers every nonzero byte's exponent by one (0x08), code 0 stays 0.
LUT_LO, LUT_HI = 0x6C686000, 0x7C787470
STEP_LO, STEP_HI = 0x08080800, 0x08080808
SIGNS = 0x80808080
SIGNS_INT32 = SIGNS - (1 << 32)  # the same bits as a signed 32-bit word (the kernel's int32)


def steps(k: int) -> int:
    """128-column K-steps of a K of `k` columns."""
    return -(-k // STEP_K)


def references(k: int) -> int:
    return -(-steps(k) // STEPS_PER_REFERENCE)


def padded_rows(n: int) -> int:
    return -(-n // PROGRAM_ROWS) * PROGRAM_ROWS


def _codes(blocks: Tensor) -> Tensor:
    """uint8 [..., N, G, 16] -> codes uint8 [..., N, 32 G] (low nibble first)."""
    lo, hi = blocks & 0xF, blocks >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def _pack_words(codes: Tensor) -> Tensor:
    """uint8 codes [..., 8] -> int32 words [...] (the bit placement of the module docstring)."""
    c = codes.to(torch.int64)
    magnitude, sign = c & 7, c >> 3
    w = torch.zeros(c.shape[:-1], dtype=torch.int64, device=c.device)
    for i in range(4):
        w |= magnitude[..., i] << (4 * i)
        w |= magnitude[..., 4 + i] << (16 + 4 * i)
        w |= sign[..., i] << (8 * i + 7)
        w |= sign[..., 4 + i] << (8 * i + 3)
    return (w - ((w >> 31) << 32)).to(torch.int32)


def _unpack_words(words: Tensor) -> Tensor:
    """The inverse of `_pack_words`: int32 [...] -> uint8 codes [..., 8]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = []
    for i in range(8):
        magnitude = (w >> (4 * i if i < 4 else 16 + 4 * (i - 4))) & 7
        sign = (w >> (8 * i + 7 if i < 4 else 8 * (i - 4) + 3)) & 1
        codes.append(magnitude | (sign << 3))
    return torch.stack(codes, dim=-1).to(torch.uint8)


def _fragment_order(codes: Tensor) -> Tensor:
    """codes [N, K] (N % 16 == 0, K % 128 == 0) -> [N / 16, K / 128, 32, 8, 8]: row block, step, lane,
    slot, the word's 8 codes in K order."""
    n, k = codes.shape
    c = codes.reshape(n // 16, 2, 8, k // STEP_K, 4, 2, 4, 4)  # rb, h, g, t, c, kh, q, byte
    return c.permute(0, 3, 2, 6, 4, 1, 5, 7).reshape(n // 16, k // STEP_K, 32, 8, 8)  # rb t g q c h kh byte


def _from_fragment_order(codes: Tensor) -> Tensor:
    """The inverse of `_fragment_order`: [N / 16, S, 32, 8, 8] -> [N, 128 S]."""
    rbs, s = codes.shape[:2]
    c = codes.reshape(rbs, s, 8, 4, 4, 2, 2, 4)  # rb t g q c h kh byte
    return c.permute(0, 5, 2, 1, 4, 6, 3, 7).reshape(16 * rbs, STEP_K * s)


def _drops(scale_bytes: Tensor) -> tuple[Tensor, Tensor]:
    """E8M0 bytes [N, 4 S] -> (drops int32 [N, 4 S] below each group's reference, reference bytes
    int32 [N, R])."""
    n, groups = scale_bytes.shape
    per_reference = _GROUPS_PER_STEP * STEPS_PER_REFERENCE
    r = -(-groups // per_reference)
    s = torch.nn.functional.pad(scale_bytes.to(torch.int32), (0, r * per_reference - groups))
    s_ref = s.reshape(n, r, per_reference).amax(dim=-1)
    drops = s_ref.repeat_interleave(per_reference, dim=1)[:, :groups] - s[:, :groups]
    return drops, s_ref


def pack_w4a8(blocks: Tensor, scales: Tensor, *, in_dim: int) -> tuple[Tensor, Tensor]:
    """Checkpoint MXFP4 (blocks uint8 [E, N, G, 16], scales uint8 [E, N, G], K = `in_dim` <= 32 G) ->
    (words, drops) of the module docstring. One expert at a time, on the tensors' device."""
    if blocks.dim() != 4 or scales.shape != blocks.shape[:3]:
        raise ShapeError(
            f"pack_w4a8 needs blocks [E, N, G, 16] and scales [E, N, G], got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    e, n, g, _ = blocks.shape
    n_pad, s_count = padded_rows(n), steps(in_dim)
    k_pad = s_count * STEP_K
    words = torch.empty((e, n_pad // 16, s_count, 32, 8), dtype=torch.int32, device=blocks.device)
    drops = torch.empty((e, n_pad, s_count + references(in_dim)), dtype=torch.int32, device=blocks.device)
    for expert in range(e):
        codes = _codes(blocks[expert])[:, :in_dim]  # codes past in_dim are the checkpoint's padding
        codes = torch.nn.functional.pad(codes, (0, k_pad - in_dim, 0, n_pad - n))
        scale = torch.nn.functional.pad(scales[expert], (0, s_count * _GROUPS_PER_STEP - g, 0, n_pad - n))
        d, s_ref = _drops(scale)
        flushed = d > MAX_EXACT_DROP  # (the padding's zero bytes too: their codes are zero anyway)
        codes = torch.where(flushed.repeat_interleave(32, dim=1), 0, codes).to(torch.uint8)
        words[expert] = _pack_words(_fragment_order(codes))
        d = d.clamp(max=MAX_EXACT_DROP).to(torch.uint8).reshape(n_pad, s_count, _GROUPS_PER_STEP)
        drops[expert, :, :s_count] = d.view(torch.int32).reshape(n_pad, s_count)
        factors = torch.ldexp(torch.ones_like(s_ref, dtype=torch.float32), s_ref - 133)
        drops[expert, :, s_count:] = factors.view(torch.int32)
    return words, drops


def unpack_w4a8(words: Tensor, drops: Tensor, *, rows: int, in_dim: int) -> tuple[Tensor, Tensor]:
    """(words, drops) of `pack_w4a8` -> checkpoint (blocks uint8 [E, rows, G, 16], scales uint8 [E, rows,
    G]), G = ceil(in_dim / 32): the weights the kernels compute with (a flushed group's codes are zero, its
    scale byte its reference's minus MAX_EXACT_DROP)."""
    e, s_count = words.shape[0], words.shape[2]
    g = -(-in_dim // 32)
    blocks, scales = [], []
    for expert in range(e):
        codes = _from_fragment_order(_unpack_words(words[expert]))[:rows, : 32 * g]
        d = drops[expert, :rows, :s_count].contiguous().view(torch.uint8).to(torch.int32)
        factors = drops[expert, :rows, s_count:].contiguous().view(torch.float32)
        s_ref = torch.frexp(factors).exponent.to(torch.int32) + 132  # 2^(s - 133) = 0.5 * 2^(exponent)
        s_ref = s_ref.repeat_interleave(_GROUPS_PER_STEP * STEPS_PER_REFERENCE, dim=1)[:, : d.shape[1]]
        pairs = codes.reshape(rows, g, 16, 2)
        blocks.append(pairs[..., 0] | (pairs[..., 1] << 4))
        scales.append((s_ref - d)[:, :g].to(torch.uint8))
    return torch.stack(blocks), torch.stack(scales)


def flushed_groups(scales: Tensor) -> int:
    """How many groups of checkpoint scales [..., N, G] `pack_w4a8` flushes (a host sync; load time)."""
    flat = scales.reshape(-1, scales.shape[-1])
    return int((_drops(flat)[0] > MAX_EXACT_DROP).sum())
