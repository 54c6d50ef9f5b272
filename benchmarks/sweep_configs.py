#!/usr/bin/env python3
"""Time the Triton path of one preset under many configs per T (whole layer, CUDA-graph replay, L2
flushed, checked against the reference): what `default_config` and the tuned rows are chosen from.

Usage (GPU):
  python benchmarks/sweep_configs.py --preset gpt-oss-120b --tokens 1,64,1024 --json $OUT/sweep.json
Candidates: `--space tuning` (the kernel's tuning_space), or `--space probe` (a short list around the
decode / prefill orientations, for exploring a kernel change quickly).
"""

import argparse
import json
import math
import time
from dataclasses import asdict, replace

import torch

from moekit.bench import _flushed_seconds, _graph, _problem, _record, measure_ceilings
from moekit.kernels.base import DeviceInfo
from moekit.kernels.registry import default_registry
from moekit.kernels.triton.launch import TritonMoEConfig, default_config
from moekit.ops import fused_moe, prepare_weights
from moekit.plan import plan
from moekit.presets import cap_experts, preset
from moekit.reference import TOLERANCE, fused_moe_reference, relative_l2_error
from moekit.routing import route
from moekit.synthetic import random_batch, random_layer


def probe_space(spec, t: int) -> list[TritonMoEConfig]:
    """The default, then both orientations over tiles suited to the tokens each expert sees."""
    per_expert = max(t, 1) * spec.K / spec.E_local
    if per_expert <= 16:
        tiles = [(16, n, k, 4) for n in (32, 64, 128) for k in (64, 128)]
    elif per_expert <= 64:
        tiles = [(32, 64, 64, 4), (32, 128, 64, 4), (64, 64, 64, 4), (64, 128, 64, 4), (64, 128, 64, 8)]
    else:
        tiles = [(m, n, 64, w) for m in (64, 128) for n in (64, 128) for w in (4, 8)]
    out = [default_config(spec, t)]
    for swap in (True, False):
        for bm, bn, bk, warps in tiles:
            out.append(
                TritonMoEConfig(
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    group_m=1 if bm == 16 else 8,
                    num_warps=warps,
                    num_stages=4 if bk == 64 else 3,
                    swap_ab=swap,
                )
            )
    unique = list(dict.fromkeys(out))
    return [c for c in unique if c.reason_unusable(spec) is None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--space", choices=("probe", "tuning"), default="probe")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new T after this long")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    spec = preset(args.preset)
    spec = cap_experts(spec, None)
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    kernel = default_registry().get("triton_fused")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    prepared = None
    results = []
    start = time.time()
    for t in (int(v) for v in args.tokens.split(",")):
        if time.time() - start > args.budget_s:
            print(f"budget spent: skipping T={t} and after", flush=True)
            break
        x, logits, routing = random_batch(
            spec, t, correction_bias=layer.correction_bias, seed=t, device=device
        )
        hit = int(routing.ids.unique().numel())
        expected = fused_moe_reference(x, layer.weights, routing, spec=spec)
        base = plan(spec, num_tokens=t, device=info)
        base = replace(base, kernel="triton_fused")
        if prepared is None:
            prepared = prepare_weights(layer.weights, base)
        space = (
            probe_space(spec, t)
            if args.space == "probe"
            else list(kernel.tuning_space(spec, _problem(t, info)))
        )
        rows = []
        for cfg in space:
            chosen = replace(base, config=cfg)

            def fn(chosen=chosen, x=x, logits=logits, weights=prepared):
                r = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias)
                return fused_moe(x, weights, r, plan=chosen)

            try:
                graph, out = _graph(fn, device)
                out.fill_(math.nan)
                graph.replay()
                torch.cuda.synchronize(device)
                rel = relative_l2_error(out, expected)
                del graph, out
                sec = _flushed_seconds(fn, device, flush, repeats=10 if t <= 1024 else 3)
                rec = _record(args.preset, spec, chosen, t, hit, sec, rel, ceilings)
                rows.append(asdict(rec))
                print(
                    f"T={t} {cfg.as_dict()} {rec.us:.1f} us {rec.pct_roofline:.0f}% rel {rel:.1e}", flush=True
                )
            except Exception as err:  # noqa: BLE001 - a failing candidate is reported, the sweep goes on
                print(f"T={t} {cfg.as_dict()} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                torch.cuda.empty_cache()
        ok = [r for r in rows if r["rel_l2"] <= TOLERANCE[spec.act_dtype]]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            default_us = rows[0]["us"] if rows else math.nan
            print(
                f"BEST T={t}: {best['us']:.1f} us ({best['pct_roofline']:.0f}% roofline) {best['config']}; "
                f"default {default_us:.1f} us",
                flush=True,
            )
        results.append({"tokens": t, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "ceilings": asdict(ceilings), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
