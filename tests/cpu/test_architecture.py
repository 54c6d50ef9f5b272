"""The shape of the code base, read from the source: layers, import cycles, file sizes, no lab notebook.

Data flow: every module under src/moekit is parsed (ast, nothing is imported) -> its imports, top-level
and inside functions, become edges between moekit modules -> the edges are checked against LAYERS (the
table docs/architecture.md draws) and for cycles; the tree itself is checked for long files, history in
comments and tracked result dumps.

LAYERS is the single statement of which layer a module belongs to: a new module whose prefix is not in
it fails `test_every_module_has_a_layer` until it is placed (and docs/architecture.md updated with it).
"""

import ast
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "src" / "moekit").is_dir():
            return parent
    raise RuntimeError(f"no repository root (pyproject.toml + src/moekit) above {here}")


ROOT = _repo_root()
SRC = ROOT / "src"
PACKAGE = "moekit"

# Module prefix -> rank. A module may import modules of its own rank or lower, never higher.
# Longest prefix wins (on dotted boundaries). Mirrors the picture in docs/architecture.md.
LAYERS: dict[str, int] = {
    # base: what the math is, its errors, its data formats and weight container
    "moekit.errors": 0,
    "moekit.spec": 0,
    "moekit.presets": 0,
    "moekit.formats": 0,
    "moekit.weights": 0,
    # rules and math on torch alone: input checks, routing (torch twin), the oracle
    "moekit.checks": 1,
    "moekit.routing": 1,
    "moekit.reference": 1,
    # kernels: the interface, the registry and every implementation
    "moekit.kernels": 2,
    # planning: which capable kernel and config, from tuned tables
    "moekit.planning": 3,
    # ops: run a plan (and pick the fast routing path)
    "moekit.ops": 4,
    # a layer's router: logits, and whether routing is per token on a device
    "moekit.router": 4,
    # expert parallelism: ownership, the dispatch/combine engines (they run the caller's local experts)
    "moekit.ep": 5,
    # a layer's share on each rank of a torch.distributed group (parallel API, sharding, the EP forward)
    "moekit.parallel": 5,
    # the layer and what builds one
    "moekit.custom_op": 5,
    "moekit.layer": 5,
    "moekit.layer_support": 5,
    "moekit.checkpoint": 5,
    "moekit.synthetic": 5,
    # frameworks
    "moekit.integrations": 6,
    # the application: command line, jobs, benchmarks, autotuner
    "moekit.app": 7,
}
# The public facade (moekit/__init__.py) re-exports every layer: it has no rank of its own; importing it
# counts as importing the highest layer it re-exports (see `_rank`).
FACADE = PACKAGE

MAX_LINES = 500
HISTORY = re.compile(r"(session|call) [0-9]+|RESULTS\.md|guide §", re.IGNORECASE)
# Where JSON may be tracked: shipped tuned tables, collective constants and test fixtures.
JSON_HOMES = ("src/moekit/planning/tables/", "src/moekit/ep/tables/", "tests/")


@dataclass(frozen=True)
class Edge:
    """`importer` imports `target` (both moekit module names) at `where` (path:line)."""

    importer: str
    target: str
    where: str
    implicit: bool = False  # the parent package a submodule import runs first


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def _targets_of(node: ast.AST, importer: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The moekit modules one import statement loads (`from a import b` is `a.b` when b is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = _resolve_relative(importer, is_package, node.level, node.module)
    else:
        base = node.module or ""
    if base.split(".")[0] != PACKAGE:
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in modules else base)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def _edges() -> tuple[Edge, ...]:
    modules = _modules()
    edges = []
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # walks function bodies too: lazy imports are imports
            for target in _targets_of(node, importer, is_package, modules):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if target != importer:
                    edges.append(Edge(importer, target, where))
                # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless the importer is inside
                # them already (then they are mid-import and Python does not run them again).
                mine = set(_ancestors(importer)) | {importer}
                for package in _ancestors(target):
                    if package != FACADE and package in modules and package not in mine:
                        edges.append(Edge(importer, package, where, implicit=True))
    return tuple(edges)


def _layer_of(name: str) -> int | None:
    best = None
    for prefix, rank in LAYERS.items():
        if name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    return None if best is None else best[1]


def _rank(name: str) -> int | None:
    if name == FACADE:
        ranks = [_layer_of(e.target) for e in _edges() if e.importer == FACADE and not e.implicit]
        return max((r for r in ranks if r is not None), default=None)
    return _layer_of(name)


def _cycles(edges: tuple[Edge, ...]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one cycle through it."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def _describe(edges: list[Edge]) -> str:
    return "\n".join(
        f"  {e.importer} -> {e.target} ({e.where}{', parent package' if e.implicit else ''})" for e in edges
    )


def test_every_module_has_a_layer():
    unplaced = [name for name in _modules() if name != FACADE and _layer_of(name) is None]
    assert not unplaced, (
        f"modules outside the layer table: {unplaced}; add their prefix to LAYERS here and to "
        "docs/architecture.md"
    )


def test_no_import_cycle():
    cycles = _cycles(_edges())
    by_pair = {(e.importer, e.target): e for e in _edges()}
    lines = []
    for cycle in cycles:
        lines.append("cycle: " + " -> ".join(cycle))
        lines.append(_describe([by_pair[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False)]))
    assert not cycles, "import cycles among moekit modules:\n" + "\n".join(lines)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = []
    for e in _edges():
        if e.importer == FACADE:
            continue
        mine, theirs = _rank(e.importer), _rank(e.target)
        if mine is not None and theirs is not None and theirs > mine:
            upward.append(e)
    lines = [
        f"  {e.importer} (layer {_rank(e.importer)}) -> {e.target} (layer {_rank(e.target)}) at {e.where}"
        + (" (parent package)" if e.implicit else "")
        for e in upward
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(lines)


def test_private_modules_stay_private():
    # `a.b._c` (and what lies under it) is an implementation detail of package `a.b`: only modules of
    # `a.b` use it, so its kernels can change without a caller outside noticing.
    leaks = []
    for e in _edges():
        parts = e.target.split(".")
        private = [i for i, part in enumerate(parts) if part.startswith("_")]
        if not private:
            continue
        owner = ".".join(parts[: private[0]])
        if not (e.importer == owner or e.importer.startswith(owner + ".")):
            leaks.append(e)
    assert not leaks, "private modules imported from outside their package:\n" + _describe(leaks)


def test_nothing_inside_moekit_imports_the_facade():
    # `from moekit import X` inside the package hides which layer X comes from (and closes a cycle
    # through __init__ for every module the facade re-exports): import X from its own module.
    through_facade = [e for e in _edges() if e.target == FACADE and not e.implicit]
    assert not through_facade, "the public facade imported inside moekit:\n" + _describe(through_facade)


def test_no_long_source_file():
    # Python only: the shipped tuned tables under src/ are data, one row per line group, and grow with
    # every device that is tuned.
    long = {}
    for path in sorted(SRC.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long[str(path.relative_to(ROOT))] = n
    assert not long, f"files over {MAX_LINES} lines (split them, one job each): {long}"


def test_no_history_in_src():
    hits = []
    for path in sorted(p for p in SRC.rglob("*") if p.is_file() and p.suffix in {".py", ".json", ".md"}):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"  {path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not hits, (
        "comments tell history (which run measured what) or cite files not in the tree; say why, "
        "as a fact, and leave the story to commit messages:\n" + "\n".join(hits)
    )


def test_no_result_dumps_tracked():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked")
    proc = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    tracked = proc.stdout.splitlines()
    dumps = [
        f
        for f in tracked
        if f.startswith("benchmarks/results/") or (f.endswith(".json") and not f.startswith(JSON_HOMES))
    ]
    assert not dumps, (
        f"result dumps tracked in git: {dumps}; benchmarks write them where told (--json) or under the "
        "git-ignored bench-results/"
    )
