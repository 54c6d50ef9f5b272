#!/usr/bin/env python3
"""How fast can Hopper run W4A8 (MXFP4 weights, FP8 activations) on FP8 wgmma? A probe of one design,
not an engine: a plain GEMM out[r, n] = sum_k x[r, k] * w[n, k] with x FP8 E4M3 in 1x128 groups and w
MXFP4 (E2M1 codes, an E8M0 scale a 32-group), checked against torch and timed against dense FP8
(`torch._scaled_mm`) at the same M, N, K.

The decode is `w4a8_lut.py`'s byte-permute table (its docstring has the word layout and why it is exact
to 11 binades below the row's largest scale over a K-step; groups further below are flushed to zero). The
row's 2^(s_max - 133) is applied with x's scale when each K-step's product is promoted into fp32.

The kernel (Gluon): one program = 128 rows of x x 128 weight rows; a 4-warp decoder partition that is also
the TMA producer (x tile, packed words) writes each K-step's E4M3 weight tile and row scales into shared
memory; two 4-warp math partitions (64 rows each) run wgmma on it and promote each step's product.
`Work.NO_DECODE` and `Work.NO_MATH` drop one side's work (the output is then wrong; only the time means
something) to find which side holds the kernel.

Usage:
  python3 tools/w4a8_lut_probe.py compile   # CPU: sm_90 SASS facts of each variant (spills, registers)
  python3 tools/w4a8_lut_probe.py run       # GPU: each variant against torch, timed beside dense FP8
"""

from __future__ import annotations

import enum
import functools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "src")]

import w4a8_lut  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moekit.kernels.triton._details.w4a8_decode import _table_bytes  # noqa: E402

pack_words = w4a8_lut.pack_words


class Work(enum.IntEnum):
    """What the probe kernel's partitions do (Gluon constexpr)."""

    FULL = 0
    NO_DECODE = 1  # the decoder only hands each stage on: the math side's ceiling
    NO_MATH = 2  # the math side only hands each stage back: the decoder's ceiling


ROWS = gl.constexpr(128)  # rows of x a program
WROWS = gl.constexpr(128)  # weight rows (output columns) a program
BK = gl.constexpr(128)  # K a step: four 32-groups, one x scale group


@gluon.jit
def _scale_max(scales):
    """The largest of each int32's 4 scale bytes (a K-step's groups of one row)."""
    return gl.maximum(
        gl.maximum(scales & 0xFF, (scales >> 8) & 0xFF),
        gl.maximum((scales >> 16) & 0xFF, (scales >> 24) & 0xFF),
    )


@gluon.jit
def _load_step(x_desc, w_desc, x_smem, w_smem, raw_ready, empty, row0, wrow0, t, NS: gl.constexpr):
    """Step t's x tile and words, once both math partitions handed its stage back."""
    s = t % NS
    mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)
    bar = raw_ready.index(s)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [row0, t * BK], bar, x_smem.index(s))
    tma.async_copy_global_to_shared(w_desc, [wrow0, t * (BK // 8)], bar, w_smem.index(s))


@gluon.jit
def _decode_step(w_smem, b_words, ws_smem, dec_ready, s, scales, group, layout: gl.constexpr):
    """Stage s's words -> E4M3 bytes of each code times 2^(6 - d), and the rows' 2^(s_max - 133)."""
    words = w_smem.index(s).load(layout)  # int32 [WROWS, 16]
    s_max = _scale_max(scales)
    d = s_max[:, None] - ((scales[:, None] >> (8 * group)[None, :]) & 0xFF)
    first, second = _table_bytes(words, d, True)
    b_words.index(s).store(gl.reshape(gl.join(first, second), [WROWS, 32]))
    ws_smem.index(s).store(((s_max - 6) << 23).to(gl.float32, bitcast=True))  # 2^(s_max - 133)
    fence_async_shared()
    mbarrier.arrive(dec_ready.index(s), count=1)


@gluon.jit
def _decoder(
    descs, smem, bars, s_ptr, stride_s, row0, wrow0, KT: gl.constexpr, NS: gl.constexpr, WORK: gl.constexpr
):
    """The TMA producer too, NS - 1 steps ahead of its decode: a separate one-warp producer would make
    the kernel 13 warps, whose lower register cap spilled the math partitions."""
    x_desc, w_desc = descs
    x_smem, w_smem, b_words, ws_smem = smem
    raw_ready, dec_ready, empty = bars
    for t in gl.static_range(NS - 1):
        if t < KT:
            _load_step(x_desc, w_desc, x_smem, w_smem, raw_ready, empty, row0, wrow0, t, NS)
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    rows = wrow0 + gl.arange(0, WROWS, layout=gl.SliceLayout(1, layout))
    group = gl.arange(0, 16, layout=gl.SliceLayout(0, layout)) // 4  # a word's 32-group within the step
    row_scales = s_ptr + rows.to(gl.int64) * stride_s
    next_scales = gl.load(row_scales)  # int32: a step's 4 scale bytes, one step ahead (hides the load)
    for k in range(KT):
        if k + NS - 1 < KT:
            _load_step(x_desc, w_desc, x_smem, w_smem, raw_ready, empty, row0, wrow0, k + NS - 1, NS)
        s = k % NS
        mbarrier.wait(raw_ready.index(s), (k // NS) & 1)
        scales = next_scales
        next_scales = gl.load(row_scales + gl.minimum(k + 1, KT - 1))
        if WORK == 1:
            mbarrier.arrive(dec_ready.index(s), count=1)
        else:
            _decode_step(w_smem, b_words, ws_smem, dec_ready, s, scales, group, layout)


@gluon.jit
def _promote_step(
    x_smem, b_smem, ws_smem, empty, s, acc, zero, x_scale, layout: gl.constexpr, A_ROW0: gl.constexpr
):
    product = warpgroup_mma(
        x_smem.index(s).slice(A_ROW0, 64, dim=0),
        b_smem.index(s).permute((1, 0)),
        zero,
        use_acc=False,
        is_async=True,
    )
    w_scale = ws_smem.index(s).load(gl.SliceLayout(0, layout))
    product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
    mbarrier.arrive(empty.index(s), count=1)
    return acc + product * (x_scale[:, None] * w_scale[None, :])


@gluon.jit
def _math(
    smem,
    bars,
    xs_ptr,
    stride_xs,
    out_ptr,
    stride_o,
    row0,
    wrow0,
    A_ROW0: gl.constexpr,
    KT: gl.constexpr,
    NS: gl.constexpr,
    WORK: gl.constexpr,
):
    """64 rows of x from A_ROW0: each step's wgmma waited for, then scaled into acc."""
    x_smem, b_smem, ws_smem = smem
    raw_ready, dec_ready, empty = bars
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WROWS, 32]
    )
    rows = row0 + A_ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    acc = gl.zeros([64, WROWS], gl.float32, layout)
    zero = gl.zeros([64, WROWS], gl.float32, layout)
    row_scales = xs_ptr + rows.to(gl.int64) * stride_xs
    next_scale = gl.load(row_scales)
    for k in range(KT):
        s = k % NS
        phase = (k // NS) & 1
        mbarrier.wait(raw_ready.index(s), phase)
        mbarrier.wait(dec_ready.index(s), phase)
        x_scale = next_scale
        next_scale = gl.load(row_scales + gl.minimum(k + 1, KT - 1))
        if WORK == 2:
            mbarrier.arrive(empty.index(s), count=1)
        else:
            acc = _promote_step(x_smem, b_smem, ws_smem, empty, s, acc, zero, x_scale, layout, A_ROW0)
    cols = wrow0 + gl.arange(0, WROWS, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_o + cols[None, :], acc)


@gluon.jit
def _w4a8_gemm(
    x_desc,
    w_desc,
    xs_ptr,
    s_ptr,
    out_ptr,
    stride_xs,
    stride_s,
    stride_o,
    HIDDEN: gl.constexpr,
    NS: gl.constexpr,
    WORK: gl.constexpr,
):
    row0 = gl.program_id(0) * ROWS
    wrow0 = gl.program_id(1) * WROWS
    KT: gl.constexpr = HIDDEN // BK
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, ROWS, BK], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [NS, WROWS, BK // 8], w_desc.layout)
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, WROWS, BK], b_layout)
    b_words = b_smem._reinterpret(
        gl.int32,
        [NS, WROWS, BK // 4],
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2),
    )
    ws_smem = gl.allocate_shared_memory(gl.float32, [NS, WROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    raw_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    dec_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(raw_ready.index(i), count=1)
        mbarrier.init(dec_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both math partitions
    bars = (raw_ready, dec_ready, empty)
    math_smem = (x_smem, b_smem, ws_smem)
    gl.warp_specialize(
        [
            (_math, (math_smem, bars, xs_ptr, stride_xs, out_ptr, stride_o, row0, wrow0, 0, KT, NS, WORK)),
            (_math, (math_smem, bars, xs_ptr, stride_xs, out_ptr, stride_o, row0, wrow0, 64, KT, NS, WORK)),
            (
                _decoder,
                (
                    (x_desc, w_desc),
                    (x_smem, w_smem, b_words, ws_smem),
                    bars,
                    s_ptr,
                    stride_s,
                    row0,
                    wrow0,
                    KT,
                    NS,
                    WORK,
                ),
            ),
        ],
        [4, 4],
        [200, 112],
    )


VARIANTS = ((4, Work.FULL), (5, Work.FULL), (4, Work.NO_DECODE), (4, Work.NO_MATH))  # (stages, work)


def compile_offline(hidden: int, stages: int, work: Work):
    from hopper_compile import compile_gluon_for_hopper

    x_layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([128, 16], gl.int32)
    pointers = dict(
        x_desc=f"tensordesc<fp8e4nv[128, 128],{x_layout!r}>",
        w_desc=f"tensordesc<i32[128, 16],{w_layout!r}>",
        xs_ptr="*fp32",
        s_ptr="*i32",
        out_ptr="*fp32",
    )
    constants = dict(HIDDEN=hidden, NS=stages, WORK=int(work))
    return compile_gluon_for_hopper(_w4a8_gemm, pointers=pointers, constants=constants, warps=4)


def main_compile() -> None:
    import sass_report

    for stages, work in VARIANTS:
        kernel = compile_offline(2944, stages, work)
        facts = sass_report.kernel_facts(kernel)
        print(f"{stages} stages, {work.name}: shared {kernel.metadata.shared} B, {facts}")


def dense_fp8_report(xq: torch.Tensor, n: int) -> tuple[float, str]:
    """(ms, a report's tail) of dense `torch._scaled_mm` at xq's M and K against N random E4M3 rows: the
    FP8 rate the probes compare to, in the same run."""
    import triton

    dense_w = torch.randn(n, xq.shape[1], device=xq.device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=xq.device)
    ms = triton.testing.do_bench(
        functools.partial(torch._scaled_mm, xq, dense_w.T, one, one, out_dtype=torch.bfloat16)
    )
    flops = 2 * xq.shape[0] * n * xq.shape[1]
    return ms, f"dense FP8 {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s"


def checked_report(call, out: torch.Tensor, want: torch.Tensor, flops: int) -> str:
    """Run `call` once into `out` (NaN first), then time it: "rel L2 against `want`, µs, TFLOP/s"."""
    import triton

    out.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    error = ((out.cpu() - want).norm() / want.norm()).item()
    ms = triton.testing.do_bench(call)
    return f"rel L2 {error:.2e}, {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s"


def _problem(rows: int, n: int, hidden: int, device: torch.device):
    """Random FP8 x (1x128 scales), MXFP4 w (`w4a8_lut.random_mxfp4`: no group flushed) and the exact
    fp32 product of the dequantized operands."""
    codes, scale_bytes = w4a8_lut.random_mxfp4(n, hidden)
    w = w4a8_lut.dequantize(codes, scale_bytes)
    x = torch.randn(rows, hidden)
    x_scale = x.reshape(rows, -1, 128).abs().amax(-1).clamp_min(1e-12) / 448.0
    xq = (x.reshape(rows, -1, 128) / x_scale[..., None]).to(torch.float8_e4m3fn)
    want = (xq.float() * x_scale[..., None]).reshape(rows, hidden) @ w.T
    operands = (
        xq.reshape(rows, hidden).to(device),
        x_scale.to(device).contiguous(),
        pack_words(codes).to(device),
        scale_bytes.view(torch.int32).to(device),  # a K-step's 4 scale bytes, group g in byte g
    )
    return operands, want


def main_run() -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    device = torch.device("cuda")
    torch.manual_seed(0)
    for rows, n, hidden in ((512, 1024, 2944), (8192, 5888, 2944), (16384, 4096, 7168)):
        (xq, x_scale, words, scales), want = _problem(rows, n, hidden, device)
        x_desc = TensorDescriptor.from_tensor(
            xq, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
        )
        w_desc = TensorDescriptor.from_tensor(
            words, [128, 16], gl.NVMMASharedLayout.get_default_for([128, 16], gl.int32)
        )
        out = torch.empty((rows, n), device=device)
        _, dense = dense_fp8_report(xq, n)
        for stages, work in VARIANTS:
            call = functools.partial(
                _w4a8_gemm[(rows // 128, n // 128)],
                *(x_desc, w_desc, x_scale, scales, out, x_scale.stride(0), scales.stride(0), out.stride(0)),
                HIDDEN=hidden,
                NS=stages,
                WORK=int(work),
                num_warps=4,
            )
            report = checked_report(call, out, want, 2 * rows * n * hidden)
            print(f"M {rows} N {n} K {hidden}, {stages} stages, {work.name}: {report}; {dense}")


if __name__ == "__main__":
    main_compile() if sys.argv[1:] == ["compile"] else main_run()
