"""The parallel flags of the `moekit` command: `explain --ep N / --tp N` and `bench --parallel ep|tp`.

Data flow: argparse namespace -> `parallel_flags` checks --ep/--tp (N >= 2, one of them, N <= E for
expert parallelism, I/N on block boundaries for tensor parallelism: the layer's own sharding rules),
--rank-tokens and --constants, and plans the layer for N ranks at once (`explain_parallel`), so that a
refused N is a usage error (exit status 2, one line) before anything is printed -> `print_parallel_
explanation` prints it as text or JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from moekit.app.cli_errors import UsageError
from moekit.app.cli_spec import add_spec_flags, at_least, spec_from_flags, token_counts
from moekit.app.explain_parallel import DEFAULT_RANK_TOKENS, as_dict, explain_parallel, render
from moekit.ep.constants import DEFAULT_TABLE, load_collectives
from moekit.ep.engines import EpEngine
from moekit.errors import MoekitError
from moekit.parallel import ParallelMode
from moekit.presets import cap_experts


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "planning for N ranks on paper (a model of the communication, not a measurement)"
    )
    g.add_argument("--ep", type=int, default=None, metavar="N", help="expert parallelism over N ranks")
    g.add_argument("--tp", type=int, default=None, metavar="N", help="tensor parallelism over N ranks")
    g.add_argument(
        "--rank-tokens",
        default=None,
        help="comma-separated tokens per rank for --ep/--tp (default: "
        + ",".join(map(str, DEFAULT_RANK_TOKENS))
        + ")",
    )
    g.add_argument(
        "--constants",
        type=Path,
        default=None,
        help=f"collective constants table (default: the shipped {DEFAULT_TABLE.name}; "
        "write one with benchmarks/fit_collectives.py --out)",
    )


def _rank_tokens(text: str | None) -> tuple[int, ...]:
    if text is None:
        return DEFAULT_RANK_TOKENS
    try:
        return token_counts(text, minimum=1)
    except UsageError as err:
        raise UsageError(str(err).replace("--tokens", "--rank-tokens")) from err


def refuse_single_device_flags(args: argparse.Namespace) -> None:
    """`explain --ep/--tp` plans N ranks on paper, with --rank-tokens and --constants: the flags of a plan
    for one device (--tokens, --device, --table, --strict) would be ignored, so they are refused."""
    if args.ep is None and args.tp is None:
        return
    mode = f"--ep {args.ep}" if args.ep is not None else f"--tp {args.tp}"
    given = [
        flag
        for flag, value in (
            ("--tokens", args.tokens),
            ("--device", args.device),
            ("--table", args.table),
            ("--strict", args.strict or None),
        )
        if value is not None
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} would be ignored with {mode}: they plan one device, {mode} plans N ranks "
            "on paper; drop them (--rank-tokens sets the tokens per rank)"
        )


def parallel_flags(args: argparse.Namespace) -> None:
    """Check the parallel flags of `explain` and plan for N ranks (`args.parallel_report`)."""
    args.parallel_mode = None
    if args.ep is not None and args.tp is not None:
        raise UsageError(
            f"--ep {args.ep} and --tp {args.tp}: plan one parallel mode at a time; give one of them"
        )
    if args.ep is None and args.tp is None:
        for flag, value in (("--rank-tokens", args.rank_tokens), ("--constants", args.constants)):
            if value is not None:
                raise UsageError(f"{flag} plans for N ranks and would be ignored; add --ep N or --tp N")
        return
    flag, world = ("--ep", args.ep) if args.ep is not None else ("--tp", args.tp)
    mode = ParallelMode.EXPERT if flag == "--ep" else ParallelMode.TENSOR
    if world < 2:
        raise UsageError(f"{flag} must be >= 2 ranks, got {world}: one rank moves nothing; drop {flag}")
    tokens = _rank_tokens(args.rank_tokens)
    constants = load_collectives(args.constants)
    try:
        args.parallel_report = explain_parallel(
            args.spec, mode=mode, world=world, tokens=tokens, constants=constants
        )
    except MoekitError as err:  # the layer's sharding rules refuse this N
        raise UsageError(f"{flag} {world}: {err}", kind=type(err).__name__) from err
    args.parallel_mode = mode


def print_parallel_explanation(args: argparse.Namespace, console: Console) -> int:
    if args.json:
        print(json.dumps(as_dict(args.parallel_report), indent=2))
    else:
        console.print(render(args.parallel_report), highlight=False, markup=False, soft_wrap=True)
    return 0


def add_bench_parallel_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "parallel (under torchrun: torchrun --nproc-per-node N -m moekit.app.cli bench ...)"
    )
    g.add_argument(
        "--parallel", choices=["ep", "tp"], default=None, help="time the layer over the torchrun group"
    )
    g.add_argument(
        "--engine", choices=[e.value for e in EpEngine], default=None, help="--parallel ep's engine"
    )
    g.add_argument("--max-experts", type=int, default=None, help="cap E (--parallel)")
    g.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="--parallel: cuda (NCCL) or cpu (gloo)"
    )
    add_spec_flags(parser)


_SPEC_FLAGS = ("experts", "top_k", "hidden", "intermediate", "weight_format", "fp8_scale", "act_dtype")


def bench_parallel_flags(args: argparse.Namespace) -> bool:
    """Check `bench`'s parallel flags; True when --parallel is given (the flags for it are then checked)."""
    given = [
        f"--{n.replace('_', '-')}"
        for n in ("engine", "max_experts", "device")
        if getattr(args, n) is not None
    ]
    given += [f"--{n.replace('_', '-')}" for n in _SPEC_FLAGS if getattr(args, n, None) is not None]
    if args.parallel is None:
        if given:
            raise UsageError(f"{', '.join(given)}: only for --parallel ep|tp; add --parallel or drop them")
        return False
    from moekit.app.bench_parallel import TORCHRUN_NEEDED, under_torchrun

    if not under_torchrun():
        raise UsageError(TORCHRUN_NEEDED)
    if "," in args.preset:
        raise UsageError(f"--preset {args.preset}: --parallel times one preset; give one name")
    if args.plot is not None:
        raise UsageError(
            f"--plot {args.plot} draws the single-GPU sweep and would be ignored with --parallel; drop one"
        )
    if args.engine is not None and args.parallel == "tp":
        raise UsageError(f"--engine {args.engine}: tensor parallelism moves no tokens; drop --engine")
    if args.max_experts is not None:
        at_least("--max-experts", args.max_experts, 1)
    args.tokens = token_counts(args.tokens, minimum=1)
    args.spec = cap_experts(spec_from_flags(args), args.max_experts)
    args.device = args.device or "cuda"
    args.engine = None if args.engine is None else EpEngine(args.engine)  # None: chosen per bucket
    args.constants = load_collectives()
    return True


def run_bench_parallel(args: argparse.Namespace, console: Console) -> NoReturn:
    """Time the layer on this rank (one process of torchrun's), rank 0 prints and writes the records;
    then the process exits with 0 if every record is within tolerance, else 1 (`exit_torchrun_group`)."""
    import torch.distributed as dist
    from rich.table import Table

    from moekit.app.bench_parallel import bench_parallel, exit_torchrun_group, init_from_torchrun

    device = init_from_torchrun(args.device)
    mode = ParallelMode.EXPERT if args.parallel == "ep" else ParallelMode.TENSOR
    records = bench_parallel(
        args.spec, mode=mode, tokens=args.tokens, device=device, constants=args.constants, engine=args.engine
    )
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        table = Table(
            title=f"moekit bench --parallel {args.parallel}, {world} ranks on {device.type}: {args.preset}"
        )
        for col in (
            "T/rank",
            "engine",
            "parallel µs eager / graph",
            "1-rank µs eager / graph",
            "tok/s/GPU ratio",
            "comm µs measured / model",
            "experts µs",
            "rel L2",
        ):
            table.add_column(col)
        for r in records:
            verdict = "ok" if r.ok else "FAIL"
            table.add_row(
                str(r.tokens_per_rank),
                r.engine,
                f"{r.parallel_us:.1f} / {_us(r.parallel_graph_us)}",
                f"{r.one_rank_us:.1f} / {_us(r.one_rank_graph_us)}",
                f"{r.per_gpu_ratio:.2f}",
                f"{_us(r.comm_us)} / {r.model_comm_us:.1f}",
                _us(r.experts_us),
                f"{r.rel_l2:.1e} <= {r.tolerance:g} {verdict}",
            )
        Console(width=max(console.width, 150)).print(table)  # eight columns: no ellipses in a narrow pipe
        console.print(
            f"spec: {args.spec.describe()}; ratio: best of eager and graph on each side; comm: the engine "
            "(TP: the all-reduce) with no expert compute; experts: this rank's experts alone on the rows "
            "they compute (both CUDA-graph replays where capturable); model comm µs is a model, not a "
            "measurement "
            f"(constants: {args.constants.describe()})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        if args.json:
            from dataclasses import asdict

            rows = [dict(asdict(r), ok=r.ok) for r in records]
            args.json.write_text(json.dumps({"spec": args.spec.describe(), "records": rows}, indent=1))
    code = 0 if all(r.ok for r in records) else 1
    exit_torchrun_group(code)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
