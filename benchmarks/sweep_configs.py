#!/usr/bin/env python3
"""Time the Triton path of one preset under many configs per T (whole layer, CUDA-graph replay, L2
flushed, checked against the reference): what `default_config` and the tuned rows are chosen from.

Usage (GPU):
  python benchmarks/sweep_configs.py --preset gpt-oss-120b --tokens 1,64,1024 --json bench-results/sweep.json
Candidates: the Triton kernel's `tuning_space`. With --table, each T's fastest candidate whose output
(NaN-poisoned, graph-replayed) is within the tolerance of the reference is written as a tuned row.
Unlike `moekit tune` (eager timing, warm L2), this times what serving sees: graph replay, cold L2.
"""

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moekit.app.bench import make_record, measure_ceilings, prepared_weights, time_plan, whole_layer
from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.planning.plan import plan
from moekit.planning.tuned import row_to_json, triton_version, write_rows
from moekit.presets import cap_experts, preset_at
from moekit.reference import fused_moe_reference
from moekit.synthetic import random_batch, random_layer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="gpt-oss-120b", help='a preset, or "preset@ExKxHxI" (another shape)')
    p.add_argument("--experts", type=int, default=None, help="cap E (memory), as `moekit bench`")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--table", default=None, help="write each T's verified winner to this tuned table")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new T after this long")
    p.add_argument("--json", default=None, help="write every timed candidate here (bench-results/...)")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="run each candidate once, untimed and unchecked: fills the Triton cache (several such processes "
        "in parallel compile on several CPU cores; the timed sweep after them only loads the binaries)",
    )
    p.add_argument(
        "--where",
        default=None,
        help='time only candidates with these fields, e.g. "block_k=128,num_warps=8" (the default always '
        "runs)",
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.03,
        help="a candidate replaces the (verified) default in the table only if this much faster: single "
        "timings of near-equal tiles differ by a few percent from run to run and with the routing drawn",
    )
    args = p.parse_args()
    device = torch.device("cuda")
    spec = cap_experts(preset_at(args.preset), args.experts)
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    kernel = default_registry().get("triton_fused")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    prepared: dict = {}  # time_plan's cache: one prepare_weights per (kernel, spec)
    if args.compile_only:
        return _compile_only(spec, layer, info, kernel, args.tokens, args.where, prepared, device)
    ceilings = measure_ceilings(device)
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
        base = replace(plan(spec, num_tokens=t, device=info), kernel="triton_fused")
        timed = []  # (config, record) of the candidates that ran
        for cfg in _candidates(kernel, spec, Problem(num_tokens=t, device=info), args.where):
            chosen = replace(base, config=cfg)
            try:
                sec, rel = time_plan(chosen, layer, x, logits, expected, prepared, flush, device)
            except Exception as err:  # noqa: BLE001 - a failing candidate is reported, the sweep goes on
                print(f"T={t} {cfg.as_dict()} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                torch.cuda.empty_cache()
                continue
            rec = make_record(args.preset, spec, chosen, t, hit, sec, rel, ceilings)
            timed.append((cfg, rec))
            print(f"T={t} {cfg.as_dict()} {rec.us:.1f} us {rec.pct_roofline:.0f}% rel {rel:.1e}", flush=True)
        verified = [(cfg, rec) for cfg, rec in timed if rec.ok]
        if verified:
            winner, best = _winner(timed, args.min_gain)
            if args.table:
                row = row_to_json(
                    spec=spec,
                    device=info.name,
                    triton=triton_version(),
                    tokens=t,
                    kernel=kernel.name,
                    config=winner,
                )
                write_rows(Path(args.table), [row])
            default_us = timed[0][1].us  # tuning_space lists the default first
            print(
                f"BEST T={t}: {best.us:.1f} us ({best.pct_roofline:.0f}% roofline) {winner.as_dict()}; "
                f"default {default_us:.1f} us",
                flush=True,
            )
        results.append({"tokens": t, "rows": [asdict(rec) for _, rec in timed]})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "ceilings": asdict(ceilings), "results": results}, f, indent=1)
    return 0


def _winner(timed: list, min_gain: float) -> tuple:
    """(config, record) for the table: the fastest verified candidate, unless the default (listed
    first) is verified and within `min_gain` of it."""
    verified = [(cfg, rec) for cfg, rec in timed if rec.ok]
    fastest = min(verified, key=lambda pair: pair[1].us)
    default = timed[0]
    if default[1].ok and fastest[1].us * (1 + min_gain) > default[1].us:
        return default
    return fastest


def _candidates(kernel, spec, problem, where: str | None) -> list:
    """`tuning_space`, the default first, then only the candidates whose fields match `where`."""
    space = list(kernel.tuning_space(spec, problem))
    if not where:
        return space
    wanted = dict(item.split("=", 1) for item in where.split(","))
    return space[:1] + [c for c in space[1:] if all(str(c.as_dict()[k]) == v for k, v in wanted.items())]


def _compile_only(spec, layer, info, kernel, tokens: str, where: str | None, prepared: dict, device) -> int:
    """Each candidate of each T run once (no timing, no check): its kernels compiled into the Triton cache."""
    for t in (int(v) for v in tokens.split(",")):
        x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
        base = replace(plan(spec, num_tokens=t, device=info), kernel="triton_fused")
        for cfg in _candidates(kernel, spec, Problem(num_tokens=t, device=info), where):
            chosen = replace(base, config=cfg)
            try:
                whole_layer(chosen, layer, prepared_weights(chosen, layer, prepared), x, logits)()
            except Exception as err:  # noqa: BLE001 - the timed sweep reports it again
                print(f"T={t} {cfg.as_dict()} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
    torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
