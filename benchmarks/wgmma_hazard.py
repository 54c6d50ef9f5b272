#!/usr/bin/env python3
"""Offline check (no GPU) for the write-after-read hazard on register A operands of in-flight wgmma.

A Hopper wgmma with its A operand in registers (`HGMMA ... R_c, R_a, gdesc, R_c`) may still read R_a
after it is issued; PTX calls any write to those registers before a `wgmma.wait_group` that covers the
instruction undefined behaviour. Triton's pipeliner waits with `pendings = dots per iteration - 1`
(triton-lang/triton#9433), which leaves the later wgmma groups of one K-step in flight while the next
K-step's decode writes registers. This script compiles moekit's GEMMs for sm_90 (as
`sass_report.py`), finds the K-loop, and lists the instructions at the top of the next iteration that
write an A register of a wgmma group that the waits do not yet cover.

Reading: a count above zero means the schedule relies on timing (the wgmma reading its registers before
the decode overwrites them), not on a wait.
Usage: python benchmarks/wgmma_hazard.py --gemm 1 --block 128,64,64 [--warps 4 --stages 3]
"""

from __future__ import annotations

import argparse
import re

import sass_report
import triton


def hazard_report(kernel) -> dict:
    """wgmma groups of the K-loop, the wait depth, and the writes to A registers still possibly read."""
    body = [
        (address, sass_report.unpredicated(text)) for address, text in sass_report.loop_instructions(kernel)
    ]
    groups, current, depth = [], [], None
    for _, op in body:
        a_reg = re.match(r"HGMMA\S+\s+R\d+, R(\d+),", op)
        if a_reg:
            current.append(int(a_reg.group(1)))
        wait = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", op)
        if wait and current:
            groups.append(current)
            current, depth = [], int(wait.group(1), 16)
    if current:
        groups.append(current)
    # After the last wait of an iteration, `depth` groups may still be pending: the last `depth` ones.
    pending = groups[len(groups) - depth :] if depth else []
    in_flight = {r + i for group in pending for r in group for i in range(4)}
    writes = []
    for address, op in body:
        if op.startswith(("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR")):
            break  # the first wait or new wgmma of the next iteration
        fields = op.split()
        dst = re.match(r"R(\d+)", fields[1].rstrip(",")) if len(fields) > 1 else None
        if dst and int(dst.group(1)) in in_flight:
            writes.append(f"{address:#06x} {op}")
    return {"groups": len(groups), "wait_depth": depth, "in_flight_a_regs": len(in_flight), "writes": writes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm", type=int, choices=(1, 2), default=1)
    p.add_argument("--block", default="128,64,64", help="block_m,block_n,block_k")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    args = p.parse_args()
    block = tuple(int(v) for v in args.block.split(","))
    report = hazard_report(sass_report.compile_gemm(args.gemm, "words", block, args.warps, args.stages))
    print(
        f"Triton {triton.__version__} GEMM{args.gemm} words {block} warps {args.warps} stages {args.stages}: "
        f"{report['groups']} wgmma groups per K-step, wait depth {report['wait_depth']}, "
        f"{len(report['writes'])} writes to A registers of possibly in-flight wgmma before the next wait"
    )
    for line in report["writes"][:6]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
