"""Align stage alone (chunked counting sort + tail split), graph replay with L2 flushed: us per call."""
import sys
import torch
from moekit.app.bench import flushed_seconds
from moekit.kernels.triton.align import AlignMethod, align_routing, split_tail_blocks

dev = torch.device("cuda")
flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=dev)
tag = sys.argv[1]
for e, k, bm, tails, ts in [
    (128, 8, 64, False, (256, 1024, 4096, 16384)),
    (128, 4, 128, False, (512, 2048, 8192)),
    (256, 8, 64, True, (1024, 4096, 16384)),
    (512, 10, 64, False, (128, 1024, 8192)),
    (8, 2, 128, False, (1024, 16384)),
]:
    for t in ts:
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices.to(torch.int32)
        def fn():
            a = align_routing(ids, num_local_experts=e, block_m=bm, method=AlignMethod.CHUNKED)
            return split_tail_blocks(a) if tails else a
        us = flushed_seconds(fn, dev, flush, repeats=20) * 1e6
        print(f"{tag} E={e} K={k} bm={bm} tails={int(tails)} T={t}: {us:.1f} us", flush=True)
