#!/usr/bin/env python3
"""The WGMMA_WORDS engine's GEMMs compiled for sm_90 (no GPU) at several layer shapes: each K-loop's
length, spills and instructions under the MMA, the figures its 128-register budget is judged by.

Data flow: (H, I) shapes x GEMM 1 / 2 x pairs a program -> `hopper_compile.compile_wgmma_words_for_hopper`
(gpt-oss's math, the launch's register cap) -> `sass_report.mma_loops` -> one line a K-loop.

Usage: python tools/words_engine_report.py --shapes 2880x2880,7168x2048,4096x1536 --pairs 128,256
"""

from __future__ import annotations

import argparse
import re

import hopper_compile
import sass_report


def loop_lines(kernel) -> list[dict]:
    """One dict a K-loop of a compiled engine GEMM (`hopper_compile.compile_wgmma_words_for_hopper`): the
    kernel's registers, the loop's instructions, its local loads / stores (spills) and how many of its
    instructions issue while its wgmma is in flight."""
    instructions = sass_report.all_instructions(kernel)
    registers = sass_report.kernel_facts(kernel, instructions)["registers"]
    lines = []
    for loop in sass_report.mma_loops(instructions):
        ops = [sass_report.unpredicated(t) for _, t in loop]
        lines.append(
            dict(
                registers=registers,
                loop=len(ops),
                spills=sum(1 for op in ops if re.match(r"(LDL|STL)\b", op)),
                waits=len(sass_report.wgmma_waits(loop)),
                under_mma=sass_report.issued_under_mma(loop),
            )
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2880x2880,7168x2048,4096x1536", help="HxI, comma-separated")
    p.add_argument("--pairs", default="128,256", help="block_m values (pairs a program)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--half-wide", action="store_true", help="the kernels with a half-wide tile (two K-loops)")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        hidden, inter = (int(v) for v in shape.split("x"))
        for block_m in (int(v) for v in args.pairs.split(",")):
            for gemm in (1, 2):
                kernel = hopper_compile.compile_wgmma_words_for_hopper(
                    gemm,
                    block_m=block_m,
                    stages=args.stages,
                    hidden=hidden,
                    inter=inter,
                    half_wide=args.half_wide,
                )
                for line in loop_lines(kernel):
                    print(
                        f"H x I {shape} GEMM{gemm} {block_m} pairs: {line['registers']} registers, "
                        f"K-loop {line['loop']} instructions, {line['spills']} local loads / stores, "
                        f"{line['under_mma']} under the MMA",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
