#!/usr/bin/env python3
"""Fill Triton's cache for a sweep before it runs: every config of the Triton kernel's `tuning_space` at
every T of the sweep, launched once (eagerly) in parallel worker processes that share TRITON_CACHE_DIR.

Why: `sweep_configs.py` compiles each new candidate in its one process (GEMM1 + GEMM2, seconds each),
which takes most of a device call after a kernel change; compiles are CPU work and the device has
16 cores. Launching at each T also covers the per-T specializations (divisibility of the pair and
block counts). Outputs are not checked here; the sweep checks every candidate against the reference.

Usage (GPU): python benchmarks/precompile.py --preset gpt-oss-120b --tokens 1,64 --workers 5
Each worker holds its own copy of the layer: 8 workers of gpt-oss-120b ran the H200 out of memory for
most launches (session 5); 5 did not.
"""

import argparse
import multiprocessing
import time
from dataclasses import replace

import torch

from moekit.app.bench import prepared_weights, whole_layer
from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.planning.plan import plan
from moekit.presets import preset
from moekit.synthetic import random_batch, random_layer


def _configs(name: str, tokens: list[int], info: DeviceInfo, *, planned_only: bool) -> list:
    kernel = default_registry().get("triton_fused")
    spec = preset(name)
    unique = {}
    for t in tokens:
        if planned_only:  # the config the shipped table (or the default) gives this T
            unique[plan(spec, num_tokens=t, device=info).config] = None
            continue
        for cfg in kernel.tuning_space(spec, Problem(num_tokens=t, device=info)):
            unique[cfg] = None
    return list(unique)


def _launch_all(job: tuple[str, list[int], list]) -> tuple[int, list[str]]:
    """Run each config once at each T in this process; returns (launches, failures)."""
    name, tokens, configs = job
    device = torch.device("cuda")
    spec = preset(name)
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    prepared: dict = {}
    launches, failures = 0, []
    for t in tokens:
        x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
        base = replace(plan(spec, num_tokens=t, device=info), kernel="triton_fused")
        for cfg in configs:
            chosen = replace(base, config=cfg)
            try:
                whole_layer(chosen, layer, prepared_weights(chosen, layer, prepared), x, logits)()
                torch.cuda.synchronize(device)
                launches += 1
            except Exception as err:  # noqa: BLE001 - reported; the sweep reports it again per candidate
                failures.append(f"T={t} {cfg.as_dict()}: {type(err).__name__}: {str(err)[:160]}")
    return launches, failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--workers", type=int, default=5)
    p.add_argument("--planned", action="store_true", help="only the planned config of each T (a bench)")
    args = p.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    configs = _configs(args.preset, tokens, DeviceInfo.of(torch.device("cuda")), planned_only=args.planned)
    workers = max(1, min(args.workers, len(configs)))
    jobs = [(args.preset, tokens, configs[i::workers]) for i in range(workers)]
    start = time.time()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_launch_all, jobs)
    launches = sum(n for n, _ in results)
    failures = [f for _, fs in results for f in fs]
    print(
        f"precompile {args.preset}: {len(configs)} configs x {len(tokens)} T, {launches} launches, "
        f"{len(failures)} failed, {time.time() - start:.0f} s with {workers} workers",
        flush=True,
    )
    for line in failures:
        print("  FAILED " + line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
