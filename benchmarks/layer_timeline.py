#!/usr/bin/env python3
"""Each kernel of one planned layer in a single CUDA-graph replay, with its start relative to the previous
kernel's end (the GPU's idle time between them) and its duration, next to the event-timed replays of the
same graph (warm L2, one layer a graph). `profile_stages.py`'s "gaps" subtract kernel times of one
profiled replay from the flushed, sustained timing; this says whether the GPU actually idles.

Usage (GPU):
  python benchmarks/layer_timeline.py --preset gpt-oss-120b --tokens 16384 --act-quant fp8_per_token,none
"""

import argparse
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from moekit.app.bench import capture_graph, prepared_weights, whole_layer
from moekit.kernels.base import DeviceInfo
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.spec import ActivationQuant
from moekit.synthetic import random_batch, random_layer


def _timeline(graph) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every kernel of one profiled replay of `graph`, in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = prof.profiler.kineto_results.events()
    kernels = [e for e in events if e.device_type() == cuda and e.duration_ns() > 0]
    return sorted((e.start_ns(), e.end_ns(), e.name()) for e in kernels)


def _replay_us(graph, repeats: int = 5) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-120b", help='a preset, or "name@ExKxHxI"')
    p.add_argument("--tokens", default="16384")
    p.add_argument(
        "--act-quant", default=None, help="comma-separated ActivationQuant values; the preset's if absent"
    )
    args = p.parse_args()
    device = torch.device("cuda")
    base = preset_at(args.preset)
    quants = (
        [base.act_quant]
        if args.act_quant is None
        else [ActivationQuant(q) for q in args.act_quant.split(",")]
    )
    for quant in quants:
        spec = replace(base, act_quant=quant)
        layer = random_layer(spec, seed=0, device=device)
        for t in (int(v) for v in args.tokens.split(",")):
            chosen = plan(spec, num_tokens=t, device=DeviceInfo.of(device))
            weights = prepared_weights(chosen, layer, {})
            x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
            graph, _ = capture_graph(whole_layer(chosen, layer, weights, x, logits), device)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            times = _replay_us(graph)
            kernels = _timeline(graph)
            busy = sum(e - s for s, e, _ in kernels) / 1e3
            span = (kernels[-1][1] - kernels[0][0]) / 1e3
            print(f"{args.preset} {quant.name} T={t}: replays {[round(v, 1) for v in times]} us")
            print(
                f"  one profiled replay: span {span:.1f} us, kernels {busy:.1f} us, idle {span - busy:.1f} us"
            )
            previous_end = None
            for s, e, name in kernels:
                gap = 0.0 if previous_end is None else (s - previous_end) / 1e3
                print(f"    gap {gap:7.1f} us  duration {(e - s) / 1e3:8.1f} us  {name[:60]}")
                previous_end = e
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
