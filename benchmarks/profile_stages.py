#!/usr/bin/env python3
"""Where a layer's time goes: GPU time per kernel (routing, align, GEMM1, GEMM2, reduction) of moekit's
planned path at each T, from a CUDA-graph replay traced with torch.profiler (CUPTI), L2 flushed before
every layer as the benchmarks do.

Usage (GPU):
  python benchmarks/profile_stages.py --preset gpt-oss-120b --tokens 1,64,1024 --json bench-results/p.json
Kernel names are grouped by the substrings in STAGES; the rest is listed as "other". Times are summed
GPU busy time per layer. The same run also times the layer itself (graph replay, L2 flushed, as
`bench_moe.py` does) and prints the difference, the GPU's idle time between the layer's kernels (launch
gaps), with the count of kernels a layer launches. `--preset` takes "name@ExKxHxI" too, `--act-quant` FP8
activations (W8A8, W4A8).
"""

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from moekit.app.bench import flushed_seconds, prepared_weights, profiled_kernels, whole_layer
from moekit.kernels.base import DeviceInfo
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.spec import ActivationQuant
from moekit.synthetic import random_batch, random_layer

STAGES = (
    ("_align", "align"),
    ("_moe_gemm1", "gemm1"),
    ("_moe_gemm2", "gemm2"),
    ("_moe_sum_k", "sum_k"),
)
FLUSH_NAME = "fill"  # the L2 flush writes a 256 MiB buffer


def _stage(name: str) -> str:
    for fragment, stage in STAGES:
        if fragment in name:
            return stage
    return "flush" if FLUSH_NAME in name.lower() else "other"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--tokens", default="1,8,64,512,1024,8192")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--act-quant", default=None, choices=[q.value for q in ActivationQuant], help="default: the preset's"
    )
    p.add_argument("--json", default=None, help="write the per-stage times here, e.g. bench-results/p.json")
    args = p.parse_args()
    device = torch.device("cuda")
    spec = preset_at(args.preset)
    if args.act_quant is not None:
        spec = replace(spec, act_quant=ActivationQuant(args.act_quant))
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    prepared = {}
    results = []
    for t in (int(v) for v in args.tokens.split(",")):
        chosen = plan(spec, num_tokens=t, device=info)
        weights = prepared_weights(chosen, layer, prepared)
        x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
        layer_fn = whole_layer(chosen, layer, weights, x, logits)
        per_stage: dict[str, float] = defaultdict(float)
        kernels: dict[str, float] = defaultdict(float)
        launches = 0
        for name, us in profiled_kernels(layer_fn, device, flush, repeats=args.repeats):
            per_stage[_stage(name)] += us
            kernels[name[:60]] += us
            launches += _stage(name) != "flush"
        per_stage.pop("flush", None)
        busy = sum(per_stage.values())
        layer_us = flushed_seconds(layer_fn, device, flush, repeats=args.repeats) * 1e6
        row = {
            "tokens": t,
            "config": chosen.config.as_dict(),
            "layer_us": layer_us,
            "busy_us": busy,
            "gaps_us": layer_us - busy,
            "kernels_per_layer": launches / args.repeats,
            "stages_us": dict(per_stage),
        }
        results.append(row)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_stage.items(), key=lambda kv: -kv[1]))
        print(
            f"T={t}: layer {layer_us:.1f} us = busy {busy:.1f} ({stages}) + gaps {layer_us - busy:.1f} "
            f"between {launches / args.repeats:.0f} kernels",
            flush=True,
        )
        named = sorted(((v, k) for k, v in kernels.items() if _stage(k) != "flush"), reverse=True)
        print("   kernels: " + "; ".join(f"{k} {v:.1f}" for v, k in named), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "time": time.time(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
