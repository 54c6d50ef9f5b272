#!/usr/bin/env python3
"""Can a Hopper K-loop decode the next step's weights while this step's register-A wgmma runs? Offline
(sm_90 compile on any machine): the same small MXFP4 x bf16 tile written in Gluon two ways.

Data flow: `compile_probe(ahead)` -> a Gluon kernel: the token tile [BM, K] in shared memory (TMA), the
weight bytes [BN, K/2] E2M1 codes decoded per K-step into wgmma's register-A fragment, acc [BN, BM] ->
`tools/sass_report.py` (`issued_under_mma`: instructions issued while the program's own wgmma is in
flight) and `tools/wgmma_hazard.py` (writes to A registers of an in-flight wgmma).
- plain: decode step k, issue its wgmma, wait for it: the order `tl.dot` compiles the word path to.
- ahead: issue step k's wgmma, decode step k + 1, then wait with step k's operand among the wait's `deps`,
  which keeps its registers allocated until the wgmma has read them.

The decode is E2M1 -> bf16 by bit operations, loaded in a plain layout and converted to the fragment
through shared memory, then (scaled) multiplied in bf16 by a power-of-two factor a row, as the word path
applies its E8M0 scales: it stands for the word path's decode in the kind of work, not in its cost (the
words need no conversion).
Usage: python tools/gluon_overlap_probe.py
"""

from __future__ import annotations

import hopper_compile
import sass_report
import wgmma_hazard
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

_ROW_BYTES = gl.constexpr(4096)  # the probe's weight row stride (K / 2 bytes for K up to 8192)


@gluon.jit
def _e2m1_as_bf16_bits(code):
    """bf16 bits of E2M1 codes (int32 0..15): ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    e = (code & 7) >> 1
    m = code & 1
    magnitude = gl.where(e == 0, m * 0x3F00, ((e + 126) << 7) | (m << 6))
    return magnitude | ((code & 8) << 12)


@gluon.jit
def _decode_step(
    w_ptr, s_ptr, row0, k, BN: gl.constexpr, BK: gl.constexpr, fragment: gl.constexpr, SCALED: gl.constexpr
):
    """Weight rows row0.. of K-step k, bf16 [BN, BK] in the wgmma register-A `fragment` layout."""
    plain: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    rows = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, plain))
    cols = k * (BK // 2) + gl.arange(0, BK // 2, layout=gl.SliceLayout(0, plain))
    packed = gl.load(w_ptr + rows[:, None] * _ROW_BYTES + cols[None, :]).to(gl.int32)
    low = _e2m1_as_bf16_bits(packed & 15).to(gl.int16)
    high = _e2m1_as_bf16_bits(packed >> 4).to(gl.int16)
    w = gl.join(low, high).reshape([BN, BK]).to(gl.bfloat16, bitcast=True)
    w = gl.convert_layout(w, fragment)
    if SCALED:
        # One power-of-two factor a row and K-step, multiplied in bf16 in the fragment's registers, as the
        # word path applies its E8M0 scales.
        frows = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, fragment))
        factor = gl.load(s_ptr + frows * 64 + k).to(gl.int16) << 7
        w = w * factor.to(gl.bfloat16, bitcast=True)[:, None]
    return w


@gluon.jit
def _probe(
    x_desc,
    w_ptr,
    s_ptr,
    out_ptr,
    KT: gl.constexpr,
    BN: gl.constexpr,
    AHEAD: gl.constexpr,
    SCALED: gl.constexpr,
):
    """out[BN weight rows, BM tokens] = W @ X^T over KT K-steps, one warpgroup."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
    )
    fragment: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [KT] + x_desc.block_type.shape, x_desc.layout)
    landed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    mbarrier.init(landed, count=1)
    mbarrier.expect(landed, KT * x_desc.block_type.nbytes)
    for k in gl.static_range(KT):
        tma.async_copy_global_to_shared(x_desc, [0, k * BK], landed, x_smem.index(k))
    mbarrier.wait(landed, 0)
    row0 = gl.program_id(0) * BN
    acc = gl.zeros([BN, BM], gl.float32, mma)
    if AHEAD:
        w = _decode_step(w_ptr, s_ptr, row0, 0, BN, BK, fragment, SCALED)
        for k in range(KT - 1):
            acc = warpgroup_mma(w, x_smem.index(k).permute((1, 0)), acc, is_async=True)
            following = _decode_step(w_ptr, s_ptr, row0, k + 1, BN, BK, fragment, SCALED)
            acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))
            w = following
        acc = warpgroup_mma(w, x_smem.index(KT - 1).permute((1, 0)), acc, is_async=True)
        acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))
    else:
        for k in range(KT):
            w = _decode_step(w_ptr, s_ptr, row0, k, BN, BK, fragment, SCALED)
            acc = warpgroup_mma(w, x_smem.index(k).permute((1, 0)), acc, is_async=True)
            acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))
    rows = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + rows[:, None] * BM + cols[None, :], acc)


def compile_probe(
    ahead: bool, *, scaled: bool = True, block_m: int = 128, block_n: int = 64, block_k: int = 64
):
    """`_probe` compiled for sm_90 with 4 warps, 8 K-steps."""
    layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
    pointers = {
        "x_desc": f"tensordesc<bf16[{block_m}, {block_k}],{layout!r}>",
        "w_ptr": "*u8",
        "s_ptr": "*u8",
    }
    pointers["out_ptr"] = "*fp32"
    constants = {"KT": 8, "BN": block_n, "AHEAD": ahead, "SCALED": scaled}
    return hopper_compile.compile_gluon_for_hopper(_probe, pointers=pointers, constants=constants, warps=4)


def report(ahead: bool, *, scaled: bool = True) -> dict:
    """Registers, instructions issued under the program's own wgmma, and A-register hazards."""
    kernel = compile_probe(ahead, scaled=scaled)
    instructions = sass_report.all_instructions(kernel)  # the K-loop is not the last loop: whole kernel
    return {
        "registers": sass_report.kernel_facts(kernel, instructions)["registers"],
        "issued_under_mma": sass_report.issued_under_mma(instructions),
        "hazard_writes": len(wgmma_hazard.simulate(kernel)["writes"]),
    }


def main() -> int:
    for ahead, scaled in ((False, True), (True, False), (True, True)):
        facts = report(ahead, scaled=scaled)
        name = f"{'ahead' if ahead else 'plain'}, {'scaled' if scaled else 'unscaled'}"
        print(
            f"{name}: {facts['registers']} registers, {facts['issued_under_mma']} instructions issued under "
            f"the MMA, {facts['hazard_writes']} writes to in-flight A registers"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
