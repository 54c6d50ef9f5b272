#!/usr/bin/env python3
"""The cost of `PlanOptions(batch_invariant=True)`: the same layer timed with the default plans and with
the batch-invariant plan, per preset and T, on one GPU.

Data flow: preset (E capped with --max-experts) -> one random layer -> two `FusedMoE`s on it (default
plans; batch-invariant) -> `warmup` -> per T: CUDA-graph replay of a forward (router included) timed with
`moekit.app.timing.median_seconds` -> a table: µs default, µs batch-invariant, ratio, and both configs.

Usage (GPU):
  python benchmarks/bench_batch_invariant.py --presets gpt-oss-20b,qwen3-30b-a3b --tokens 1,8,64,512,4096
"""

import argparse
import sys

import torch

from moekit.app.timing import median_seconds
from moekit.errors import UnsupportedSpecError
from moekit.layer import FusedMoE, PlanOptions
from moekit.presets import cap_experts, preset
from moekit.synthetic import random_layer, random_tokens


def _graphed(moe: FusedMoE, x: torch.Tensor):
    """A zero-argument replay of one captured forward of `moe` on `x`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        moe(x)  # the bucket is planned and compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        moe(x)
    return graph.replay


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", default="gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,64,512,4096")
    p.add_argument("--max-experts", type=int, default=None)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = [int(t) for t in args.tokens.split(",")]
    print("| preset | T | default µs | batch-invariant µs | ratio | default config | invariant config |")
    print("|---|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        spec = cap_experts(preset(name), args.max_experts)
        layer = random_layer(spec, seed=0, device=device)
        try:
            moes = _layers(spec, layer, device)
        except UnsupportedSpecError as err:  # a batch-invariant plan cannot hold for this spec here
            print(f"| {name} | - | - | refused | - | - | {str(err).splitlines()[0]} |", flush=True)
            continue
        for t in tokens:
            x = random_tokens(spec, t, seed=t, device=device)
            us = {
                flag: 1e6 * median_seconds(_graphed(moe, x), device, repeats=20) for flag, moe in moes.items()
            }
            cfg = {flag: _short(moe.plan_for(t).config.as_dict()) for flag, moe in moes.items()}
            print(
                f"| {name} | {t} | {us[False]:.1f} | {us[True]:.1f} | {us[True] / us[False]:.2f} | "
                f"{cfg[False]} | {cfg[True]} |",
                flush=True,
            )
    return 0


def _layers(spec, layer, device: torch.device) -> dict[bool, FusedMoE]:
    """The layer with the default plans (False) and with batch-invariant plans (True)."""
    return {
        flag: FusedMoE(
            spec=spec,
            weights=layer.weights,
            router_weight=layer.router_weight,
            correction_bias=layer.correction_bias,
            device=device,
            options=PlanOptions(batch_invariant=flag),
        )
        for flag in (False, True)
    }


def _short(config: dict) -> str:
    keys = ("block_m", "block_n", "block_k", "num_warps", "split_k", "tail_block_m", "swap_ab")
    return "/".join(str(config.get(k)) for k in keys)


if __name__ == "__main__":
    sys.exit(main())
