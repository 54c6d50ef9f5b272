"""How the `moekit` command fails: one line on stderr, an exit status that says whose fault it was.

Data flow: argparse's own complaints (a bad int, an unknown choice) -> `UsageError` through
`Parser.error`; a flag value moekit refuses while the command reads its flags (`flag_values`) ->
`UsageError`; a `MoekitError` while the job runs -> reported as it is. `report` prints either as one line
on stderr and, with `--json`, as `{"error": {...}}` on stdout, so that stdout holds JSON only.

Exit status: 0 the job ran and passed; 1 the job ran and failed (a self-check, a tuning step) or moekit
refused something while running (a checkpoint, a strict plan); 2 a usage error: a flag, or a flag value,
that the command refuses before it starts any work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator

from moekit.errors import MoekitError

EXIT_FAILED = 1
EXIT_USAGE = 2
JSON_COMMANDS = ("run", "explain", "check")  # where --json means JSON on stdout (bench writes a file)


class UsageError(MoekitError, ValueError):
    """A command-line flag, or its value, that the command refuses before it starts (exit status 2)."""

    def __init__(self, message: str, *, kind: str = "UsageError") -> None:
        super().__init__(message)
        self.kind = kind  # the error class behind it, e.g. "SpecError" for a spec flag out of range


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose complaints are `UsageError`s (one line), not a usage dump and exit(2)."""

    def error(self, message: str):  # type: ignore[override]  # argparse's hook; it must not return
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


@contextlib.contextmanager
def flag_values() -> Iterator[None]:
    """Any `MoekitError` raised inside (a spec flag out of range, an unknown device) is a usage error."""
    try:
        yield
    except UsageError:
        raise
    except MoekitError as err:
        raise UsageError(str(err), kind=type(err).__name__) from err


def wants_json(argv: list[str]) -> bool:
    """Whether the command line asks for JSON output, read from argv (argparse may have refused it)."""
    return bool(argv) and argv[0] in JSON_COMMANDS and "--json" in argv


def one_line(text: str) -> str:
    """A multi-line message (a plan's explanation) as one line: lines joined by "; " (" " after a ":")."""
    out = ""
    for line in (part.strip() for part in text.splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def report(err: MoekitError, *, json_output: bool) -> int:
    """Print `err` as one line on stderr (and as JSON on stdout with --json); return the exit status."""
    status = EXIT_USAGE if isinstance(err, UsageError) else EXIT_FAILED
    kind = err.kind if isinstance(err, UsageError) else type(err).__name__
    message = one_line(str(err))
    if json_output:
        error = {"type": kind, "message": message, "usage": status == EXIT_USAGE, "exit_status": status}
        print(json.dumps({"error": error}))
    print(f"moekit: {kind}: {message}", file=sys.stderr)
    return status
