#!/usr/bin/env python3
"""One preset's layer at one T, run eagerly twice, for Nsight Compute to profile the second call's
kernels (the first compiles and warms up). It prints the planned config; `ncu` prints the rest.

Usage (GPU; ncu replays each kernel with caches flushed, clocks left alone):
  ncu --clock-control none -k regex:'^_moe_gemm[12]$' --launch-skip 2 --launch-count 2 \\
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
      --section SchedulerStats --section MemoryWorkloadAnalysis \\
      python3 benchmarks/ncu_layer.py --preset gpt-oss-120b --tokens 1
(`--launch-skip 2` skips the first call's two GEMMs; a split-K or tail-block plan launches more.)
"""

import argparse

import torch

from moekit.app.bench import prepared_weights, whole_layer
from moekit.kernels.base import DeviceInfo
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.synthetic import random_batch, random_layer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-120b", help='a preset, or "preset@ExKxHxI" (another shape)')
    p.add_argument("--tokens", type=int, default=1)
    args = p.parse_args()
    device = torch.device("cuda")
    spec = preset_at(args.preset)
    layer = random_layer(spec, seed=0, device=device)
    chosen = plan(spec, num_tokens=args.tokens, device=DeviceInfo.of(device))
    print(f"{args.preset} T={args.tokens}: {chosen.config}", flush=True)
    weights = prepared_weights(chosen, layer, {})
    x, logits, _ = random_batch(
        spec, args.tokens, correction_bias=layer.correction_bias, seed=args.tokens, device=device
    )
    layer_fn = whole_layer(chosen, layer, weights, x, logits, check_values=False)
    for _ in range(2):
        layer_fn()
        torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
