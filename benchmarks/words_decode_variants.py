#!/usr/bin/env python3
"""Time the MMA_WORDS_DECODE engine at several splits and queue depths side by side with the planned config
(a tuned row, else the default): whole layer, graph replay, L2 flushed, each run checked against the
reference.

Data flow: per case (preset, T): the planned config, then the engine at each `--variants` entry ->
one line a case: µs, % of roofline (experts hit) and rel L2 of each. A variant the engine refuses (a share
of K too long for shared memory, `words_decode.share_reason`) prints its reason.

Usage (GPU): python benchmarks/words_decode_variants.py --cases gpt-oss-120b:1,gpt-oss-20b:4 \\
    --variants 2/3,4/3,3/4
`--no-register-cap` runs every variant without `words_decode.register_cap` (to time what the cap gives).
`--variants space` takes the engine's candidates of `tuning_space` instead. With `--table`, a case's fastest
verified variant becomes its tuned row there when at least `--min-gain` faster than the planned config
(the rule of `sweep_configs.py`, against the config the plan runs today rather than the default).
Compile first with --compile-only to time without compile stalls.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", required=True, help="preset:T, comma-separated (preset may be name@ExKxHxI)")
    p.add_argument("--variants", default="2/3,3/3,4/3,2/4", help="split_k/depth, comma-separated")
    p.add_argument("--block-m", type=int, default=16, help="pairs an aligned M-block (16 or 32)")
    p.add_argument("--no-register-cap", action="store_true", help="launch without the register cap")
    p.add_argument("--compile-only", action="store_true", help="run each once, untimed (fills the cache)")
    p.add_argument("--table", default=None, help="write each case's verified winner to this tuned table")
    p.add_argument(
        "--min-gain", type=float, default=0.03, help="a winner's least gain over the planned config"
    )
    args = p.parse_args()

    import torch

    from moekit.app.bench import make_record, measure_ceilings, prepared_weights, time_plan, whole_layer
    from moekit.kernels.base import DeviceInfo
    from moekit.kernels.triton import words_decode
    from moekit.kernels.triton.config import MatmulEngine
    from moekit.kernels.triton.tuning import WORDS_DECODE_DEFAULT
    from moekit.kernels.triton.tuning_space import tuning_space
    from moekit.planning.plan import plan
    from moekit.planning.tuned import row_to_json, triton_version, write_rows
    from moekit.presets import preset_at
    from moekit.reference import fused_moe_reference
    from moekit.synthetic import random_batch, random_layer

    if args.no_register_cap:
        words_decode.register_cap = lambda n_tile, depth: None
    device = torch.device("cuda")
    info = DeviceInfo.of(device)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    ceilings = None if args.compile_only else measure_ceilings(device)
    for case in args.cases.split(","):
        preset, tokens = case.rsplit(":", 1)
        t = int(tokens)
        spec = preset_at(preset)
        layer = random_layer(spec, seed=0, device=device)
        prepared: dict = {}
        x, logits, routing = random_batch(
            spec, t, correction_bias=layer.correction_bias, seed=t, device=device
        )
        planned = replace(plan(spec, num_tokens=t, device=info), kernel="triton_fused")
        runs = [(f"planned {planned.config.engine.name}", planned.config)]
        if args.variants == "space":
            space = tuning_space(spec, t, info.multiprocessors, hopper=True)
            configs = [c for c in space if c.engine is MatmulEngine.MMA_WORDS_DECODE]
        else:
            configs = [
                replace(WORDS_DECODE_DEFAULT, block_m=args.block_m, split_k=int(s), num_stages=int(d))
                for s, d in (item.split("/") for item in args.variants.split(","))
            ]
        runs += [(f"s{c.split_k}/d{c.num_stages}", c) for c in configs]
        expected = None if args.compile_only else fused_moe_reference(x, layer.weights, routing, spec=spec)
        hit = int(routing.ids.unique().numel())
        row = [f"{preset} T={t}"]
        timed = []  # (config, record)
        for label, config in runs:
            reason = config.reason_unusable(spec)
            if reason is not None:
                row.append(f"{label} refused ({reason})")
                continue
            chosen = replace(planned, config=config)
            if args.compile_only:
                whole_layer(chosen, layer, prepared_weights(chosen, layer, prepared), x, logits)()
                continue
            sec, rel = time_plan(chosen, layer, x, logits, expected, prepared, flush, device)
            rec = make_record(preset, spec, chosen, t, hit, sec, rel, ceilings)
            timed.append((config, rec))
            row.append(f"{label} {rec.us:.1f} us {rec.pct_roofline:.0f}% rel {rel:.1e}")
        if not args.compile_only:
            verified = [(c, r) for c, r in timed[1:] if r.ok]
            if args.table and verified and timed[0][1].ok:
                winner, best = min(verified, key=lambda pair: pair[1].us)
                if best.us * (1 + args.min_gain) <= timed[0][1].us:
                    fields = dict(spec=spec, device=info.name, triton=triton_version(), tokens=t)
                    write_rows(
                        Path(args.table), [row_to_json(**fields, kernel="triton_fused", config=winner)]
                    )
                    row.append(f"row: s{winner.split_k}/d{winner.num_stages}")
            print(" | ".join(row), flush=True)
        del layer, prepared
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
