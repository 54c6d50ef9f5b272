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

from rich.console import Console

from moekit.app.cli_errors import UsageError
from moekit.app.cli_spec import token_counts
from moekit.app.explain_parallel import DEFAULT_RANK_TOKENS, as_dict, explain_parallel, render
from moekit.ep.constants import DEFAULT_TABLE, load_collectives
from moekit.errors import MoekitError
from moekit.parallel import ParallelMode


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
