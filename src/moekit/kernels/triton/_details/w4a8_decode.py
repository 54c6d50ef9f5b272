"""The W4A8 weight decode on sm_90 (Gluon): MXFP4 words (`moekit.formats.mxfp4_w4a8`) into E4M3 bytes
through one byte permute of an 8-byte table a 4 codes, and those bytes renamed into the FP8 wgmma's
register-A fragment. Shared by the WGMMA_W4A8 engine and the probes in tools/."""

from __future__ import annotations

from moekit.formats import mxfp4_w4a8
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MAX_EXACT_DROP = gl.constexpr(mxfp4_w4a8.MAX_EXACT_DROP)
_LUT_LO = gl.constexpr(mxfp4_w4a8.LUT_LO)
_LUT_HI = gl.constexpr(mxfp4_w4a8.LUT_HI)
_STEP_LO = gl.constexpr(mxfp4_w4a8.STEP_LO)
_STEP_HI = gl.constexpr(mxfp4_w4a8.STEP_HI)
_SIGNS = gl.constexpr(mxfp4_w4a8.SIGNS_INT32)
STEP_K = gl.constexpr(mxfp4_w4a8.STEP_K)


@gluon.jit
def _prmt(lo, hi, selector):
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, selector], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _table_bytes(words, d, FLUSH: gl.constexpr):
    """int32 words and their groups' drops d -> (first, second): the E4M3 bytes of each word's first and
    last 4 codes, E2M1 * 2^(6 - d). With FLUSH, drops past MAX_EXACT_DROP give zeros; without, the caller
    guarantees d <= MAX_EXACT_DROP (`mxfp4_w4a8.pack_w4a8` clamps them and zeroes those groups' codes)."""
    if FLUSH:
        lo = gl.where(d > MAX_EXACT_DROP, 0, _LUT_LO - d * _STEP_LO)
        hi = gl.where(d > MAX_EXACT_DROP, 0, _LUT_HI - d * _STEP_HI)
    else:
        lo = _LUT_LO - d * _STEP_LO
        hi = _LUT_HI - d * _STEP_HI
    first = _prmt(lo, hi, words & 0x7777) | (words & _SIGNS)
    second = _prmt(lo, hi, (words >> 16) & 0x7777) | ((words << 4) & _SIGNS)
    return first, second


@gluon.jit
def _bytes(x):
    """int32 [..] -> E4M3 [.., 4] (byte 0 first): a renaming of the register's bytes."""
    b0 = x.to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    b1 = (x >> 8).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    b2 = (x >> 16).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    b3 = (x >> 24).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    # join's new dimension is the last: join(join(b0, b2), join(b1, b3))[.., i, j] = byte 2 i + j
    return gl.join(gl.join(b0, b2), gl.join(b1, b3))


@gluon.jit
def _fragment(first, second, fragment: gl.constexpr):
    """(first, second) of a step's words [RB row blocks, 32 lanes, 8 slots] -> the E4M3 A fragment [16 RB
    rows, 128 columns]: a renaming of registers when built next to its wgmma (carried through the loop as
    bytes, it was repacked: 3 PRMT a register)."""
    # [RB, 32, 8, 2, 2, 2]: rb, lane, slot, byte // 2, byte % 2, kh
    t = gl.join(_bytes(first), _bytes(second))
    t = gl.permute(t, [0, 1, 2, 5, 3, 4])  # rb, lane, slot, kh, byte // 2, byte % 2
    RB: gl.constexpr = first.shape[0]
    t = gl.reshape(t, [RB, 8, 4, 4, 2, 2, 4])  # rb, g, q, c, h, kh, byte
    t = gl.permute(t, [0, 4, 1, 3, 5, 2, 6])  # rb, h, g, c, kh, q, byte: row, then column order
    return gl.convert_layout(gl.reshape(t, [16 * RB, STEP_K]), fragment)
