"""One block a pair against the alignment at few pairs: the layer (routing included) with
SPARSE_PAIRS_PER_EXPERT at 0 (aligned unless one token) and at 1 (one block a pair), graph replay,
L2 flushed, interleaved twice; also the duplicate (token, expert) pairs of the draw."""
import torch
from moekit.app.bench import flushed_seconds, prepared_weights, whole_layer
from moekit.kernels.base import DeviceInfo
from moekit.kernels.triton import align
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.ops import route
from moekit.synthetic import random_batch, random_layer

dev = torch.device("cuda")
flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=dev)
cases = [("qwen3-30b-a3b@512x10x2048x512", (2, 4, 6, 8)), ("gpt-oss-120b", (2, 3, 4)), ("deepseek-v3", (2, 4)),
         ("qwen3-30b-a3b", (2, 3, 4)), ("qwen3-30b-a3b@256x8x2048x768", (2, 4))]
for name, ts in cases:
    spec = preset_at(name)
    layer = random_layer(spec, seed=0, device=dev)
    for t in ts:
        chosen = plan(spec, num_tokens=t, device=DeviceInfo.of(dev))
        w = prepared_weights(chosen, layer, {})
        x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=dev)
        r = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias)
        ids = r.ids.flatten().tolist()
        dup = len(ids) - len(set(ids))
        fn = whole_layer(chosen, layer, w, x, logits, check_values=False)
        res = {0.0: [], 1.0: []}
        for _ in range(2):
            for c in (0.0, 1.0):
                align.SPARSE_PAIRS_PER_EXPERT = c
                res[c].append(flushed_seconds(fn, dev, flush, repeats=20) * 1e6)
        a, o = sum(res[0.0]) / 2, sum(res[1.0]) / 2
        print(f"{name} T={t} P/E={t * spec.K / spec.E:.3f} dup={dup}: aligned {res[0.0][0]:.1f}/{res[0.0][1]:.1f} one-block {res[1.0][0]:.1f}/{res[1.0][1]:.1f} aligned/one {a / o:.3f}", flush=True)
    del layer
    torch.cuda.empty_cache()
