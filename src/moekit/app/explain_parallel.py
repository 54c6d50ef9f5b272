"""`moekit explain --ep N` / `--tp N`: a layer planned for N ranks on paper, without the ranks.

Data flow: (global spec, mode, N, per-rank token counts, a `CollectiveTable`) -> the global weights as
meta tensors (shapes and dtypes only, no memory) -> this rank's share by the layer's own rules
(`moekit.parallel.expert_shard`: E/N experts, the first E % N ranks one more; `tensor_shard`: I/N,
refused where a shard would split an MXFP4 32-block or an FP8 128-block) -> per-rank spec and weight
bytes against one rank's -> for each T: every engine's collective calls (`moekit.ep.cost`), bytes this
rank sends and the modeled µs -> `ParallelExplanation` (text or JSON). A model, not a measurement: the
constants and their source are printed with every figure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from moekit.ep.constants import CollectiveTable
from moekit.ep.cost import (
    CollectiveCall,
    calls_us,
    describe_model,
    engine_calls,
    predict_us,
    tensor_parallel_calls,
)
from moekit.ep.engines import EpEngine
from moekit.ep.ownership import expert_ownership
from moekit.parallel import ParallelMode, expert_shard, tensor_shard
from moekit.spec import MoESpec, WeightFormat
from moekit.weights import ExpertWeights, WeightPacking

DEFAULT_RANK_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
TENSOR = "tensor_allreduce"  # the name of tensor parallelism's one engine in the report


@dataclass(frozen=True)
class RankShare:
    """Ranks first..last hold the same share: its spec and weight bytes."""

    first: int
    last: int
    spec: str
    experts: int
    intermediate: int
    weight_bytes: int


@dataclass(frozen=True)
class EngineCost:
    engine: str
    bytes_sent: float  # by one rank per layer forward
    predicted_us: float  # the model's, not a measurement
    calls: tuple[CollectiveCall, ...]


@dataclass(frozen=True)
class TokenRow:
    tokens_per_rank: int
    engines: tuple[EngineCost, ...]

    @property
    def pick(self) -> str:
        """The engine the model predicts fastest at this T."""
        return min(self.engines, key=lambda e: e.predicted_us).engine


@dataclass(frozen=True)
class ParallelExplanation:
    mode: ParallelMode
    world_size: int
    spec: str
    one_rank_bytes: int
    shares: tuple[RankShare, ...]
    rows: tuple[TokenRow, ...]
    model: str
    constants: CollectiveTable


def _dtype(spec: MoESpec, name: str) -> torch.dtype:
    if name in ("b13", "b2"):
        return spec.act_dtype
    if spec.weight_format is WeightFormat.MXFP4:
        return torch.uint8
    if spec.weight_format is WeightFormat.FP8_E4M3:
        return torch.float8_e4m3fn if name in ("w13", "w2") else torch.float32
    return spec.weight_format.float_dtype


def meta_weights(spec: MoESpec) -> ExpertWeights:
    """The global layer's checkpoint weights as meta tensors: every shape and dtype, no memory."""
    probe = SimpleNamespace(
        stores_floats=not spec.weight_format.is_quantized,
        format=spec.weight_format,
        packing=WeightPacking.CHECKPOINT,
        fp8_scale=spec.fp8_scale,
        has_bias=spec.has_bias,
    )  # the fields `ExpertWeights.expected_shapes` reads: the one statement of each tensor's shape
    shapes = ExpertWeights.expected_shapes(probe, num_experts=spec.E, hidden=spec.H, intermediate=spec.I)
    tensors = {n: torch.empty(s, dtype=_dtype(spec, n), device="meta") for n, s in shapes.items()}
    hidden = spec.H if spec.weight_format is WeightFormat.MXFP4 else None
    return ExpertWeights(
        format=spec.weight_format,
        gate_layout=spec.gate_layout,
        fp8_scale=spec.fp8_scale,
        hidden_size=hidden,
        **tensors,
    )


def weight_bytes(weights: ExpertWeights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.tensors().values())


def rank_shares(spec: MoESpec, mode: ParallelMode, world: int) -> tuple[RankShare, ...]:
    """Each distinct share of the N ranks (EP: two sizes where E % N != 0), cut by the layer's rules."""
    weights = meta_weights(spec)
    if mode is ParallelMode.TENSOR:
        local, w = tensor_shard(spec, weights, rank=0, world_size=world)  # every rank: the same shapes
        return (RankShare(0, world - 1, local.describe(), local.E, local.I, weight_bytes(w)),)
    owned = expert_ownership(spec.E, world)
    shares = []
    for rank in sorted({0, world - 1}):
        local, w, _ = expert_shard(spec, weights, rank=rank, world_size=world)
        same = [r for r in range(world) if len(owned[r]) == len(owned[rank])]
        shares.append(RankShare(same[0], same[-1], local.describe(), local.E_local, local.I, weight_bytes(w)))
    return tuple({(s.first, s.last): s for s in shares}.values())


def explain_parallel(
    spec: MoESpec, *, mode: ParallelMode, world: int, tokens: tuple[int, ...], constants: CollectiveTable
) -> ParallelExplanation:
    """The layer `spec` planned for `world` ranks in `mode` (module docstring)."""
    shares = rank_shares(spec, mode, world)
    act = torch.empty((), dtype=spec.act_dtype).element_size()
    rows = []
    for t in tokens:
        if mode is ParallelMode.TENSOR:
            each = {TENSOR: tensor_parallel_calls(tokens=t, H=spec.H, world=world, act_bytes=act)}
        else:  # the layer agrees on max T each forward (static=False): that all-reduce is counted
            shape = dict(tokens_per_rank=t, H=spec.H, K=spec.K, E=spec.E, world=world, act_bytes=act)
            each = {e.value: engine_calls(e, static=False, **shape) for e in EpEngine}
        costs = tuple(
            EngineCost(
                name,
                sum(c.bytes_sent for c in calls),
                _modeled_us(name, calls, t, spec, world, act, constants),
                calls,
            )
            for name, calls in each.items()
        )
        rows.append(TokenRow(t, costs))
    return ParallelExplanation(
        mode=mode,
        world_size=world,
        spec=spec.describe(),
        one_rank_bytes=weight_bytes(meta_weights(spec)),
        shares=shares,
        rows=tuple(rows),
        model=describe_model(constants=constants),
        constants=constants,
    )


def _modeled_us(
    name: str, calls: tuple, tokens: int, spec: MoESpec, world: int, act: int, constants: CollectiveTable
) -> float:
    """The model's µs of one forward: an engine's collectives and own copies (`predict_us`), or TP's calls."""
    if name == TENSOR:
        return calls_us(calls, constants)
    return predict_us(
        EpEngine(name), tokens_per_rank=tokens, H=spec.H, K=spec.K, E=spec.E, world=world, act_bytes=act,
        constants=constants, static=False,
    )  # fmt: skip


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def as_dict(report: ParallelExplanation) -> dict:
    """The JSON of `--json`: the same figures as the text."""
    return {
        "mode": report.mode.value,
        "world_size": report.world_size,
        "spec": report.spec,
        "model": report.model,
        "model_not_measurement": True,
        "constants_source": asdict(report.constants.source),
        "constants_machine": report.constants.machine,
        "constants_world_size": report.constants.world_size,
        "one_rank_weight_bytes": report.one_rank_bytes,
        "per_rank": [
            dict(asdict(s), fraction_of_one_rank=s.weight_bytes / report.one_rank_bytes)
            for s in report.shares
        ],
        "tokens": [
            {
                "tokens_per_rank": row.tokens_per_rank,
                "model_pick": row.pick,
                "engines": [
                    {
                        "engine": e.engine,
                        "bytes_sent_per_rank": e.bytes_sent,
                        "predicted_us": e.predicted_us,
                        "calls": [
                            {"kind": c.kind.value, "bytes": c.bytes_sent, "what": c.what} for c in e.calls
                        ],
                    }
                    for e in row.engines
                ],
            }
            for row in report.rows
        ],
    }


def render(report: ParallelExplanation) -> str:
    """The text of `moekit explain --ep/--tp N`."""
    n = report.world_size
    flag = "--ep" if report.mode is ParallelMode.EXPERT else "--tp"
    lines = [
        f"{report.mode.value} parallel over N={n} ranks ({flag} {n}), planned on paper",
        f"global spec: {report.spec}",
        f"1 rank: weights {_size(report.one_rank_bytes)}",
    ]
    for s in report.shares:
        ranks = f"rank {s.first}" if s.first == s.last else f"ranks {s.first}-{s.last}"
        frac = s.weight_bytes / report.one_rank_bytes
        lines.append(f"{ranks}: {s.spec}; weights {_size(s.weight_bytes)} ({frac:.3f} of 1 rank)")
    if report.constants.world_size and n > report.constants.world_size:
        lines.append(
            f"note: constants measured with {report.constants.world_size} ranks; N={n} is an extrapolation "
            "(latency and bus bandwidth held fixed)"
        )
    lines.append(report.model)
    for e in report.rows[0].engines if report.rows else ():
        calls = " + ".join(f"{c.kind.value}[{c.what}]" for c in e.calls)
        lines.append(f"engine {e.engine}: {calls}")
    per = "per rank" if report.mode is ParallelMode.EXPERT else "(replicated on every rank)"
    lines.append(f"communication per layer forward, T tokens {per}: bytes one rank sends, us (model)")
    names = [e.engine for e in report.rows[0].engines] if report.rows else []
    head = f"{'T':>7}" + "".join(f"  {n + ' bytes':>32}{'us':>10}" for n in names)
    lines.append(head + ("  model pick" if len(names) > 1 else ""))
    for row in report.rows:
        cells = "".join(f"  {_size(e.bytes_sent):>32}{e.predicted_us:>10.1f}" for e in row.engines)
        lines.append(f"{row.tokens_per_rank:>7}{cells}" + (f"  {row.pick}" if len(names) > 1 else ""))
    return "\n".join(lines)
