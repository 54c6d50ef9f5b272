"""Measure the collectives the parallel layers call; fit the cost model's latency and bus bandwidth.

Data flow: torchrun starts N ranks -> init_process_group(--backend) -> for each collective
(all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single) and each size S (bytes of
the per-rank buffer as nccl-tests counts it: all-gather's output, reduce-scatter's input, all-reduce's
buffer, all-to-all's send buffer) -> median µs per call (`moekit.app.timing.median_seconds`: CUDA events
on a GPU, the wall clock on a CPU), the slowest rank's -> bus bandwidth = bytes sent / time (S (N-1)/N,
2 S (N-1)/N for all-reduce) -> latency = median time of the small sizes; bus bandwidth = least squares of
(time - latency) against bytes sent over the large sizes -> rank 0 prints a table and writes the JSON that
`moekit.ep.constants.load_collectives` reads (--out).

    torchrun --nproc-per-node 2 benchmarks/fit_collectives.py --out bench-results/collectives.json
    torchrun --nproc-per-node 2 benchmarks/fit_collectives.py --backend gloo --device cpu --max-bytes 1MB
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from moekit.app.bench_parallel import exit_torchrun_group
from moekit.app.timing import median_seconds
from moekit.ep.constants import (
    Collective,
    CollectiveConstants,
    CollectiveTable,
    Sample,
    Source,
    collectives_as_dict,
)

# The names the engines call (moekit.ep.engines): newer torch spells them *_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'8KB', '1MB', '1GB', '4096' -> bytes (binary units)."""
    upper = text.strip().upper()
    for unit in ("KB", "MB", "GB", "B", ""):
        if upper.endswith(unit) and upper[: len(upper) - len(unit)].strip().isdigit():
            return int(upper[: len(upper) - len(unit)]) * _UNITS[unit]
    raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 8KB, 64MB, 1GB or a byte count")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("8KB"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("1GB"))
    p.add_argument("--factor", type=int, default=4, help="each size is the previous times this (default 4)")
    p.add_argument(
        "--latency-max", type=parse_bytes, default=parse_bytes("1MB"), help="sizes that fit latency"
    )
    p.add_argument("--bandwidth-min", type=parse_bytes, default=parse_bytes("64MB"), help="sizes that fit BW")
    p.add_argument("--repeats", type=int, default=10, help="calls per timed batch (fewer above 64 MB)")
    p.add_argument("--machine", default=None, help="name of the machine in the table (default: the device)")
    p.add_argument("--out", type=Path, default=None, help="write the constants table here (rank 0)")
    return p.parse_args(argv)


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    return [*out, hi]


def _bus_fraction(kind: Collective, world: int) -> float:
    """Bytes one rank sends per byte of S (nccl-tests' bus bandwidth factor)."""
    return (2 if kind is Collective.ALL_REDUCE else 1) * (world - 1) / world


def _call(kind: Collective, size: int, world: int, device: torch.device):
    """A zero-argument call of `kind` on a buffer of `size` bytes per rank (rounded to world * 4 bytes)."""
    n = max(world, size // 4 // world * world)  # fp32 elements, divisible by the world size
    big = torch.ones(n, dtype=torch.float32, device=device)
    small = torch.ones(n // world, dtype=torch.float32, device=device)
    if kind is Collective.ALL_GATHER:
        return lambda: _all_gather(big, small)
    if kind is Collective.REDUCE_SCATTER:
        return lambda: _reduce_scatter(small, big)
    if kind is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(big)
    out = torch.empty_like(big)
    return lambda: dist.all_to_all_single(out, big)


def measure(kind: Collective, size: int, world: int, device: torch.device, repeats: int) -> float:
    """Median µs per call, the slowest rank's."""
    reps = repeats if size <= 64 << 20 else max(1, repeats // 4)
    seconds = median_seconds(_call(kind, size, world, device), device, repeats=reps, batches=5, warmup=2)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item()) * 1e6


def fit(points: list[tuple[int, float]], kind: Collective, world: int, args) -> CollectiveConstants:
    """Latency from small sizes, bus bandwidth from large ones; (size, µs) points, ascending size."""
    large = [(s, us) for s, us in points if s >= args.bandwidth_min] or points[-2:]
    small = [us for s, us in points[: len(points) - 2] if s <= args.latency_max] or [points[0][1]]
    latency = statistics.median(small)
    frac = _bus_fraction(kind, world)
    sent = [s * frac for s, _ in large]
    extra = [max(us - latency, 1e-3) for _, us in large]
    # time - latency = bytes / (B * 1e3) with B in GB/s: least squares through the origin.
    bandwidth = sum(b * b for b in sent) / sum(b * e for b, e in zip(sent, extra, strict=True)) / 1e3
    used = f"{len(small)} sizes <= {args.latency_max} B; bandwidth from {len(large)} sizes >= {large[0][0]} B"
    samples = tuple(Sample(bytes=s, us=us, bus_bandwidth_GBps=s * frac / us / 1e3) for s, us in points)
    return CollectiveConstants(
        latency_us=latency, bus_bandwidth_GBps=bandwidth, note=f"latency from {used}", samples=samples
    )


def _source(args, world: int, device: torch.device) -> Source:
    cuda = device.type == "cuda"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and args.backend == "nccl" else None
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    script = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return Source(
        description=f"fit_collectives.py, {world}x {name}, {args.backend}, torch {torch.__version__}",
        device=name,
        backend=args.backend,
        torch=torch.__version__,
        nccl=nccl,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=f"torchrun --nproc-per-node {world} benchmarks/{script}",
    )


def main(argv: list[str] | None = None) -> NoReturn:
    args = _args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(args.backend)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if args.device == "cuda"
            else torch.device("cpu")
        )
        grid = sizes(args.min_bytes, args.max_bytes, args.factor)
        fitted, rows = {}, []
        for kind in Collective:
            points = [(s, measure(kind, s, world, device, args.repeats)) for s in grid]
            fitted[kind] = fit(points, kind, world, args)
            rows += [(kind.value, s, us, s * _bus_fraction(kind, world) / us / 1e3) for s, us in points]
        if rank == 0:
            source = _source(args, world, device)
            table = CollectiveTable(
                machine=args.machine or f"{world}x {source.device}",
                world_size=world,
                source=source,
                constants=fitted,
            )
            print(f"{'collective':<16}{'bytes':>12}{'us':>12}{'bus GB/s':>10}")
            for name, s, us, bus in rows:
                print(f"{name:<16}{s:>12}{us:>12.1f}{bus:>10.2f}")
            for kind, c in fitted.items():
                bus = c.bus_bandwidth_GBps
                print(f"fit {kind.value:<15} latency {c.latency_us:8.1f} us  bus bandwidth {bus:8.2f} GB/s")
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(collectives_as_dict(table), indent=1) + "\n")
                print(f"wrote {args.out}")
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_torchrun_group(0)


if __name__ == "__main__":
    main()
