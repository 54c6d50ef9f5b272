"""The autotuner: time every capable kernel's candidate configs, verify the winner, save it as a tuned row.

Data flow, per token count T: random tokens and router logits (never zeros) -> the fp32 reference ->
for each kernel that `supports` the spec here, each config of its `tuning_space` that passes
`validate_config`: prepare weights (once per kernel), run, time -> candidates ranked by time -> the
fastest whose output matches the reference within the tolerance table (output allocator poisoned with
NaN first) -> one row written to the table at once (`tuned.write_rows`: atomic, locked), so an
interrupted run keeps what it finished and a re-run resumes after it.

The table is checked before any tuning (`check_table`): an existing file must be a table the writer can
merge into, read with the planner's own parser (`tuned.load_tables`), and a new file's folder must be
creatable, so a bad --table fails at once rather than after the first winner.

Isolation: one candidate never ends the run. Any exception from a candidate (compile error, out of
memory, a launch failure) is recorded with its message and that candidate is skipped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moekit.app.check import poison_allocator
from moekit.app.timing import median_seconds
from moekit.errors import TunedTableError
from moekit.kernels.base import DeviceInfo, Kernel, KernelConfig, Problem
from moekit.kernels.registry import KernelRegistry, default_registry
from moekit.ops import fused_moe, prepare_weights
from moekit.planning.plan import plan
from moekit.planning.tuned import (
    TableKey,
    load_tables,
    row_to_json,
    token_bucket,
    triton_version,
    write_rows,
)
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
from moekit.spec import MoESpec
from moekit.synthetic import random_batch, random_layer


@dataclass(frozen=True)
class Candidate:
    tokens: int
    kernel: str
    config: KernelConfig
    seconds: float | None  # None when the candidate failed
    error: str | None = None


@dataclass(frozen=True)
class TuneOutcome:
    tokens: int
    winner: Candidate | None  # None when no candidate ran and verified
    rel_l2: float | None
    candidates: tuple[Candidate, ...]
    rejected_winners: tuple[str, ...] = ()  # faster candidates that failed verification, with errors
    resumed: bool = False  # a row for this T was already in the table


def _default_timer(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of one call (5 batches of 5 after one warm-up: tuning trades precision for time)."""
    return median_seconds(fn, device, repeats=5, batches=5, warmup=1)


def check_table(path: Path, *, registry: KernelRegistry) -> None:
    """`path` can take tuned rows: an existing regular file holds a table the writer can merge into, with
    every row at least a row (read with the loader's parser: `tuned.load_tables`); the folder it goes in
    exists or can be created. Otherwise TunedTableError, "tuned table PATH: why; what to do"."""
    path = Path(path)
    where = f"tuned table {path}"
    if path.exists() and not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        raise TunedTableError(f"{where}: it is {what}; give a file path, e.g. {path / 'moekit-tuned.json'}")
    if path.is_file():
        # Rows without a key are not rows at all (not an object, fields missing or ill-typed); rows with
        # one (another registry's kernel or config) are kept by the writer and reported by the loader.
        broken = [r for r in load_tables([path], registry=registry).rejected if r.key is None]
        if broken:
            more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
            raise TunedTableError(
                f"{where}: not a moekit tuned table tune can merge into: {broken[0].origin}: "
                f"{broken[0].reason}{more}; move the file aside, or tune into another path"
            )
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())  # "." or "/" exists
    try:  # the writer's own first steps: create the missing folders, then a temporary file in them
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".probe", dir=folder))
    except OSError as err:
        raise TunedTableError(
            f"{where}: cannot be written: creating it under {folder} fails ({err.strerror or err}); "
            "give a path in a folder you can write"
        ) from err


def _tuned_buckets(path: Path, spec: MoESpec, device: DeviceInfo, registry: KernelRegistry) -> set[int]:
    """Token buckets already tuned in `path` for this spec, shape, device and Triton version: the rows the
    planner would use (`tuned.load_tables`), so a row it rejects is tuned again and replaced."""
    if not path.is_file():
        return set()
    want = TableKey.for_spec(spec, device=device.name, triton=triton_version(), bucket=1).without_bucket()
    return {key.bucket for key in load_tables([path], registry=registry).rows if key.without_bucket() == want}


def tune(
    spec: MoESpec,
    *,
    tokens: tuple[int, ...],
    device: torch.device | str,
    table: Path,
    registry: KernelRegistry | None = None,
    timer: Callable[[Callable[[], object], torch.device], float] = _default_timer,
    resume: bool = True,
    seed: int = 0,
    progress: Callable[[TuneOutcome], None] | None = None,
) -> list[TuneOutcome]:
    """Tune `spec` at each T in `tokens` on `device`; append the verified winners to `table`.

    A table that cannot take the rows (`check_table`) is refused before any tuning."""
    device = torch.device(device)
    registry = registry or default_registry()
    info = DeviceInfo.of(device)
    table = Path(table)
    check_table(table, registry=registry)
    layer = random_layer(spec, seed=seed, device=device)
    prepared: dict[str, object] = {}
    done = _tuned_buckets(table, spec, info, registry) if resume else set()
    outcomes: list[TuneOutcome] = []
    for t in tokens:
        if token_bucket(t) in done:
            outcomes.append(TuneOutcome(tokens=t, winner=None, rel_l2=None, candidates=(), resumed=True))
            continue
        outcome = _tune_one(spec, t, layer, info, device, registry, prepared, timer, seed)
        if outcome.winner is not None:
            write_rows(
                table,
                [
                    row_to_json(
                        spec=spec,
                        device=info.name,
                        triton=triton_version(),
                        tokens=t,
                        kernel=outcome.winner.kernel,
                        config=outcome.winner.config,
                    )
                ],
                registry=registry,
            )
            done.add(token_bucket(t))
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    return outcomes


def _tune_one(spec, t, layer, info, device, registry, prepared, timer, seed) -> TuneOutcome:
    x, _, routing = random_batch(spec, t, correction_bias=layer.correction_bias, seed=seed + t, device=device)
    expected = fused_moe_reference(x, layer.weights, routing, spec=spec)
    problem = Problem(num_tokens=t, device=info)
    base = plan(spec, num_tokens=t, device=info, registry=registry, tuned=None)
    candidates: list[Candidate] = []
    runners = {}
    for kernel in registry:
        if kernel.supports(spec, problem) is not None:
            continue
        for config in kernel.tuning_space(spec, problem):
            if kernel.validate_config(config, spec) is not None:
                continue
            chosen = replace(base, kernel=kernel.name, config=config, num_tokens=t)
            try:
                weights = _prepared(kernel, layer.weights, chosen, prepared, registry)

                def run(chosen=chosen, weights=weights):
                    return fused_moe(x, weights, routing, plan=chosen, registry=registry)

                seconds = timer(run, device)
            except Exception as err:  # noqa: BLE001 - isolation: any failure skips this candidate only
                candidates.append(
                    Candidate(t, kernel.name, config, None, f"{type(err).__name__}: {err}"[:300])
                )
                _release(device)
                continue
            candidates.append(Candidate(t, kernel.name, config, seconds))
            runners[len(candidates) - 1] = run
    ranked = sorted(
        (i for i, c in enumerate(candidates) if c.seconds is not None), key=lambda i: candidates[i].seconds
    )
    rejected: list[str] = []
    allowed = tolerance(spec)
    for i in ranked:
        poison_allocator(device, num_bytes=4 * t * spec.K * (2 * spec.I + spec.H) + (1 << 20))
        try:
            rel = relative_l2_error(runners[i](), expected)
        except Exception as err:  # noqa: BLE001
            rejected.append(
                f"{candidates[i].kernel} {candidates[i].config.as_dict()}: {type(err).__name__}: {err}"
            )
            continue
        if rel <= allowed:
            return TuneOutcome(t, candidates[i], rel, tuple(candidates), tuple(rejected))
        rejected.append(
            f"{candidates[i].kernel} {candidates[i].config.as_dict()}: rel L2 {rel:.2e} > {allowed}"
        )
    return TuneOutcome(t, None, None, tuple(candidates), tuple(rejected))


def _prepared(kernel: Kernel, weights, chosen, cache: dict, registry: KernelRegistry):
    if kernel.name not in cache:
        cache[kernel.name] = prepare_weights(weights, chosen, registry=registry)
    return cache[kernel.name]


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # an OOM candidate must not starve the next one
