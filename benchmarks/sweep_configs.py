#!/usr/bin/env python3
"""Time the Triton path of one preset under many configs per T (whole layer, CUDA-graph replay, L2
flushed, checked against the reference): what `default_config` and the tuned rows are chosen from.

Usage (GPU):
  python benchmarks/sweep_configs.py --preset gpt-oss-120b --tokens 1,64,1024 --json $OUT/sweep.json
Candidates: the Triton kernel's `tuning_space`. With --table, each T's fastest candidate whose output
(NaN-poisoned, graph-replayed) is within the tolerance of the reference is written as a tuned row.
Unlike `moekit tune` (eager timing, warm L2), this times what serving sees: graph replay, cold L2.
"""

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moekit.bench import _flushed_seconds, _graph, _problem, _record, measure_ceilings
from moekit.kernels.base import DeviceInfo
from moekit.kernels.registry import default_registry
from moekit.kernels.triton.launch import TritonMoEConfig
from moekit.ops import fused_moe, prepare_weights
from moekit.plan import plan
from moekit.presets import cap_experts, preset
from moekit.reference import TOLERANCE, fused_moe_reference, relative_l2_error
from moekit.routing import route
from moekit.synthetic import random_batch, random_layer
from moekit.tuned import row_to_json, triton_version, write_rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--experts", type=int, default=None, help="cap E (memory), as `moekit bench`")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--table", default=None, help="write each T's verified winner to this tuned table")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new T after this long")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    spec = preset(args.preset)
    spec = cap_experts(spec, args.experts)
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
        space = kernel.tuning_space(spec, _problem(t, info))
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
            if args.table:
                winner = TritonMoEConfig(**best["config"])
                write_rows(
                    Path(args.table),
                    [
                        row_to_json(
                            spec=spec,
                            device=info.name,
                            triton=triton_version(),
                            tokens=t,
                            kernel="triton_fused",
                            config=winner,
                        )
                    ],
                )
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
