#!/usr/bin/env python3
"""Prototype, not in the layer: the WGMMA_FP8 engine's GEMM1 on 128 sorted rows x (64 gate + 64 up)
weight rows a program instead of 64 x (128 + 128), h quantized by a pass of its own; checked against the
engine's own GEMM1 on the same inputs and timed against it.

Why: on an H200 the engine's GEMM1 moves about 8.5 TB/s from L2 into the SMs at DeepSeek-V3's T = 4096
and 16384 alike (docs/performance.md); a program reads 8 KiB of x and 32 KiB of weights a K-step for
64 x 256 x 128 MACs. 128 rows against 128 weight rows is the same MACs for 16 + 16 KiB: a fifth less.
The cost: a program holds 64 columns of h, half a 1x128 quantization group, so h leaves GEMM1 unquantized
(fp32, or bf16) and `launch._quantize_rows` quantizes it.

Data flow: DeepSeek-V3-like layer (FP8 block-128 W8A8, CONCAT, SiLU) -> routing -> `align_routing(64)`
-> x's FP8 rows (`wgmma_fp8._sorted_fp8_rows`) -> [engine] `_fp8_gemm1` -> h FP8 + scales
                                                -> [prototype] `_gemm1_rows128` over `paired_blocks` (128-row
                                                   blocks; an expert's odd last 64 rows leave the second
                                                   warpgroup idle) -> h [R, I] -> `_quantize_rows`.
Each math warpgroup: 64 rows, a gate and an up accumulator [64, 64], each K-step's two products promoted
while the next step's wgmma run (the engine's windows of two K-steps, nothing in flight across the loop's
back-edge); the TMA producer and ring are the engine's (`_details.wgmma_fp8`).

Usage:
  python benchmarks/proto_gluon_fp8_gemm1.py --compile-only
  python benchmarks/proto_gluon_fp8_gemm1.py --preset deepseek-v3 --tokens 1024,4096,16384
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.gemm import _grouped_pid
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _loader,
    _mma_layout,
    _release_stages,
    _ring,
)

HALF_N = gl.constexpr(64)  # gate columns (and up columns) a program: half a 128-row weight scale block


@gluon.jit
def _issue_gate_up(k, ring, A_ROW0: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Wait for stage k, start this warpgroup's gate and up wgmma (64 rows from A_ROW0 x 64 columns each)."""
    a_smem, gate_smem, up_smem, ready, _ = ring
    s = k % NUM_STAGES
    mbarrier.wait(ready.index(s), (k // NUM_STAGES) & 1)
    a_tile = a_smem.index(s).slice(A_ROW0, ROWS_PER_WARPGROUP, dim=0)
    zero = gl.zeros([ROWS_PER_WARPGROUP, HALF_N], gl.float32, _mma_layout(HALF_N))
    gate = warpgroup_mma(a_tile, gate_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    up = warpgroup_mma(a_tile, up_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    return gate, up


@gluon.jit
def _promoted_gate_up(ring, scales, row0, KT: gl.constexpr, A_ROW0: gl.constexpr, NUM_STAGES: gl.constexpr):
    """(gate, up) fp32 [64, 64] each: sum over K-steps of each product times its x row scale and its
    weight block scale, step k's two products promoted while step k + 1's wgmma run."""
    empty = ring[4]
    a_scale_ptr, stride_asm, gate_scale_ptr, up_scale_ptr, stride_wsk = scales
    layout: gl.constexpr = _mma_layout(HALF_N)
    rows = row0 + A_ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
    a_scales = a_scale_ptr + rows.to(gl.int64) * stride_asm
    acc_g = gl.zeros([ROWS_PER_WARPGROUP, HALF_N], gl.float32, layout)
    acc_u = gl.zeros([ROWS_PER_WARPGROUP, HALF_N], gl.float32, layout)
    done_g = gl.zeros([ROWS_PER_WARPGROUP, HALF_N], gl.float32, layout)
    done_u = gl.zeros([ROWS_PER_WARPGROUP, HALF_N], gl.float32, layout)
    done_sg = gl.zeros([ROWS_PER_WARPGROUP], gl.float32, gl.SliceLayout(1, layout))
    done_su = gl.zeros([ROWS_PER_WARPGROUP], gl.float32, gl.SliceLayout(1, layout))
    for i in range(0, KT // 2):
        k = 2 * i
        g1, u1 = _issue_gate_up(k, ring, A_ROW0, NUM_STAGES)
        acc_g = acc_g + done_g * done_sg[:, None]
        acc_u = acc_u + done_u * done_su[:, None]
        g2, u2 = _issue_gate_up(k + 1, ring, A_ROW0, NUM_STAGES)
        sa1 = gl.load(a_scales + k)
        sg1 = sa1 * gl.load(gate_scale_ptr + k * stride_wsk)
        su1 = sa1 * gl.load(up_scale_ptr + k * stride_wsk)
        sa2 = gl.load(a_scales + k + 1)
        done_sg = sa2 * gl.load(gate_scale_ptr + (k + 1) * stride_wsk)
        done_su = sa2 * gl.load(up_scale_ptr + (k + 1) * stride_wsk)
        g1, u1 = warpgroup_mma_wait(num_outstanding=2, deps=(g1, u1))
        mbarrier.arrive(empty.index(k % NUM_STAGES), count=1)
        acc_g = acc_g + g1 * sg1[:, None]
        acc_u = acc_u + u1 * su1[:, None]
        done_g, done_u = warpgroup_mma_wait(num_outstanding=0, deps=(g2, u2))
        mbarrier.arrive(empty.index((k + 1) % NUM_STAGES), count=1)
    return acc_g + done_g * done_sg[:, None], acc_u + done_u * done_su[:, None]


@gluon.jit
def _gemm1_math(
    ring,
    scales,
    row0,
    h_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    ACTIVATION: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup: rows [ROW0, ROW0 + 64) of the block, act(gate, up) stored unquantized, or
    nothing but the ring's stages handed back if those rows are past the expert's end."""
    h_ptr, pid_n, stride_hm, rows_end = h_out
    if row0 + ROW0 >= rows_end:
        _release_stages((ring[0], ring[1], ring[3], ring[4]), KT, NUM_STAGES)
    else:
        gate, up = _promoted_gate_up(ring, scales, row0, KT, ROW0, NUM_STAGES)
        h = _gated_activation(gate, up, ACTIVATION, 0.0, False, 0.0)
        store_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])  # 16 bytes of fp32
        h = gl.convert_layout(h, store_layout)
        rows = row0 + ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, store_layout))
        cols = pid_n * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, store_layout))
        gl.store(h_ptr + rows.to(gl.int64)[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty))


@gluon.jit
def _gemm1_rows128(
    x_desc,  # fp8 [R, H] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * 2I, H], block [64, 128]
    x_scale_ptr,  # fp32 [R, H/128]
    w_scale_ptr,  # fp32 [E_local, 2I/128, H/128] (any strides)
    h_ptr,  # out [R, I] fp32 or bf16, unquantized
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]
    num_pid_m,
    stride_xsm,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_hm,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    ACTIVATION: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """h = act(x @ w13[e]^T) of one 128-row block and 64 columns (CONCAT: gate rows n, up rows I + n)."""
    gl.static_assert(w_desc.block_type.shape[0] == HALF_N)
    gl.static_assert(x_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, INTER_SIZE // HALF_N, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = gl.load(block_start_ptr + pid_m)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    KT: gl.constexpr = HIDDEN // SCALE_GROUP
    a_smem, weight_stages, ready, empty = _ring(x_desc, w_desc, 2, NUM_STAGES, 2)
    ring = (a_smem, weight_stages[0], weight_stages[1], ready, empty)
    block_scales = w_scale_ptr + expert.to(gl.int64) * stride_wse
    gate_row = expert * (2 * INTER_SIZE) + pid_n * HALF_N
    scales = (
        x_scale_ptr,
        stride_xsm,
        block_scales + ((pid_n * HALF_N) // SCALE_GROUP) * stride_wsn,
        block_scales + ((INTER_SIZE + pid_n * HALF_N) // SCALE_GROUP) * stride_wsn,
        stride_wsk,
    )
    h_out = (h_ptr, pid_n, stride_hm, rows_end)
    gl.warp_specialize(
        [
            (_gemm1_math, (ring, scales, row0, h_out, KT, 0, ACTIVATION, NUM_STAGES)),
            (_gemm1_math, (ring, scales, row0, h_out, KT, ROWS_PER_WARPGROUP, ACTIVATION, NUM_STAGES)),
            (
                _loader,
                (
                    (x_desc, w_desc),
                    a_smem,
                    weight_stages,
                    ready,
                    empty,
                    row0,
                    (gate_row, gate_row + INTER_SIZE),
                    KT,
                    NUM_STAGES,
                ),
            ),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )


def _tools():
    """tools/sass_report.py and tools/wgmma_hazard.py (offline sm_90 compiles and their checks)."""
    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import sass_report
    import wgmma_hazard

    return sass_report, wgmma_hazard


def compile_for_hopper(*, stages: int = 4, h_dtype: str = "fp32", hidden: int = 7168, inter: int = 2048):
    """`_gemm1_rows128` compiled for sm_90 (no GPU needed), DeepSeek-V3's shape, the engine's budgets."""
    sass_report, _ = _tools()

    from moekit.kernels.triton import wgmma_fp8 as host
    from moekit.kernels.triton._details.codes import ACT_SILU

    def descriptor(rows: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, host.TILE_K], gl.float8e4nv)
        return f"tensordesc<fp8e4nv[{rows}, {host.TILE_K}],{layout!r}>"

    pointers = dict(
        x_desc=descriptor(128), w_desc=descriptor(HALF_N.value), x_scale_ptr="*fp32", w_scale_ptr="*fp32"
    )
    pointers |= dict(
        h_ptr=f"*{h_dtype}", block_expert_ptr="*i32", block_start_ptr="*i32", num_blocks_ptr="*i32"
    )
    pointers["expert_end_ptr"] = "*i64"
    constants = dict(HIDDEN=hidden, INTER_SIZE=inter, ACTIVATION=ACT_SILU.value, GROUP_M=8, NUM_STAGES=stages)
    constants |= dict(MATH_REGISTERS=host.MATH_REGISTERS, LOAD_REGISTERS=host.LOAD_REGISTERS)
    return sass_report.compile_gluon_for_hopper(
        _gemm1_rows128, pointers=pointers, constants=constants, warps=4
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--stages", default="3,4")
    args = p.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    if args.compile_only:
        sass_report, _ = _tools()

        for s in stages:
            kernel = compile_for_hopper(stages=s)
            instructions = sass_report.all_instructions(kernel)
            loop = sass_report.mma_loop_instructions(instructions)
            loop_spills = sum(1 for _, t in loop if re.match(r"(LDL|STL)", sass_report.unpredicated(t)))
            print(
                f"{s} stages: {kernel.metadata.shared} B shared, "
                f"{sass_report.kernel_facts(kernel, instructions)['local_memory_ops']} spill ops "
                f"({loop_spills} in the K-loop of {len(loop)}), "
                f"{sass_report.issued_under_mma(loop)} K-loop instructions under the wgmma",
                flush=True,
            )
        return 0
    from proto_gluon_fp8_gemm1_run import run  # the GPU half

    return run(args.preset, [int(t) for t in args.tokens.split(",")], stages)


if __name__ == "__main__":
    raise SystemExit(main())
