#!/usr/bin/env python3
"""Fuzz the public path: random specs x random T, each refused at plan time or within tolerance.

Data flow of one case (`FuzzCase`: spec seed, T, data seed):
  spec seed -> `random_spec` (format incl. FP8 per-tensor / per-channel / block-128 with activation
  quantization and MXFP4, act dtype, activation with clamp on or off, gate layout, biases, routing method,
  router placement, E, K, ragged H and I from small pools so that few distinct Triton kernels compile) ->
  a `MoekitError` here counts as refused (at spec)
  -> `moekit.plan(spec, T, device)` -> a `MoekitError` counts as refused (at plan); nothing may refuse later
  -> random layer (cached per spec seed) and batch (data seed) -> `prepare_weights` -> the allocator's next
  blocks NaN-poisoned (`moekit.app.check.poison_allocator`) -> `fused_moe` -> relative L2 error against
  `fused_moe_reference` within `moekit.reference.tolerance(spec)`: passed, else a mismatch
  -> any exception after planning (a `MoekitError` included: refusals belong at plan time) is a crash.
Cases draw their spec from a pool of `pool` spec seeds (bounding the compiles; every weight format with
bf16 activations first, then other (format, act dtype) pairs); T is log-uniform in
[0, max_tokens] (0 included). Every case prints its three seeds; `--case S:T:D:SHAPES` replays one.

Usage:
  python tools/fuzz.py --cases 500 --pool 12 --max-tokens 8192 --device cuda
  python tools/fuzz.py --case 123456:77:9:gpu
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import sys
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from moekit import (
    Activation,
    ActivationQuant,
    ActivationSpec,
    Fp8Scale,
    GateLayout,
    MoekitError,
    MoESpec,
    RouterWeightPlacement,
    RoutingMethod,
    RoutingSpec,
    WeightFormat,
    fused_moe,
    fused_moe_reference,
    plan,
    prepare_weights,
)
from moekit.app.check import poison_allocator
from moekit.reference import relative_l2_error, tolerance
from moekit.synthetic import SyntheticLayer, random_batch, random_layer


@dataclass(frozen=True)
class Shapes:
    """The pools E, K, H and I are drawn from: small, since every distinct shape compiles its kernels."""

    hidden: tuple[int, ...]
    inter: tuple[int, ...]
    experts: tuple[int, ...]
    top_k: tuple[int, ...]


SHAPES = {
    # 200 and 520, 100 and 368: not multiples of 32 (MXFP4's scale groups), 200 and 100 not of 16 either
    "gpu": Shapes(
        hidden=(128, 200, 520), inter=(64, 100, 368), experts=(4, 8, 16, 32, 64), top_k=(1, 2, 4, 8)
    ),
    "cpu": Shapes(hidden=(64, 100), inter=(32, 72), experts=(4, 8, 16), top_k=(1, 2, 4)),
}
OUTCOMES = ("refused", "passed", "mismatch", "crash")


@dataclass(frozen=True)
class FuzzCase:
    spec_seed: int
    num_tokens: int
    data_seed: int
    shapes: str = "gpu"  # a key of SHAPES

    def tag(self) -> str:
        return f"{self.spec_seed}:{self.num_tokens}:{self.data_seed}:{self.shapes}"

    @classmethod
    def parse(cls, tag: str) -> FuzzCase:
        spec_seed, tokens, data_seed, *shapes = tag.split(":")
        return cls(int(spec_seed), int(tokens), int(data_seed), *shapes)


@dataclass(frozen=True)
class CaseResult:
    case: FuzzCase
    outcome: str  # one of OUTCOMES
    spec: str  # the spec's description, or "-" when it could not be built
    kernel: str | None = None
    rel_l2: float | None = None
    tolerance: float | None = None
    detail: str = ""  # the refusal, the error or the traceback

    def line(self) -> str:
        err = f" rel L2 {self.rel_l2:.2e} (tol {self.tolerance:.0e})" if self.rel_l2 is not None else ""
        head = f"[{self.outcome}] case {self.case.tag()} T={self.case.num_tokens} {self.kernel or ''}{err}"
        return f"{head}\n    spec: {self.spec}" + (f"\n    {self.detail}" if self.detail else "")


@dataclass
class FuzzSummary:
    results: list[CaseResult] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    def describe(self) -> str:
        kernels = sorted({r.kernel for r in self.results if r.kernel})
        worst = max((r.rel_l2 / r.tolerance for r in self.results if r.outcome == "passed"), default=0.0)
        return (
            f"fuzz: {len(self.results)} cases, {self.count('refused')} refused, {self.count('passed')} "
            f"passed, {self.count('mismatch')} mismatches, {self.count('crash')} crashes; kernels "
            f"{kernels}; worst passing error {worst:.2f} x tolerance"
        )


def random_spec(rng: random.Random, shapes: Shapes = SHAPES["gpu"]) -> MoESpec:
    """A spec drawn from every axis the spec has (a few combinations are invalid: MoESpec refuses them)."""
    fmt = rng.choice(list(WeightFormat))
    fp8_scale, act_quant = None, ActivationQuant.NONE
    if fmt is WeightFormat.FP8_E4M3:
        fp8_scale = rng.choice(list(Fp8Scale))
        quants = [ActivationQuant.NONE, ActivationQuant.FP8_PER_TOKEN]
        act_quant = rng.choice(
            quants + [ActivationQuant.FP8_PER_GROUP_128] * (fp8_scale is Fp8Scale.BLOCK_128)
        )
    kind = rng.choice(list(Activation))
    alpha = rng.choice((1.702, 1.0)) if kind is Activation.SWIGLU_OAI else None
    limit = rng.choice((None, 7.0, round(rng.uniform(0.5, 10.0), 2)))
    num_experts = rng.choice(shapes.experts)
    top_k = rng.choice([k for k in shapes.top_k if k <= num_experts])
    method = rng.choice(list(RoutingMethod))
    routing = RoutingSpec(method)
    if method is RoutingMethod.SOFTMAX_TOPK:
        routing = RoutingSpec(method, renormalize=rng.random() < 0.5)
    if method is RoutingMethod.SIGMOID_GROUPED:
        groups = [g for g in (1, 2, 4) if num_experts % g == 0]
        n_group = rng.choice(groups)
        topk_group = rng.randint(1, n_group)
        routing = RoutingSpec(
            method,
            n_group=n_group if n_group > 1 else None,
            topk_group=topk_group if n_group > 1 else None,
            has_correction_bias=rng.random() < 0.5,
            routed_scaling_factor=rng.choice((1.0, 2.5)),
        )
    placement = RouterWeightPlacement.OUTPUT
    if top_k == 1 and rng.random() < 0.5:
        placement = RouterWeightPlacement.INPUT
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=rng.choice(shapes.hidden),
        intermediate_size=rng.choice(shapes.inter),
        weight_format=fmt,
        fp8_scale=fp8_scale,
        act_dtype=rng.choice(_ACT_DTYPES),
        act_quant=act_quant,
        activation=ActivationSpec(kind, alpha=alpha, limit=limit),
        gate_layout=rng.choice(list(GateLayout)),
        has_bias=rng.random() < 0.5,
        router_weight_placement=placement,
        routing=routing,
    )


_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _spec_pool(rng: random.Random, size: int, shapes: Shapes) -> list[int]:
    """`size` spec seeds covering (format, act dtype) pairs: bf16 with every format first (the dtype
    real models run), then the other pairs in a random order; the rest of each spec is random."""
    others = [(f, d) for d in _ACT_DTYPES[1:] for f in WeightFormat]
    rng.shuffle(others)
    wanted = [(f, torch.bfloat16) for f in WeightFormat] + others
    seeds: list[int] = []
    for fmt, dtype in (wanted * (size // len(wanted) + 1))[:size]:
        while True:
            candidate = rng.randrange(1 << 30)
            try:
                spec = random_spec(random.Random(candidate), shapes)
            except MoekitError:
                continue
            if (spec.weight_format, spec.act_dtype) == (fmt, dtype):
                seeds.append(candidate)
                break
    return seeds


def random_cases(count: int, *, seed: int, pool: int, max_tokens: int, shapes: str = "gpu") -> list[FuzzCase]:
    """`count` cases over `pool` spec seeds, T log-uniform in [0, max_tokens] (about 1 in 50 is T = 0)."""
    rng = random.Random(seed)
    spec_seeds = _spec_pool(rng, pool, SHAPES[shapes])
    cases = []
    for _ in range(count):
        tokens = 0 if rng.random() < 0.02 else int(math.exp(rng.uniform(0.0, math.log(max_tokens + 1))))
        cases.append(
            FuzzCase(rng.choice(spec_seeds), min(tokens, max_tokens), rng.randrange(1 << 30), shapes)
        )
    return cases


def case_spec(case: FuzzCase) -> MoESpec:
    return random_spec(random.Random(case.spec_seed), SHAPES[case.shapes])


@functools.lru_cache(maxsize=4)
def _layer(case: FuzzCase, device: str) -> SyntheticLayer:
    # Weights large enough that the activation's clamp and every routing weight matter.
    return random_layer(case_spec(case), seed=case.spec_seed, weight_std=0.1, device=device)


def run_case(case: FuzzCase, device: torch.device) -> CaseResult:
    try:
        spec = case_spec(case)
    except MoekitError as err:
        return CaseResult(case, "refused", "-", detail=f"at spec: {type(err).__name__}: {err}")
    try:
        chosen = plan(spec, num_tokens=case.num_tokens, device=device)
    except MoekitError as err:
        first = str(err).splitlines()[0]
        return CaseResult(case, "refused", spec.describe(), detail=f"at plan: {type(err).__name__}: {first}")
    except Exception:  # noqa: BLE001 - the harness reports every failure as a crash
        return CaseResult(case, "crash", spec.describe(), detail=traceback.format_exc())
    allowed = tolerance(spec)
    try:
        layer = _layer(FuzzCase(case.spec_seed, 0, 0, case.shapes), str(device))
        x, _, routing = random_batch(
            spec, case.num_tokens, correction_bias=layer.correction_bias, seed=case.data_seed, device=device
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "keeps CHECKPOINT packing": expected for some scale draws
            weights = prepare_weights(layer.weights, chosen)
        pairs = max(case.num_tokens, 1) * spec.K
        poison_allocator(device, num_bytes=4 * pairs * (2 * spec.I + 2 * spec.H) + (1 << 20))
        out = fused_moe(x, weights, routing, plan=chosen)
        expected = fused_moe_reference(x, layer.weights, routing, spec=spec)
        if out.shape != expected.shape or out.dtype != spec.act_dtype:
            detail = (
                f"output {out.dtype} {tuple(out.shape)}, expected {spec.act_dtype} {tuple(expected.shape)}"
            )
            return CaseResult(case, "mismatch", spec.describe(), chosen.kernel, None, allowed, detail)
        err = relative_l2_error(out, expected)
    except Exception:  # noqa: BLE001 - a refusal after planning is a crash too
        return CaseResult(case, "crash", spec.describe(), chosen.kernel, detail=traceback.format_exc())
    outcome = "passed" if err <= allowed else "mismatch"
    return CaseResult(case, outcome, spec.describe(), chosen.kernel, err, allowed)


def run_fuzz(cases: list[FuzzCase], device: torch.device, *, progress=None) -> FuzzSummary:
    summary = FuzzSummary()
    for case in cases:
        result = run_case(case, device)
        summary.results.append(result)
        if progress is not None:
            progress(result)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=12, help="distinct spec seeds the cases draw from")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="gpu", choices=sorted(SHAPES))
    p.add_argument("--case", default=None, help="replay one case: SPEC_SEED:T:DATA_SEED[:SHAPES]")
    p.add_argument("--verbose", action="store_true", help="print every case, not only failures")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.case:
        cases = [FuzzCase.parse(args.case)]
    else:
        cases = random_cases(
            args.cases, seed=args.seed, pool=args.pool, max_tokens=args.max_tokens, shapes=args.shapes
        )

    def show(result: CaseResult) -> None:
        if args.verbose or result.outcome in ("mismatch", "crash"):
            print(result.line(), flush=True)

    summary = run_fuzz(cases, device, progress=show)
    print(summary.describe())
    return 0 if summary.count("mismatch") == summary.count("crash") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
