# temporary diagnostic, deleted before hand-off
import sys

import torch
import triton

import moekit.formats.fp8 as F

sys.path.insert(0, "tests")


def ieee_scale(amax):
    scale = (amax / torch.full_like(amax, F.FP8_E4M3_MAX)).clamp_min(F._MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


F._scale_from_amax = ieee_scale  # the fix proposed for moekit/formats/fp8.py
import pytest  # noqa: E402

rc = pytest.main(["tests/test_triton_gpu.py", "-q", "-p", "no:cacheprovider", "-x"])
print("pytest rc", rc, flush=True)
import test_triton_gpu as G  # noqa: E402

from moekit import RoutingResult  # noqa: E402
from moekit.kernels.triton.launch import TritonMoEConfig as C  # noqa: E402
from moekit.kernels.triton.launch import default_config, triton_fused_moe  # noqa: E402


def bench(spec, w, x, rw, ids, cfg, out):
    def fn():
        triton_fused_moe(x, w, RoutingResult(weights=rw, ids=ids), spec=spec, config=cfg, out=out)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=100) * 1e3


EXTRA = {"gpt-oss-20b": [C(16, 32, 128, 1, 4, 3), C(16, 64, 64, 1, 4, 3), C(16, 16, 128, 1, 4, 3),
                         C(64, 64, 128, 8, 4, 3), C(128, 64, 128, 8, 8, 3), C(128, 128, 64, 8, 8, 3)]}
for name in ("gpt-oss-20b", "qwen3-30b-a3b", "deepseek-v3-e16"):
    spec = G.SPECS[name][0]
    w = G._gpu_weights(spec, seed=1)
    per = sum(t[0].numel() * t.element_size() for t in w.tensors().values())
    for t in (1, 8, 64, 256, 1024, 4096):
        x, r = G._inputs(spec, t, seed=t)
        out = torch.empty(t, spec.H, dtype=spec.act_dtype, device="cuda")
        cfg = default_config(spec, t)
        us = bench(spec, w, x, r.weights, r.ids, cfg, out)
        hit = int(r.ids.unique().numel())
        line = (f"{name:16s} T={t:5d} hit={hit:3d} {us:8.1f} us {per * hit / (us * 1e-6) / 1e12:5.2f} TB/s "
                f"{2 * t * spec.K * 3 * spec.H * spec.I / (us * 1e-6) / 1e12:6.1f} TFLOP/s")
        for c in EXTRA.get(name, []):
            line += f" | ({c.block_m},{c.block_n},{c.block_k}) {bench(spec, w, x, r.weights, r.ids, c, out):7.1f}"
        print(line, flush=True)
