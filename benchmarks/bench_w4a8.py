#!/usr/bin/env python3
"""W4A8 against W4A16 on the same MXFP4 weights, inputs and routing, in one run (GPU).

Usage:
  python benchmarks/bench_w4a8.py --presets gpt-oss-120b --tokens 1024,4096,16384 \
      --json bench-results/w4a8.json

Per preset and T, the Triton path of both specs (W4A8: `act_quant` FP8 per token, the WGMMA_W4A8 engine
on sm_90, or per 1x128 group, the tl.dot W4A8 tiles the planner does not take on a GPU), launched
directly on the weights each spec's `prepare_weights` makes: W4A16 with its planned config, W4A8 with the
kernel's default, or with `--sweep` every config of its tuning space (the best verified one reported). The
whole layer (routing included) graph-timed with L2 flushed, each output checked against its own spec's
reference (poisoned first), and both outputs' rel L2 against the exact layer (fp32 reference on the
dequantized weights, activations unquantized): the error W4A8 adds, next to W4A16's.
Ceilings measured first: the bf16 and FP8 dense rates give each T's two compute floors (W4A16 cannot
go below the bf16 one).
"""

import argparse
import functools
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moekit.app.bench import capture_graph, flushed_seconds, measure_ceilings
from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.kernels.triton.launch import triton_fused_moe
from moekit.ops import route
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
from moekit.spec import ActivationQuant, WeightFormat
from moekit.synthetic import random_batch, random_layer


def _layer_call(spec, config, weights, x, logits, correction_bias):
    """The whole layer on the Triton path with this config: route `logits`, then the fused kernels."""

    def call():
        routing = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=correction_bias)
        return triton_fused_moe(x, weights, routing, spec=spec, config=config)

    return call


def _measure(spec, config, weights, *, layer, x, logits, routing, exact, flush) -> dict:
    """One config's whole layer: poisoned graph replay checked against the spec's reference and the
    exact layer, then graph-timed with L2 flushed. A config that fails is recorded, not fatal."""
    device = x.device
    try:
        call = _layer_call(spec, config, weights, x, logits, layer.correction_bias)
        graph, out = capture_graph(call, device)
        out.fill_(float("nan"))  # poison: the replay must write every element
        graph.replay()
        torch.cuda.synchronize(device)
        rel_own = relative_l2_error(out, fused_moe_reference(x, layer.weights, routing, spec=spec))
        rel_exact = relative_l2_error(out, exact)
        del graph
        us = flushed_seconds(call, device, flush, repeats=10) * 1e6
    except Exception as err:  # noqa: BLE001 - one candidate's failure is a result, not the end of the run
        torch.cuda.empty_cache()
        return {"config": config.as_dict(), "error": f"{type(err).__name__}: {err}"[:300], "ok": False}
    return {
        "config": config.as_dict(),
        "us": us,
        "rel_l2_own_reference": rel_own,
        "ok": rel_own <= tolerance(spec),
        "rel_l2_exact": rel_exact,
    }


def _with_other_decode_order(measure_default, spec, num_tokens: int):  # noqa: ANN001, ANN202
    """`measure_default()` (a zero-argument measurement) with the other decode order than
    `wgmma_w4a8.decode_under_mma` gives at this T (its threshold moved, restored after), labelled."""
    import math

    from moekit.kernels.triton import wgmma_w4a8

    shipped_threshold = wgmma_w4a8.DECODE_UNDER_MMA_FROM_TOKENS_PER_EXPERT
    other = not wgmma_w4a8.decode_under_mma(spec, num_tokens)
    wgmma_w4a8.DECODE_UNDER_MMA_FROM_TOKENS_PER_EXPERT = 0 if other else math.inf
    try:
        result = measure_default()
    finally:
        wgmma_w4a8.DECODE_UNDER_MMA_FROM_TOKENS_PER_EXPERT = shipped_threshold
    return dict(result, decode_under_mma=other)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="gpt-oss-120b", help='MXFP4 presets, or "name@ExKxHxI"')
    p.add_argument("--tokens", default="1024,4096,8192,16384")
    p.add_argument(
        "--act-quant",
        default=ActivationQuant.FP8_PER_TOKEN.value,
        choices=[q.value for q in ActivationQuant][1:],
    )
    p.add_argument("--sweep", action="store_true", help="time every W4A8 config of the tuning space")
    p.add_argument(
        "--decode-order",
        choices=["shipped", "both"],
        default="shipped",
        help="both: W4A8 also timed with the other decode order than wgmma_w4a8.decode_under_mma gives at "
        "each T (row key w4a8_other_decode_order), the A/B the threshold is chosen by",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    info = DeviceInfo.of(device)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    kernel = default_registry().get("triton_fused")
    print(f"ceilings: {ceilings.summary()}", flush=True)
    rows = []
    for label in args.presets.split(","):
        w4a16 = preset_at(label)
        if w4a16.weight_format is not WeightFormat.MXFP4:
            raise SystemExit(f"{label} is {w4a16.weight_format.name}: W4A8 needs MXFP4 weights")
        w4a8 = replace(w4a16, act_quant=ActivationQuant(args.act_quant))
        layer = random_layer(w4a16, seed=0, device=device)  # one set of weights serves both specs
        prepared: dict = {}
        for t in (int(v) for v in args.tokens.split(",")):
            x, logits, routing = random_batch(
                w4a16, t, correction_bias=layer.correction_bias, seed=t, device=device
            )
            exact = fused_moe_reference(
                x.float(), layer.weights, routing, spec=replace(w4a16, act_dtype=torch.float32)
            )
            flops = 2.0 * t * w4a16.K * 3 * w4a16.H * w4a16.I
            row = {"preset": label, "tokens": t, "bf16_floor_us": flops / ceilings.bf16_flops_per_s * 1e6}
            if ceilings.fp8_flops_per_s:
                row["fp8_floor_us"] = flops / ceilings.fp8_flops_per_s * 1e6
            measure = functools.partial(
                _measure, layer=layer, x=x, logits=logits, routing=routing, exact=exact, flush=flush
            )
            for spec in (w4a16, w4a8):
                if spec not in prepared:
                    prepared[spec] = kernel.prepare_weights(layer.weights, spec)
            w4a16_config = plan(w4a16, num_tokens=t, device=info).config  # its tuned row, where one exists
            row["w4a16"] = measure(w4a16, w4a16_config, prepared[w4a16])
            configs = kernel.tuning_space(w4a8, Problem(t, info))  # the default first
            candidates = [measure(w4a8, c, prepared[w4a8]) for c in (configs if args.sweep else configs[:1])]
            row["w4a8_default"] = candidates[0]
            verified = [c for c in candidates if c.get("ok")]
            row["w4a8"] = min(verified, key=lambda c: c["us"]) if verified else candidates[0]
            if args.sweep:
                row["w4a8_candidates"] = candidates
            if args.decode_order == "both":
                row["w4a8_other_decode_order"] = _with_other_decode_order(
                    functools.partial(measure, w4a8, configs[0], prepared[w4a8]), w4a8, t
                )
            a, b = row["w4a16"], row["w4a8"]
            if "us" not in a or "us" not in b:
                print(f"  {label} T={t}: FAILED {a.get('error') or b.get('error')}", flush=True)
                rows.append(row)
                continue
            print(
                f"  {label} T={t}: W4A16 {a['us']:.1f} us, W4A8 {b['us']:.1f} us ({a['us'] / b['us']:.2f}x; "
                f"default config {row['w4a8_default'].get('us', float('nan')):.1f} us), bf16 floor "
                f"{row['bf16_floor_us']:.1f} us; rel L2 vs exact {a['rel_l2_exact']:.2e} / "
                f"{b['rel_l2_exact']:.2e}, vs own reference {a['rel_l2_own_reference']:.1e} / "
                f"{b['rel_l2_own_reference']:.1e}{'' if a['ok'] and b['ok'] else '  OVER TOLERANCE'}",
                flush=True,
            )
            other = row.get("w4a8_other_decode_order")
            if other is not None:
                timed = f"{other['us']:.1f} us" if "us" in other else f"FAILED {other.get('error')}"
                print(f"    W4A8 with DECODE_UNDER_MMA={other['decode_under_mma']}: {timed}", flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"ceilings": asdict(ceilings), "rows": rows}, indent=1))
    others_ok = all(r["w4a8_other_decode_order"]["ok"] for r in rows if "w4a8_other_decode_order" in r)
    return 0 if others_ok and all(r["w4a16"]["ok"] and r["w4a8"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
