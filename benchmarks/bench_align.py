#!/usr/bin/env python3
"""The routing preparation alone: `align_routing` (chunked counting sort, or the method given) and, where
asked, the FP8 engine's `paired_blocks` or the tail split, per (E, K, block_m, T), as CUDA-graph
replays with L2 flushed before every call (the layer benchmarks' method), µs per call.

Usage (GPU):
  python3 benchmarks/bench_align.py                                  # the default cases
  python3 benchmarks/bench_align.py --cases 256x8x64:tails,512x10x64 --tokens 1024,4096
Random top-k ids (distinct experts per token). Compare two commits by running it under each
checkout's sources in the same device session.
"""

import argparse

import torch

from moekit.app.bench import flushed_seconds
from moekit.kernels.triton.align import AlignMethod, align_routing, paired_blocks, split_tail_blocks

DEFAULT_CASES = "128x8x64,128x4x128,256x8x64:tails,512x10x64,8x2x128"
LISTS = {"": None, "tails": split_tail_blocks, "paired": paired_blocks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES, help='"ExKxBLOCK_M[:tails|:paired]", comma-separated')
    p.add_argument("--tokens", default="256,1024,4096,16384")
    p.add_argument("--method", default="CHUNKED", choices=[m.name for m in AlignMethod])
    args = p.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
    method = AlignMethod[args.method]
    for case in args.cases.split(","):
        shape, _, lists = case.partition(":")
        e, k, block_m = (int(v) for v in shape.split("x"))
        after = LISTS[lists]
        for t in (int(v) for v in args.tokens.split(",")):
            ids = torch.rand(t, e, device=device).topk(k, dim=1).indices.to(torch.int32)

            def prepare(ids=ids, e=e, block_m=block_m, after=after):
                aligned = align_routing(ids, num_local_experts=e, block_m=block_m, method=method)
                return after(aligned) if after else aligned

            us = flushed_seconds(prepare, device, flush, repeats=20) * 1e6
            print(f"E={e} K={k} block_m={block_m} {lists or 'aligned'} T={t}: {us:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
