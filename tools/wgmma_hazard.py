#!/usr/bin/env python3
"""Offline check (no GPU) for the write-after-read hazard on register A operands of in-flight wgmma.

A Hopper wgmma with its A operand in registers (`HGMMA ... R_c, R_a, gdesc, R_c`) may still read R_a
after it is issued; PTX calls any write to those registers before a `wgmma.wait_group` that covers the
instruction undefined behaviour. Triton's pipeliner waits with `pendings = dots per iteration - 1`
(triton-lang/triton#9433), which leaves the later wgmma groups of one K-step in flight while the next
K-step's decode writes registers; `_details.matmul._wait_for_mma` closes that gap.

Data flow: a GEMM tile -> `hopper_compile.compile_gemm` (sm_90, offline) -> its SASS -> `simulate`
follows the wgmma groups in flight through the kernel (the K-loop twice) -> every instruction that
writes an A register of a group no wait has yet covered.

Reading: a count above zero means the schedule relies on timing (the wgmma reading its registers before
the decode overwrites them), not on a wait.
Usage: python tools/wgmma_hazard.py --gemm 1 --block 128,64,64 [--warps 4 --stages 3]
"""

from __future__ import annotations

import argparse
import re

import hopper_compile
import sass_report
import triton


def _written_registers(op: str) -> set[int]:
    """General registers an instruction writes: its first operand, widened by the access size."""
    fields = op.replace(",", " ").split()
    if len(fields) < 2 or fields[0].startswith(("HGMMA", "ST", "BRA", "BAR", "WARPGROUP", "DEPBAR")):
        return set()
    dst = re.fullmatch(r"R(\d+)", fields[1])
    if not dst:
        return set()
    name = fields[0]
    width = 4 if ".128" in name else 2 if (".64" in name or ".WIDE" in name) else 1
    return {int(dst.group(1)) + i for i in range(width)}


def simulate(kernel) -> dict:
    """Walk the kernel in program order, the K-loop twice (the second pass sees the groups the first
    leaves in flight): each HGMMA adds its four A registers to the open wgmma group, which `gsb0`
    closes; `WARPGROUP.DEPBAR.LE gsb0, N` leaves the last N groups in flight. Any other instruction
    that writes an A register of an in-flight group is listed (address, instruction)."""
    instructions = sass_report.all_instructions(kernel)
    loop = sass_report.loop_instructions(kernel, instructions)
    first, last = loop[0][0], loop[-1][0]
    before = [i for i in instructions if i[0] < first]
    after = [i for i in instructions if i[0] > last]
    in_flight, current, writes, depths = [], set(), [], set()
    for address, text in before + loop + loop + after:
        op = sass_report.unpredicated(text)
        a_reg = re.match(r"HGMMA\S+\s+R\d+, R(\d+),", op)
        if a_reg:
            current |= {int(a_reg.group(1)) + i for i in range(4)}
            if "gsb0" in op:
                in_flight.append(current)
                current = set()
            continue
        wait = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", op)
        if wait:
            n = int(wait.group(1), 16)
            in_flight = in_flight[len(in_flight) - n :] if n else []
            if first <= address <= last:
                depths.add(n)
            continue
        if _written_registers(op) & set().union(current, *in_flight):
            writes.append(f"{address:#06x} {op}")
    return {"wait_depths": sorted(depths), "writes": sorted(set(writes))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm", type=int, choices=(1, 2), default=1)
    p.add_argument("--block", default="128,64,64", help="block_m,block_n,block_k")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    args = p.parse_args()
    block = tuple(int(v) for v in args.block.split(","))
    report = simulate(hopper_compile.compile_gemm(args.gemm, "words", block, args.warps, args.stages))
    print(
        f"Triton {triton.__version__} GEMM{args.gemm} words {block} warps {args.warps} stages {args.stages}: "
        f"wait depths in the K-loop {report['wait_depths']}, "
        f"{len(report['writes'])} writes to A registers of possibly in-flight wgmma"
    )
    for line in report["writes"][:6]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
