#!/usr/bin/env python3
"""W4A8 on FP8 wgmma with the weights as the register-A operand: the second design `w4a8_lut_probe.py`'s
measurements point to (docs/performance.md, "W4A8"). A plain GEMM out[r, n] = xs[r] * sum_k x[r, k] w[n, k]:
x FP8 E4M3 with a scale a row (per-token quantization), w MXFP4. The weights are decoded in the warps that
run the wgmma, straight into its A fragment, so the decoded tile never goes through shared memory and no
decoder partition holds registers; x comes through a TMA ring as the B operand.

The decode is `w4a8_lut.py`'s byte-permute table; `pack_fragment_words` orders the words offline so that
each thread loads exactly the codes of its fragment registers: for row block rb (16 rows), K-step t (128
columns), lane l = 4g + q and slot j = 2c + h, the word holds row 16 rb + 8 h + g's codes at columns
128 t + 32 c + 4 q + (0..3) (the word's first 4 codes) and + 16 (its last 4). A 32-column chunk c is one MX
group. Each K-step's product is scaled by its rows' 2^(s_max - 133) into fp32 (the table is relative to
the row's largest scale over the step); x's row scale is applied once, at the end.

One program: 128 weight rows (8 warps, the wgmma's M) x BN rows of x (its N); no warp specialization. At
each step the next step's words are decoded while this step's wgmma runs.

Usage:
  python3 tools/w4a8_swap_probe.py compile   # CPU: sm_90 SASS facts (spills, registers, the K-loop)
  python3 tools/w4a8_swap_probe.py run       # GPU: against torch, timed beside dense FP8
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "src")]

import w4a8_lut  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

MAX_EXACT_DROP = gl.constexpr(w4a8_lut.MAX_EXACT_DROP)
_LUT_LO = gl.constexpr(w4a8_lut._LUT_LO)
_LUT_HI = gl.constexpr(w4a8_lut._LUT_HI)
_STEP_LO = gl.constexpr(w4a8_lut._STEP_LO)
_STEP_HI = gl.constexpr(w4a8_lut._STEP_HI)
_SIGNS = gl.constexpr(w4a8_lut._SIGNS_INT32)
WROWS = gl.constexpr(128)  # weight rows a program: 8 row blocks of 16, one a warp
BK = gl.constexpr(128)  # K a step: four MX groups
WORDS = gl.constexpr(8)  # words a thread a step: 4 groups x rows g and g + 8


def pack_fragment_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [N, K] (N % 16 == 0, K % 128 == 0) -> int32 words [N / 16, K / 128, 32, 8] in the
    fragment order of the module docstring."""
    n, k = codes.shape
    c = codes.reshape(n // 16, 2, 8, k // 128, 4, 2, 4, 4)  # rb, h, g, t, c, kh, q, byte
    c = c.permute(0, 3, 2, 6, 4, 1, 5, 7)  # rb, t, g, q, c, h, kh, byte
    words = w4a8_lut.pack_words(c.reshape(-1, 8))
    return words.reshape(n // 16, k // 128, 32, 8)


@gluon.jit
def _prmt(lo, hi, selector):
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, selector], dtype=gl.int32, is_pure=True, pack=1
    )


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
def _decode(words, scales, shift):
    """A step's words [8 rb, 32 lanes, 8 slots] and their rows' 4 scale bytes (int32, same shape) -> the
    E4M3 bytes of E2M1 * 2^(6 - d): (first, second), int32 of the word's first and last 4 codes."""
    s_max = gl.maximum(
        gl.maximum(scales & 0xFF, (scales >> 8) & 0xFF),
        gl.maximum((scales >> 16) & 0xFF, (scales >> 24) & 0xFF),
    )
    d = s_max - ((scales >> shift) & 0xFF)
    lo = gl.where(d > MAX_EXACT_DROP, 0, _LUT_LO - d * _STEP_LO)
    hi = gl.where(d > MAX_EXACT_DROP, 0, _LUT_HI - d * _STEP_HI)
    first = _prmt(lo, hi, words & 0x7777) | (words & _SIGNS)
    second = _prmt(lo, hi, (words >> 16) & 0x7777) | ((words << 4) & _SIGNS)
    return first, second


@gluon.jit
def _fragment(first, second, fragment: gl.constexpr):
    """(first, second) of `_decode` -> the E4M3 A fragment [128 rows, 128 columns]: a renaming of registers
    when built next to its wgmma (carried through the loop as bytes, it was repacked: 3 PRMT a register)."""
    t = gl.join(_bytes(first), _bytes(second))  # [8, 32, 8, 2, 2, 2]: rb, lane, slot, byte // 2, byte % 2, kh
    t = gl.permute(t, [0, 1, 2, 5, 3, 4])  # rb, lane, slot, kh, byte // 2, byte % 2
    t = gl.reshape(t, [8, 8, 4, 4, 2, 2, 4])  # rb, g, q, c, h, kh, byte
    t = gl.permute(t, [0, 4, 1, 3, 5, 2, 6])  # rb, h, g, c, kh, q, byte: row, then column order
    return gl.convert_layout(gl.reshape(t, [WROWS, BK]), fragment)


@gluon.jit
def _row_factors(s_rows, k):
    """2^(s_max - 133) of each row over step k (fp32, the mma layout's rows)."""
    sc = gl.load(s_rows + k)
    s_max = gl.maximum(
        gl.maximum(sc & 0xFF, (sc >> 8) & 0xFF), gl.maximum((sc >> 16) & 0xFF, (sc >> 24) & 0xFF)
    )
    return ((s_max - 6) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _load_x(x_desc, x_smem, ready, xrow0, t, NS: gl.constexpr):
    s = t % NS
    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [xrow0, t * BK], ready.index(s), x_smem.index(s))


@gluon.jit
def _w4a8_swap_gemm(
    x_desc,
    w_ptr,
    s_ptr,
    xs_ptr,
    out_ptr,
    stride_s,
    stride_o,
    HIDDEN: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
):
    wrow0 = gl.program_id(0) * WROWS
    xrow0 = gl.program_id(1) * BN
    KT: gl.constexpr = HIDDEN // BK
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [8, 1, 1], [2, 1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 32]
    )
    fragment: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, BN, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
    for t in gl.static_range(NS):
        if t < KT:
            _load_x(x_desc, x_smem, ready, xrow0, t, NS)

    rb = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    slot = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    w_steps = w_ptr + ((wrow0 // 16 + rb) * KT * 32 + lane) * WORDS + slot  # + t * 32 * WORDS
    s_steps = s_ptr + (wrow0 + 16 * rb + lane // 4 + 8 * (slot % 2)) * stride_s  # + t
    shift = 8 * (slot // 2)
    s_rows = s_ptr + (wrow0 + gl.arange(0, WROWS, layout=gl.SliceLayout(1, mma))) * stride_s

    first, second = _decode(gl.load(w_steps), gl.load(s_steps), shift)
    words = gl.load(w_steps + gl.minimum(1, KT - 1) * 32 * WORDS)
    scales = gl.load(s_steps + gl.minimum(1, KT - 1))
    acc = gl.zeros([WROWS, BN], gl.float32, mma)
    zero = gl.zeros([WROWS, BN], gl.float32, mma)
    for k in range(KT):
        s = k % NS
        mbarrier.wait(ready.index(s), (k // NS) & 1)
        a = _fragment(first, second, fragment)
        product = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        factors = _row_factors(s_rows, k)
        first, second = _decode(words, scales, shift)  # step k + 1 (the last repeats), under wgmma k
        words = gl.load(w_steps + gl.minimum(k + 2, KT - 1) * 32 * WORDS)
        scales = gl.load(s_steps + gl.minimum(k + 2, KT - 1))
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        gl.thread_barrier()  # every warp's wgmma k has read stage s
        if k + NS < KT:
            _load_x(x_desc, x_smem, ready, xrow0, k + NS, NS)
        acc = acc + product * factors[:, None]
    cols = xrow0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    rows = wrow0 + gl.arange(0, WROWS, layout=gl.SliceLayout(1, mma))
    x_scale = gl.load(xs_ptr + cols)
    gl.store(out_ptr + cols.to(gl.int64)[None, :] * stride_o + rows[:, None], acc * x_scale[None, :])


VARIANTS = ((128, 4), (64, 4))  # (BN, stages)


def compile_offline(hidden: int, bn: int, stages: int):
    from hopper_compile import _descriptor_type, compile_gluon_for_hopper

    pointers = dict(
        x_desc=_descriptor_type([bn, 128], gl.float8e4nv, "fp8e4nv"),
        w_ptr="*i32",
        s_ptr="*i32",
        xs_ptr="*fp32",
        out_ptr="*fp32",
    )
    constants = dict(HIDDEN=hidden, BN=bn, NS=stages)
    aligned = ("w_ptr", "s_ptr", "xs_ptr", "out_ptr", "stride_s", "stride_o")  # as a launch specializes them
    return compile_gluon_for_hopper(
        _w4a8_swap_gemm, pointers=pointers, constants=constants, warps=8, aligned=aligned
    )


def main_compile() -> None:
    import sass_report

    for bn, stages in VARIANTS:
        kernel = compile_offline(2944, bn, stages)
        ins = sass_report.all_instructions(kernel)
        ops: dict[str, int] = {}
        for _, text in ins:
            op = sass_report.unpredicated(text).split()[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        print(
            f"BN {bn}, {stages} stages: shared {kernel.metadata.shared} B, {sass_report.properties(kernel)}"
        )
        print("  ", {op: ops.get(op) for op in ("PRMT", "LOP3", "QGMMA", "LDG", "LDS", "STS", "SHF", "IMAD")})


def _problem(rows: int, n: int, hidden: int, device: torch.device):
    codes = torch.randint(0, 16, (n, hidden), dtype=torch.uint8)
    scale_bytes = torch.randint(118, 128, (n, hidden // 32), dtype=torch.uint8)
    w = torch.tensor(w4a8_lut.E2M1)[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    w = w * torch.pow(2.0, scale_bytes.float() - 127).repeat_interleave(32, dim=1)
    x = torch.randn(rows, hidden)
    x_scale = x.abs().amax(-1).clamp_min(1e-12) / 448.0
    xq = (x / x_scale[:, None]).to(torch.float8_e4m3fn)
    want = (xq.float() * x_scale[:, None]) @ w.T
    operands = (
        xq.to(device),
        x_scale.to(device).contiguous(),
        pack_fragment_words(codes).to(device).contiguous(),
        scale_bytes.view(torch.int32).to(device).contiguous(),  # a K-step's 4 scale bytes, group g in byte g
    )
    return operands, want


def main_run() -> None:
    import triton
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    device = torch.device("cuda")
    torch.manual_seed(0)
    for rows, n, hidden in ((512, 1024, 2944), (8192, 5888, 2944), (16384, 4096, 7168)):
        (xq, x_scale, words, scales), want = _problem(rows, n, hidden, device)
        out = torch.empty((rows, n), device=device)
        flops = 2 * rows * n * hidden
        dense_w = torch.randn(n, hidden, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        dense_ms = triton.testing.do_bench(
            functools.partial(torch._scaled_mm, xq, dense_w.T, one, one, out_dtype=torch.bfloat16)
        )
        for bn, stages in VARIANTS:
            x_desc = TensorDescriptor.from_tensor(
                xq, [bn, 128], gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
            )
            out.fill_(float("nan"))
            call = functools.partial(
                _w4a8_swap_gemm[(n // 128, rows // bn)],
                *(x_desc, words, scales, x_scale, out, scales.stride(0), out.stride(0)),
                HIDDEN=hidden,
                BN=bn,
                NS=stages,
                num_warps=8,
            )
            call()
            torch.cuda.synchronize()
            error = ((out.cpu() - want).norm() / want.norm()).item()
            ms = triton.testing.do_bench(call)
            print(
                f"M {rows} N {n} K {hidden}, BN {bn}, {stages} stages: rel L2 {error:.2e}, "
                f"{ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s; "
                f"dense FP8 {dense_ms * 1e3:.1f} us, {flops / dense_ms / 1e9:.0f}"
            )


if __name__ == "__main__":
    main_compile() if sys.argv[1:] == ["compile"] else main_run()
