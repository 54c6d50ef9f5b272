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

One program: 128 weight rows (8 warps, the wgmma's M) x BN rows of x (its N); no warp specialization. The
next step's words are decoded while this step's wgmma runs. K-loops (`LOOP`): 0 waits for each step's
product and promotes it; 2 decodes two steps against one reference scale a row, so that their wgmmas share a
product and each pair is promoted once (exact only where no group falls more than 11 binades below its
pair's largest scale). The FP8 engine's window (the next step's wgmma in flight while promoting) spilled at
BN 128 and ran slower at BN 64 (docs/performance.md, "W4A8"), so it is not here.

Usage:
  python3 tools/w4a8_swap_probe.py compile   # CPU: sm_90 SASS facts (spills, registers, the K-loop)
  python3 tools/w4a8_swap_probe.py run [V ...]       # GPU: variants V (all) against torch, beside dense FP8
  python3 tools/w4a8_swap_probe.py profile [V ...]   # GPU: variants V (all) launched twice, for a profiler
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
from w4a8_lut_probe import _scale_max, checked_report, dense_fp8_report  # noqa: E402

from moekit.formats import mxfp4_w4a8  # noqa: E402
from moekit.kernels.triton._details.w4a8_decode import _fragment, _table_bytes  # noqa: E402

WROWS = gl.constexpr(128)  # weight rows a program: 8 row blocks of 16, one a warp
BK = gl.constexpr(128)  # K a step: four MX groups
WORDS = gl.constexpr(8)  # words a thread a step: 4 groups x rows g and g + 8


def pack_fragment_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [N, K] (N % 16 == 0, K % 128 == 0) -> int32 words [N / 16, K / 128, 32, 8] in the
    fragment order of the module docstring (the engine's packing, `moekit.formats.mxfp4_w4a8`)."""
    return mxfp4_w4a8._pack_words(mxfp4_w4a8._fragment_order(codes))


@gluon.jit
def _decode(words, scales, shift, s_max, PRE: gl.constexpr):
    """A step's words [8 rb, 32 lanes, 8 slots] and their rows' 4 scale bytes (int32, same shape) ->
    `_table_bytes`' (first, second). d is the rows' reference scale `s_max` (>= every byte) minus the group's,
    groups past 11 flushed; with PRE the bytes are the drops d themselves (`pack_drops`: computed, clamped
    and flushed when packing; `s_max` unused)."""
    if PRE:
        return _table_bytes(words, (scales >> shift) & 0xFF, False)
    else:
        return _table_bytes(words, s_max - ((scales >> shift) & 0xFF), True)


@gluon.jit
def _row_factors(weights, k, last, r, PRE: gl.constexpr):
    """2^(s_max - 133) of each row over steps k to `last` (k or k + 1; fp32, the mma layout's rows); with
    PRE, reference r's packed factors."""
    s_rows, f_rows = weights[3], weights[4]
    if PRE:
        return gl.load(f_rows + r)
    else:
        s_max = gl.maximum(_scale_max(gl.load(s_rows + k)), _scale_max(gl.load(s_rows + last)))
        return ((s_max - 6) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _load_x(x_desc, x_smem, ready, xrow0, t, NS: gl.constexpr):
    s = t % NS
    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [xrow0, t * BK], ready.index(s), x_smem.index(s))


@gluon.jit
def _raw_step(weights, t, KT: gl.constexpr):
    """Step t's words and scale bytes (t clamped to the last step)."""
    w_steps, s_steps = weights[0], weights[1]
    t = gl.minimum(t, KT - 1)
    return gl.load(w_steps + t * 32 * WORDS), gl.load(s_steps + t)


@gluon.jit
def _issue(ring, decoded, k, acc, USE_ACC: gl.constexpr, fragment: gl.constexpr, NS: gl.constexpr):
    """Step k's wgmma (async) on the decoded (first, second), once its x tile is in."""
    x_smem, ready = ring[1], ring[2]
    s = k % NS
    mbarrier.wait(ready.index(s), (k // NS) & 1)
    a = _fragment(decoded[0], decoded[1], fragment)
    return warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _refill(ring, k, KT: gl.constexpr, NS: gl.constexpr):
    """Step k + NS's x tile into the stage step k's wgmma read (every warp has waited for it)."""
    if k + NS < KT:
        _load_x(ring[0], ring[1], ring[2], ring[3], k + NS, NS)


@gluon.jit
def _release(ring, k, STEPS: gl.constexpr, KT: gl.constexpr, NS: gl.constexpr, WS: gl.constexpr):
    """Steps k .. k + STEPS - 1 are read (this warpgroup waited for their wgmma): with WS, hand their stages
    to the producer partition; else wait for every warp, then load the x tiles NS steps on."""
    if WS:
        for j in gl.static_range(STEPS):
            mbarrier.arrive(ring[4].index((k + j) % NS), count=1)
    else:
        gl.thread_barrier()
        for j in gl.static_range(STEPS):
            _refill(ring, k + j, KT, NS)


@gluon.jit
def _plain_kloop(
    ring,
    weights,
    zero,
    fragment: gl.constexpr,
    KT: gl.constexpr,
    NS: gl.constexpr,
    PRE: gl.constexpr,
    WS: gl.constexpr,
):
    """Each step's wgmma waited for, then scaled into the sum; the next step's decode under it."""
    shift = weights[2]
    acc = zero
    words, scales = _raw_step(weights, 0, KT)
    decoded = _decode(words, scales, shift, _scale_max(scales), PRE)
    words, scales = _raw_step(weights, 1, KT)
    for k in range(KT):
        product = _issue(ring, decoded, k, zero, False, fragment, NS)
        factors = _row_factors(weights, k, k, k, PRE)
        decoded = _decode(words, scales, shift, _scale_max(scales), PRE)  # step k + 1 (the last repeats)
        words, scales = _raw_step(weights, k + 2, KT)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        _release(ring, k, 1, KT, NS, WS)
        acc = acc + product * factors[:, None]
    return acc


@gluon.jit
def _pair_kloop(
    ring,
    weights,
    zero,
    fragment: gl.constexpr,
    KT: gl.constexpr,
    NS: gl.constexpr,
    PRE: gl.constexpr,
    WS: gl.constexpr,
):
    """Steps in pairs decoded against one reference scale a row (the largest of the pair's 8 groups), so
    that both wgmmas accumulate into one product and a pair is promoted once: half the waits and the
    promotions of `_plain_kloop`, the next pair's decode under them. An odd last step runs alone."""
    shift = weights[2]
    acc = zero
    w0, s0 = _raw_step(weights, 0, KT)
    w1, s1 = _raw_step(weights, 1, KT)
    s_max = gl.maximum(_scale_max(s0), _scale_max(s1))
    first = _decode(w0, s0, shift, s_max, PRE)
    second = _decode(w1, s1, shift, s_max, PRE)
    w0, s0 = _raw_step(weights, 2, KT)
    w1, s1 = _raw_step(weights, 3, KT)
    for i in range(KT // 2):
        k = 2 * i
        product = _issue(ring, first, k, zero, False, fragment, NS)
        product = _issue(ring, second, k + 1, product, True, fragment, NS)
        factors = _row_factors(weights, k, k + 1, i, PRE)
        s_max = gl.maximum(_scale_max(s0), _scale_max(s1))  # steps k + 2 and k + 3 (clamped), under both
        first = _decode(w0, s0, shift, s_max, PRE)
        second = _decode(w1, s1, shift, s_max, PRE)
        w0, s0 = _raw_step(weights, k + 4, KT)
        w1, s1 = _raw_step(weights, k + 5, KT)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        _release(ring, k, 2, KT, NS, WS)
        acc = acc + product * factors[:, None]
    if KT % 2 == 1:  # decoded above as the pair (KT - 1, KT - 1): against its own largest scale
        product = _issue(ring, first, KT - 1, zero, False, fragment, NS)
        factors = _row_factors(weights, KT - 1, KT - 1, KT // 2, PRE)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        acc = acc + product * factors[:, None]
    return acc


@gluon.jit
def _weight_rows(
    ring,
    pointers,
    row0,
    RB: gl.constexpr,
    KT: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    LOOP: gl.constexpr,
    PRE: gl.constexpr,
    WS: gl.constexpr,
):
    """out[x rows, row0 + 16 RB rows] on RB warps (one 16-row block each): the K-loop, then x's row scale.
    `pointers`: w, scales (or drops), factors, x scales, out, and the strides of scales, factors, out."""
    w_ptr, s_ptr, f_ptr, xs_ptr, out_ptr, stride_s, stride_f, stride_o = pointers
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [RB, 1, 1], [2, 1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[RB, 1], instr_shape=[16, BN, 32]
    )
    fragment: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    rb = gl.arange(0, RB, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    slot = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    w_steps = w_ptr + ((row0 // 16 + rb) * KT * 32 + lane) * WORDS + slot  # + t * 32 * WORDS
    s_steps = s_ptr + (row0 + 16 * rb + lane // 4 + 8 * (slot % 2)) * stride_s  # + t
    mma_rows = row0 + gl.arange(0, 16 * RB, layout=gl.SliceLayout(1, mma))
    weights = (w_steps, s_steps, 8 * (slot // 2), s_ptr + mma_rows * stride_s, f_ptr + mma_rows * stride_f)
    zero = gl.zeros([16 * RB, BN], gl.float32, mma)
    if LOOP == 2:
        acc = _pair_kloop(ring, weights, zero, fragment, KT, NS, PRE, WS)
    else:
        acc = _plain_kloop(ring, weights, zero, fragment, KT, NS, PRE, WS)
    cols = ring[3] + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    x_scale = gl.load(xs_ptr + cols)
    gl.store(out_ptr + cols.to(gl.int64)[None, :] * stride_o + mma_rows[:, None], acc * x_scale[None, :])


@gluon.jit
def _ring(x_desc, xrow0, NS: gl.constexpr, BN: gl.constexpr, EMPTY_COUNT: gl.constexpr):
    """(x_desc, x stages, ready barriers, xrow0, empty barriers) of a program's x ring, barriers initialized;
    empty barriers (EMPTY_COUNT arrivals a phase) only where EMPTY_COUNT > 0."""
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, BN, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        if EMPTY_COUNT > 0:
            mbarrier.init(empty.index(i), count=EMPTY_COUNT)
    return x_desc, x_smem, ready, xrow0, empty


@gluon.jit
def _producer(ring, KT: gl.constexpr, NS: gl.constexpr):
    """The x tiles through the ring, each stage once both math partitions handed it back."""
    x_desc, x_smem, ready, xrow0, empty = ring
    for t in range(KT):
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)
        _load_x(x_desc, x_smem, ready, xrow0, t, NS)


@gluon.jit
def _w4a8_swap_gemm(
    x_desc,
    w_ptr,
    s_ptr,
    f_ptr,
    xs_ptr,
    out_ptr,
    stride_s,
    stride_f,
    stride_o,
    HIDDEN: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    LOOP: gl.constexpr,
    PRE: gl.constexpr,
    WS: gl.constexpr,
):
    """A program: 128 weight rows x BN rows of x. Without WS, 8 warps, each stage reloaded after a CTA-wide
    barrier. With WS (launched with 4 warps), each warpgroup its own partition of 64 weight rows and a
    one-warp TMA producer: stages go back through `empty` barriers, so the two warpgroups drift apart and
    one's promotion can run under the other's wgmma."""
    KT: gl.constexpr = HIDDEN // BK
    ring = _ring(x_desc, gl.program_id(1) * BN, NS, BN, 2 if WS else 0)
    pointers = (w_ptr, s_ptr, f_ptr, xs_ptr, out_ptr, stride_s, stride_f, stride_o)
    wrow0 = gl.program_id(0) * WROWS
    if WS:
        gl.warp_specialize(
            [
                (_weight_rows, (ring, pointers, wrow0, 4, KT, BN, NS, LOOP, PRE, True)),
                (_weight_rows, (ring, pointers, wrow0 + 64, 4, KT, BN, NS, LOOP, PRE, True)),
                (_producer, (ring, KT, NS)),
            ],
            [4, 1],
            [232, 40],
        )
    else:
        for t in gl.static_range(NS):
            if t < KT:
                _load_x(x_desc, ring[1], ring[2], ring[3], t, NS)
        _weight_rows(ring, pointers, wrow0, 8, KT, BN, NS, LOOP, PRE, False)


VARIANTS = (  # (BN, stages, loop: 0 plain, 2 pairs; PRE: drops and factors packed offline; WS)
    (128, 4, 0, False, False),
    (128, 4, 2, False, False),
    (128, 4, 0, True, False),
    (128, 4, 2, True, False),
    (128, 4, 0, True, True),
    (128, 4, 2, True, True),
)
# WS: each warpgroup its own partition, stages handed back by barrier, not CTA-wide (`_w4a8_swap_gemm`)


def pack_drops(scale_bytes: torch.Tensor, steps_per_reference: int):
    """E8M0 bytes [N, K / 32] (K % 128 == 0) -> what a PRE kernel reads instead of them: (drops: int32
    [N, K / 128], byte c of step t the drop d of group 4 t + c below its reference; factors: fp32 [N, R], the
    2^(s_max - 133) of each reference of `steps_per_reference` steps (the last may be shorter); flushed:
    bool [N, K / 32], groups more than 11 binades below their reference, whose codes the caller zeroes and
    whose drop is clamped)."""
    n, groups = scale_bytes.shape
    per_reference = 4 * steps_per_reference
    s = scale_bytes.to(torch.int32)
    drops = torch.empty_like(s)
    factors = []
    for start in range(0, groups, per_reference):
        part = s[:, start : start + per_reference]
        s_max = part.amax(dim=1, keepdim=True)
        drops[:, start : start + per_reference] = s_max - part
        factors.append(torch.pow(2.0, (s_max - 133).double()).float())
    flushed = drops > w4a8_lut.MAX_EXACT_DROP
    drops = drops.clamp(max=w4a8_lut.MAX_EXACT_DROP).to(torch.uint8).view(torch.int32)
    return drops, torch.cat(factors, dim=1), flushed


def _weights(codes: torch.Tensor, scale_bytes: torch.Tensor, pre: bool, steps_per_reference: int, device):
    """(words, scales or drops, factors, the factors' row stride) on `device`: without `pre` the raw scale
    bytes (and a placeholder for the factors), with it `pack_drops` at `steps_per_reference`."""
    if not pre:
        words = pack_fragment_words(codes).to(device)
        return words, scale_bytes.view(torch.int32).to(device), torch.ones(1, device=device), 0
    drops, factors, flushed = pack_drops(scale_bytes, steps_per_reference)
    codes = torch.where(flushed.repeat_interleave(32, dim=1), 0, codes)
    return pack_fragment_words(codes).to(device), drops.to(device), factors.to(device), factors.stride(0)


def _variant_weights(codes: torch.Tensor, scale_bytes: torch.Tensor, device, indices=None):
    """(variant, its `_weights`) for VARIANTS[i], i in `indices` (all if None), each packing made once for
    the variants that read it."""
    packed = {}
    for index in range(len(VARIANTS)) if indices is None else indices:
        variant = VARIANTS[index]
        loop, pre = variant[2], variant[3]
        key = (pre, 2 if pre and loop == 2 else 1)
        if key not in packed:
            packed[key] = _weights(codes, scale_bytes, *key, device)
        yield variant, packed[key]


def compile_offline(hidden: int, bn: int, stages: int, loop: int, pre: bool, ws: bool):
    from hopper_compile import _descriptor_type, compile_gluon_for_hopper

    pointers = dict(
        x_desc=_descriptor_type([bn, 128], gl.float8e4nv, "fp8e4nv"),
        w_ptr="*i32",
        s_ptr="*i32",
        f_ptr="*fp32",
        xs_ptr="*fp32",
        out_ptr="*fp32",
    )
    constants = dict(HIDDEN=hidden, BN=bn, NS=stages, LOOP=loop, PRE=pre, WS=ws)
    aligned = ("w_ptr", "s_ptr", "xs_ptr", "out_ptr", "stride_s", "stride_o")  # as a launch specializes them
    return compile_gluon_for_hopper(
        _w4a8_swap_gemm, pointers=pointers, constants=constants, warps=4 if ws else 8, aligned=aligned
    )


def main_compile() -> None:
    import sass_report

    for bn, stages, loop, pre, ws in VARIANTS:
        kernel = compile_offline(2944, bn, stages, loop, pre, ws)
        ins = sass_report.all_instructions(kernel)
        ops: dict[str, int] = {}
        for _, text in ins:
            op = sass_report.unpredicated(text).split()[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        print(
            f"BN {bn}, {stages} stages, loop {loop}, PRE {pre}, WS {ws}: shared {kernel.metadata.shared} B, "
            f"{sass_report.kernel_facts(kernel)}"
        )
        print(
            "  ", {op: ops.get(op) for op in ("PRMT", "LOP3", "SEL", "QGMMA", "LDG", "FFMA", "SHF", "IMAD")}
        )


def _problem(rows: int, n: int, hidden: int, reference: bool = True):
    """Random per-token FP8 x, MXFP4 codes and scale bytes (`w4a8_lut.random_mxfp4`: nothing flushed), and
    the exact fp32 product of the dequantized operands (None without `reference`)."""
    codes, scale_bytes = w4a8_lut.random_mxfp4(n, hidden)
    x = torch.randn(rows, hidden)
    x_scale = x.abs().amax(-1).clamp_min(1e-12) / 448.0
    xq = (x / x_scale[:, None]).to(torch.float8_e4m3fn)
    want = (xq.float() * x_scale[:, None]) @ w4a8_lut.dequantize(codes, scale_bytes).T if reference else None
    return xq, x_scale, codes, scale_bytes, want


def _launch(xq, x_scale, weights, out, variant, hidden: int):
    """A call of the kernel in `variant` on device operands."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bn, stages, loop, pre, ws = variant
    words, scales, factors, stride_f = weights
    layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    x_desc = TensorDescriptor.from_tensor(xq, [bn, 128], layout)
    args = (x_desc, words, scales, factors, x_scale, out, scales.stride(0), stride_f, out.stride(0))
    grid = (out.shape[1] // 128, out.shape[0] // bn)
    return functools.partial(
        _w4a8_swap_gemm[grid],
        *args,
        HIDDEN=hidden,
        BN=bn,
        NS=stages,
        LOOP=loop,
        PRE=pre,
        WS=ws,
        num_warps=4 if ws else 8,
    )


def main_run(indices: list[int]) -> None:
    """VARIANTS[i] for each i in `indices` (all if none), each checked and timed at three shapes."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    for rows, n, hidden in ((512, 1024, 2944), (8192, 5888, 2944), (16384, 4096, 7168)):
        xq, x_scale, codes, scale_bytes, want = _problem(rows, n, hidden)
        xq, x_scale = xq.to(device), x_scale.to(device)
        out = torch.empty((rows, n), device=device)
        _, dense = dense_fp8_report(xq, n)
        for variant, weights in _variant_weights(codes, scale_bytes, device, indices or None):
            call = _launch(xq, x_scale, weights, out, variant, hidden)
            report = checked_report(call, out, want, 2 * rows * n * hidden)
            bn, stages, loop, pre, ws = variant
            print(
                f"M {rows} N {n} K {hidden}, BN {bn}, {stages} stages, loop {loop}, PRE {pre}, WS {ws}: "
                f"{report}; {dense}"
            )


def main_profile(indices: list[int]) -> None:
    """VARIANTS[i] for each i in `indices` (all if none), each launched twice at 16384 x 4096 x 7168, for a
    profiler's kernel filter (e.g. Nsight Compute's `-k regex:_w4a8_swap_gemm --launch-skip 1
    --launch-count 1` with one index)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows, n, hidden = 16384, 4096, 7168
    xq, x_scale, codes, scale_bytes, _ = _problem(rows, n, hidden, reference=False)
    xq, x_scale = xq.to(device), x_scale.to(device)
    out = torch.empty((rows, n), device=device)
    for variant, weights in _variant_weights(codes, scale_bytes, device, indices or None):
        call = _launch(xq, x_scale, weights, out, variant, hidden)
        call()
        call()
        torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"]:
        main_compile()
    elif sys.argv[1:2] == ["profile"]:
        main_profile([int(i) for i in sys.argv[2:]])
    else:
        main_run([int(i) for i in sys.argv[2:]])
