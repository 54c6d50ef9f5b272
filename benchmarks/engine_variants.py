#!/usr/bin/env python3
"""Time source variants of the WGMMA_WORDS engine's Gluon kernels side by side with the shipped ones and
with the planned config: whole layer, graph replay, L2 flushed, each run checked against the reference.

Data flow: each `--variant NAME=PATH` (a modified copy of `kernels/triton/_details/wgmma_words.py`) is
imported as its own module -> per case (preset, T, pairs a program): the planned config, then the engine
at those pairs with the shipped kernels and with each variant (`wgmma_words._kernels` swapped in turn)
-> one line a case: µs, % of roofline (experts hit) and rel L2 of each.

Usage (GPU): python benchmarks/engine_variants.py --variant ahead3=/tmp/ahead3.py \\
    --cases gpt-oss-120b:2048:128,gpt-oss-120b@8x2x4096x14336:4096:256
A variant that changes what the host passes (arguments, grid) is out of scope: only the kernels swap,
so a variant's `_gemm1` / `_gemm2` take the shipped ones' arguments (HALF_WIDE included). The K-loop lives
in `_details/wgmma_words_kloop.py`: a variant of it copies the functions it changes into the variant
file, after the imports, where they replace the shipped ones for that module's GEMMs.
Compile first with --compile-only in a few processes (one per case) to time without compile stalls.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path

SHIPPED = "shipped"


@dataclass(frozen=True)
class Case:
    preset: str
    tokens: int
    block_m: int

    @classmethod
    def parse(cls, text: str) -> Case:
        """ "preset:T:pairs", e.g. "gpt-oss-120b@8x2x4096x14336:4096:256"."""
        preset, tokens, block_m = text.rsplit(":", 2)
        return cls(preset, int(tokens), int(block_m))


def load_variant(name: str, path: Path):
    """The module at `path`, imported under its own name (its Gluon functions compile apart)."""
    spec = importlib.util.spec_from_file_location(f"engine_variant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], help="NAME=PATH of a modified kernel module")
    p.add_argument("--cases", required=True, help="preset:T:pairs, comma-separated")
    p.add_argument("--compile-only", action="store_true", help="run each once, untimed (fills the cache)")
    args = p.parse_args()

    import torch

    from moekit.app.bench import make_record, measure_ceilings, prepared_weights, time_plan, whole_layer
    from moekit.kernels.base import DeviceInfo
    from moekit.kernels.triton import wgmma_words
    from moekit.kernels.triton.tuning import WGMMA_WORDS_DEFAULT
    from moekit.planning.plan import plan
    from moekit.presets import preset_at
    from moekit.reference import fused_moe_reference
    from moekit.synthetic import random_batch, random_layer

    shipped = wgmma_words._kernels()
    if shipped is None:
        raise SystemExit("this Triton has no Gluon Hopper support: the WGMMA_WORDS engine cannot run")
    kernels = {SHIPPED: shipped}
    for item in args.variant:
        name, path = item.split("=", 1)
        module = load_variant(name, Path(path))
        kernels[name] = (module._gemm1, module._gemm2)
    device = torch.device("cuda")
    info = DeviceInfo.of(device)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    ceilings = None if args.compile_only else measure_ceilings(device)
    for case in (Case.parse(c) for c in args.cases.split(",")):
        spec = preset_at(case.preset)
        layer = random_layer(spec, seed=0, device=device)
        prepared: dict = {}
        x, logits, routing = random_batch(
            spec, case.tokens, correction_bias=layer.correction_bias, seed=case.tokens, device=device
        )
        planned = replace(plan(spec, num_tokens=case.tokens, device=info), kernel="triton_fused")
        engine = replace(planned, config=replace(WGMMA_WORDS_DEFAULT, block_m=case.block_m))
        runs = [("planned", SHIPPED, planned)] + [(name, name, engine) for name in kernels]
        expected = None if args.compile_only else fused_moe_reference(x, layer.weights, routing, spec=spec)
        hit = int(routing.ids.unique().numel())
        row = [f"{case.preset} T={case.tokens} tokens/expert={case.tokens * spec.K / spec.E:.0f}"]
        for label, name, chosen in runs:
            wgmma_words._kernels = lambda pair=kernels[name]: pair
            if args.compile_only:
                whole_layer(chosen, layer, prepared_weights(chosen, layer, prepared), x, logits)()
                continue
            sec, rel = time_plan(chosen, layer, x, logits, expected, prepared, flush, device)
            rec = make_record(case.preset, spec, chosen, case.tokens, hit, sec, rel, ceilings)
            what = (
                f"planned {chosen.config.engine.name}/{chosen.config.block_m}"
                if label == "planned"
                else label
            )
            row.append(f"{what} {rec.us:.1f} us {rec.pct_roofline:.0f}% rel {rel:.1e}")
        if not args.compile_only:
            print(" | ".join(row), flush=True)
        del layer, prepared
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
