#!/usr/bin/env python3
"""One block a pair against the alignment at few tokens: the whole layer (routing included, the planned
config) with the block choice forced each way, graph replay with L2 flushed, the two interleaved
twice, and the draw's repeated experts beside `block_choice.expected_repeats`. What the constants of
`moekit.kernels.triton.block_choice` were fitted on.

Usage (GPU):
  python3 benchmarks/bench_block_choice.py --presets qwen3-30b-a3b@512x10x2048x512,gpt-oss-120b --tokens 2,3,4
"""

import argparse
from unittest import mock

import torch

from moekit.app.bench import flushed_seconds, prepared_weights, whole_layer
from moekit.kernels.base import DeviceInfo
from moekit.kernels.triton import align
from moekit.kernels.triton.block_choice import expected_repeats
from moekit.ops import route
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.synthetic import random_batch, random_layer

PATHS = {"aligned": False, "one block a pair": True}
PRESETS = "qwen3-30b-a3b@512x10x2048x512,gpt-oss-120b,deepseek-v3,qwen3-30b-a3b"


def _forced(one_block: bool):
    """A stand-in for `takes_one_block_per_pair` that always answers `one_block`."""

    def choice(**_: object) -> bool:
        return one_block

    return choice


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=PRESETS)
    p.add_argument("--tokens", default="2,3,4,6,8")
    args = p.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
    for name in args.presets.split(","):
        spec = preset_at(name)
        layer = random_layer(spec, seed=0, device=device)
        for t in (int(v) for v in args.tokens.split(",")):
            chosen = plan(spec, num_tokens=t, device=DeviceInfo.of(device))
            weights = prepared_weights(chosen, layer, {})
            x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
            ids = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias).ids
            repeats = ids.numel() - len(set(ids.flatten().tolist()))
            layer_fn = whole_layer(chosen, layer, weights, x, logits, check_values=False)
            times = {path: [] for path in PATHS}
            for _ in range(2):
                for path, one_block in PATHS.items():
                    # align.gemm_blocks asks at graph capture: the choice is in the graph it times
                    with mock.patch.object(align, "takes_one_block_per_pair", _forced(one_block)):
                        times[path].append(flushed_seconds(layer_fn, device, flush, repeats=20) * 1e6)
            mean = {path: sum(v) / len(v) for path, v in times.items()}
            expected = expected_repeats(num_pairs=t * spec.K, num_local_experts=spec.E_local)
            print(
                f"{name} T={t}: repeats {repeats} (expected {expected:.1f}); "
                + "; ".join(f"{path} {v[0]:.1f} / {v[1]:.1f} us" for path, v in times.items())
                + f"; aligned / one block {mean['aligned'] / mean['one block a pair']:.3f}",
                flush=True,
            )
        del layer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
