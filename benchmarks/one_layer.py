#!/usr/bin/env python3
"""Run one preset's planned layer a few times, nothing else: a target for external profilers.

Usage (GPU): ncu --kernel-name regex:_moe_gemm1 --launch-skip 2 --launch-count 1 --section WarpStateStats \
    python benchmarks/one_layer.py --preset gpt-oss-120b --tokens 64
"""

import argparse

import torch

from moekit.app.bench import prepared_weights, whole_layer
from moekit.kernels.base import DeviceInfo
from moekit.planning.plan import plan
from moekit.presets import preset
from moekit.synthetic import random_batch, random_layer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    spec = preset(args.preset)
    layer = random_layer(spec, seed=0, device=device)
    chosen = plan(spec, num_tokens=args.tokens, device=DeviceInfo.of(device))
    bias = layer.correction_bias
    x, logits, _ = random_batch(spec, args.tokens, correction_bias=bias, seed=0, device=device)
    call = whole_layer(chosen, layer, prepared_weights(chosen, layer, {}), x, logits, check_values=False)
    for _ in range(args.iters):
        call()
    torch.cuda.synchronize(device)
    print(f"{args.preset} T={args.tokens}: {chosen.kernel} {chosen.config.as_dict()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
