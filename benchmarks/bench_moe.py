#!/usr/bin/env python3
"""Benchmark moekit's planned kernel and the unfused baseline per preset and T, on one GPU, in one run.

Usage (GPU):
  python benchmarks/bench_moe.py --presets gpt-oss-120b --tokens 1,8,64 --json bench-results/moekit.json
Optionally merges OpenAI triton_kernels' figures (peers/bench_triton_kernels.py --json, run on the same GPU
in the same session) with --peer-json, to print the ratio table side by side. Writes a file only where
--json says (bench-results/ is git-ignored); benchmarks/README.md says how each published figure is made.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moekit.app.bench import DEFAULT_TOKENS, BenchRecord, bench_preset, measure_ceilings, records_as_json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", default="gpt-oss-120b")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--kernels", default="planned,torch_grouped")
    p.add_argument("--json", default=None, help="write the records here, e.g. bench-results/moekit.json")
    p.add_argument("--peer-json", default=None, help="triton_kernels bench JSON to compare against")
    p.add_argument("--table-only", default=None, help="print the table of an earlier --json run and exit")
    args = p.parse_args()
    if args.table_only:
        with open(args.table_only) as f:
            records = [BenchRecord(**r) for r in json.load(f)["records"]]
        peer = {}
        if args.peer_json:
            with open(args.peer_json) as f:
                peer = _peer_us(json.load(f))
        print_table(records, peer)
        return 0
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"ceilings: {ceilings.summary()} on {torch.cuda.get_device_name()}", flush=True)
    tokens = tuple(int(t) for t in args.tokens.split(","))
    records = []
    for name in args.presets.split(","):
        start = time.time()
        records += bench_preset(
            name,
            tokens=tokens,
            kernels=tuple(args.kernels.split(",")),
            ceilings=ceilings,
            device=device,
            progress=lambda r: print(
                f"  {r.preset} T={r.tokens} {_kernel_label(r)}: {r.us:.1f} us, {r.pct_roofline:.0f}% "
                f"roofline, rel L2 {r.rel_l2:.1e} {'ok' if r.ok else 'FAIL'}",
                flush=True,
            ),
        )
        print(f"{name}: {time.time() - start:.0f} s", flush=True)
    data = records_as_json(records, ceilings)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    peer = {}
    if args.peer_json:
        with open(args.peer_json) as f:
            peer = _peer_us(json.load(f))
    print_table(records, peer)
    return 0 if all(r.ok for r in records) else 1


def _peer_us(data) -> dict[int, float]:
    """T -> µs of the peer (CUDA-graph time where it has one, else eager)."""
    out = {}
    for row in data.get("rows", []):
        us = row.get("tk_layer_graph_us") or row.get("tk_layer_us")
        if us:
            out[int(row["M"])] = float(us)
    return out


def _kernel_label(record) -> str:
    """The kernel's name, and its GEMM engine where that is not the default tl.dot one."""
    engine = record.config.get("engine", "TL_DOT") if record.config else "TL_DOT"
    return record.kernel if engine == "TL_DOT" else f"{record.kernel} ({engine})"


def print_table(records, peer):
    by = {}
    for r in records:
        by.setdefault((r.preset, r.tokens), {})[r.kernel] = r
    print(
        "| preset | T | moekit kernel | µs | % roofline | TB/s | base µs | base/moekit |"
        + (" peer µs | peer/moekit |" if peer else "")
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if peer else ""))
    for (name, t), ks in by.items():
        main_r = next((r for k, r in ks.items() if k != "torch_grouped"), ks.get("torch_grouped"))
        base = ks.get("torch_grouped")
        row = (
            f"| {name} | {t} | {_kernel_label(main_r)} | {main_r.us:.1f} | {main_r.pct_roofline:.0f} | "
            f"{main_r.tb_per_s:.2f} | {base.us if base else float('nan'):.1f} | "
            f"{(base.us / main_r.us) if base else float('nan'):.2f} |"
        )
        if peer:
            pu = peer.get(t)
            row += f" {pu or float('nan'):.1f} | {(pu / main_r.us) if pu else float('nan'):.2f} |"
        print(row)


if __name__ == "__main__":
    sys.exit(main())
