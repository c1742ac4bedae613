"""The house rules of docs/ARCHITECTURE.md, checked on the source: layers, the one door, import cycles.

Read as text with :mod:`ast` (nothing is imported), so a rule broken anywhere in the tree fails
here with the file and line, whichever tests happen to run. :data:`LAYERS` is the source of truth
for who may import whom; every import counts, also one inside a function or under
``if TYPE_CHECKING:``. ``python tests/test_architecture.py --report ROOT [--old-table]`` prints the
same analysis for another checkout: modules, import edges, import circles, upward imports.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dumper", "comparator")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "dumper.errors",
            "dumper.settings",
            "dumper.progress",
            "dumper.prompts",
            "dumper.tokenizers",
            "dumper.modeldir",
            "dumper.resources",
            "dumper.version",
            "dumper.format.*",
            "dumper.server.*",
            "comparator.exports",
            "dumper.cli.common",
        ),
    ),
    ("comparator.judging", ("comparator.judging.*", "comparator.settings")),
    ("comparator.config", ("comparator.config",)),
    ("comparator.logprobs", ("comparator.logprobs.*",)),
    ("comparator.routing", ("comparator.routing.*",)),
    ("comparator.hidden", ("comparator.hidden.*",)),
    ("comparator.drill", ("comparator.drill.*",)),
    ("comparator.noise", ("comparator.noise.*",)),
    (
        "comparator.results",
        (
            "comparator.results",
            "comparator.outcome",
            "comparator.formatting",
        ),
    ),
    ("comparator.reports", ("comparator.reports.*",)),
    ("comparator.store", ("comparator.store.*",)),
    ("comparator.bisect", ("comparator.bisect.*",)),
    ("comparator.cli", ("comparator.testing", "comparator.cli.*", "comparator", "comparator.__main__")),
    ("dumper.hooks", ("dumper.hooks.*",)),
    ("dumper.prefill", ("dumper.prefill.*",)),
    ("dumper.engines", ("dumper.engines.*",)),
    ("dumper.jobs", ("dumper.jobs.*",)),
    ("dumper.cli", ("dumper.cli.*", "dumper", "dumper.__main__")),
)
"""The layers, low to high: a module imports modules of its own layer or lower ones. ``pkg.*`` is
the package ``pkg`` and everything under it; the most specific pattern places a module (a name
beats ``pkg.*``, and ``a.b.*`` beats ``a.*``), and every module has exactly one place. The
comparator sits below the capture side, so it never imports ``dumper.hooks``/``engines``/``jobs``;
the capture side never imports the comparator either (its own test below). ``dumper.prefill``:
the model presets and the prefill job the engines build on (``RunConfig``, forward passes, logprob recording,
decode steps)."""

EXCEPTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "comparator.cli.*",
        "dumper.engines.sglang",
        "lazily, inside a function: the CLI converts an SGLang dumper directory it is given",
    ),
    (
        "comparator.cli.*",
        "dumper.engines.sglang_files",
        "lazily, inside a function: the CLI tells an SGLang dumper directory by its files",
    ),
)
"""Upward imports the rules allow: (importer pattern, imported pattern, reason); each must be lazy."""

CYCLES: tuple[tuple[frozenset[str], str], ...] = ()
"""Import circles the rules allow: (members, reason). None today."""

Table = tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]
OLD_TABLE: Table = (
    (
        "core",
        tuple(
            f"dumper.{m}" for m in ("errors", "settings", "progress", "prompts", "tokenizers", "modeldir", "resources")
        ),
        (),
    ),
    ("dumper.format", ("dumper.format.*",), ("core",)),
    ("dumper.hooks", ("dumper.hooks.*",), ("dumper.format", "core")),
    ("dumper.engines", ("dumper.engines.*",), ("dumper.hooks", "dumper.format", "core", "dumper.prefill.presets")),
    (
        "comparator top",
        tuple(
            f"comparator.{m}"
            for m in ("results", "outcome", "config", "settings", "thresholds", "jsonfloat", "testing")
        ),
        ("dumper.format", "core"),
    ),
    ("comparator.logprobs", ("comparator.logprobs.*",), ("comparator top",)),
    (
        "comparator.hidden",
        ("comparator.hidden.*",),
        ("comparator top", "comparator.noise.model", "comparator.logprobs"),
    ),
    ("comparator.noise", ("comparator.noise.*",), ("comparator.hidden", "comparator.logprobs")),
    (
        "comparator.reports",
        ("comparator.reports.*",),
        ("comparator.results", "comparator.outcome", "dumper.format", "core"),
    ),
    (
        "comparator.store",
        ("comparator.store.*",),
        ("comparator top", "comparator.logprobs", "comparator.hidden", "comparator.noise", "comparator.reports"),
    ),
    ("comparator.cli", ("comparator.cli.*", "comparator", "comparator.__main__"), ("*",)),
    (
        "dumper.jobs",
        ("dumper.jobs.*",),
        (
            "core",
            "dumper.format",
            "dumper.hooks",
            "dumper.engines",
            "comparator top",
            "comparator.logprobs",
            "comparator.hidden",
            "comparator.noise",
            "comparator.reports",
            "comparator.store",
        ),
    ),
    ("dumper.cli", ("dumper.cli.*", "dumper", "dumper.__main__"), ("*",)),
)
"""docs/ARCHITECTURE.md's table before issue 21, as written, for ``--report --old-table``: (group,
patterns, what it may import: groups, taken transitively, or module patterns; ``*`` everything)."""

CAPTURE_SIDE = ("dumper.format", "dumper.server", "dumper.hooks", "dumper.prefill", "dumper.engines")
"""dumper subpackages that never import the comparator (the jobs and the CLI may)."""
SHARED = tuple(p.removesuffix(".*") for p in LAYERS[0][1] if p.startswith("dumper"))
"""The torch-free part of ``dumper`` that the comparator may import: the core layer's dumper modules."""


@dataclass(frozen=True)
class Import:
    """One imported module of one import statement; ``lazy``: inside a function or under ``if TYPE_CHECKING``."""

    src: str
    path: str
    line: int
    target: str
    lazy: bool

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _module_files(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def _dotted(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path, modules: frozenset[str]) -> Iterator[Import]:
    """Every import in ``path``, also external ones; ``from a.b import c`` is ``a.b.c`` when that is a module."""
    rel, src = path.relative_to(root).as_posix(), _dotted(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    deferred = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        or (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    ]
    lazy = {id(n) for f in deferred for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{rel}:{node.lineno}: relative import; the tree uses absolute imports")
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        else:
            continue
        for target in dict.fromkeys(targets):
            yield Import(src, rel, node.lineno, target, id(node) in lazy)


def _matches(pattern: str, module: str) -> bool:
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def _place(module: str, table: Table) -> tuple[str | None, str]:
    """The layer of ``module`` by its most specific pattern, or ``None`` and why it has no one place."""
    hits = [
        (not pat.endswith(".*"), len(pat), name, pat)
        for name, pats, _ in table
        for pat in pats
        if _matches(pat, module)
    ]
    if not hits:
        return None, "matches no layer pattern"
    best = [h for h in hits if h[:2] == max(hits)[:2]]
    if len(best) > 1:
        return None, "matches " + " and ".join(f"{pat} ({name})" for *_, name, pat in best)
    return best[0][2], ""


def _allowed(table: Table) -> dict[str, tuple[set[str], tuple[str, ...]]]:
    """Per layer: the layers it may import (itself, transitively) and the module patterns it may import."""
    direct = {name: may for name, _, may in table}
    out = {}
    for name, _, _ in table:
        layers, todo, patterns = {name}, [name], []
        while todo:
            for item in direct[todo.pop()]:
                if item in direct and item not in layers:
                    layers.add(item)
                    todo.append(item)
                elif item not in direct:
                    patterns.append(item)
        out[name] = (layers, tuple(patterns))
    return out


def linear(layers: tuple[tuple[str, tuple[str, ...]], ...]) -> Table:
    """A layer list as a table: each layer may import the layers below it."""
    return tuple((name, pats, tuple(n for n, _ in layers[:i])) for i, (name, pats) in enumerate(layers))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, out = [], []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


@dataclass(frozen=True)
class Analysis:
    """The import graph of one checkout, judged against one table."""

    modules: dict[str, str]
    """Dotted name -> file relative to the root."""
    imports: list[Import]
    internal: list[Import]
    """The imports of a module of the tree (a module importing itself left out): the graph's edges."""
    unplaced: list[str]
    upward: list[tuple[Import, str, str]]
    """Each import to a higher layer (or one the table does not allow), with the two layers."""
    circles: list[list[str]]
    own_package: list[Import]
    used_exceptions: set[int]


def _exception(imp: Import) -> int | None:
    return next(
        (
            k
            for k, (src, dst, _) in enumerate(EXCEPTIONS)
            if imp.lazy and _matches(src, imp.src) and _matches(dst, imp.target)
        ),
        None,
    )


def analyze(root: Path, table: Table | None = None) -> Analysis:
    """Every import of every module under ``root``'s packages, judged against ``table`` (:data:`LAYERS`)."""
    table = linear(LAYERS) if table is None else table
    files = {_dotted(p, root): p for p in _module_files(root)}
    modules = {m: p.relative_to(root).as_posix() for m, p in files.items()}
    compiled = {
        _dotted(p.parent, root) + "." + p.name.split(".")[0]
        for pkg in PACKAGES
        for ext in ("c", "so", "pyd")
        for p in (root / pkg).rglob(f"*.{ext}")
    }
    imports = [i for p in files.values() for i in _imports(p, root, frozenset(files) | compiled)]
    placed = {m: _place(m, table) for m in modules}
    allowed, used = _allowed(table), set()
    upward = []
    for imp in imports:
        src, dst = placed[imp.src][0], placed.get(imp.target, (None, ""))[0]
        if (
            src is None
            or dst is None
            or dst in allowed[src][0]
            or any(_matches(p, imp.target) for p in allowed[src][1])
        ):
            continue
        if (k := _exception(imp)) is not None:
            used.add(k)
        else:
            upward.append((imp, src, dst))
    internal = [i for i in imports if i.target in modules and i.target != i.src]
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in internal:
        graph[imp.src].add(imp.target)
    unplaced = [f"{modules[m]}: {m} {why}" for m, (layer, why) in sorted(placed.items()) if layer is None]
    own = [i for i in internal if i.src.startswith(i.target + ".")]
    return Analysis(modules, imports, internal, unplaced, upward, circles(graph), own, used)


@functools.cache
def _here() -> Analysis:
    return analyze(ROOT)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _circle_text(a: Analysis, members: list[str]) -> str:
    inner = [f"{i.where} -> {i.target}" for i in a.internal if i.src in members and i.target in members]
    return f"{' <-> '.join(members)} ({'; '.join(inner)})"


def test_every_module_has_exactly_one_layer() -> None:
    """(d) A new module gets a place in LAYERS (or matches a ``pkg.*`` pattern) before it lands."""
    unplaced = _here().unplaced
    assert not unplaced, "no one layer in tests/test_architecture.py LAYERS:\n" + "\n".join(unplaced)


def test_no_module_imports_a_higher_layer() -> None:
    """(a) Imports point down the layers; an upward one is named in EXCEPTIONS with its reason."""
    bad = [
        f"{imp.where}: {imp.src} (layer {src}) imports {imp.target} (layer {dst}), a higher layer"
        f"{' (inside a function)' if imp.lazy else ''}"
        for imp, src, dst in _here().upward
    ]
    assert not bad, "\n".join(bad)


def test_every_named_exception_is_still_used() -> None:
    stale = [f"{src} -> {dst}" for k, (src, dst, _) in enumerate(EXCEPTIONS) if k not in _here().used_exceptions]
    assert not stale, "EXCEPTIONS names imports that no longer exist: " + ", ".join(stale)


def test_no_import_cycle() -> None:
    """(b) All imports count, lazy ones too: a function-level import never dodges a cycle."""
    a = _here()
    named = {members for members, _ in CYCLES}
    bad = [_circle_text(a, c) for c in a.circles if frozenset(c) not in named]
    assert not bad, "import cycles:\n" + "\n".join(bad)
    stale = [sorted(m) for m in named if sorted(m) not in a.circles]
    assert not stale, f"CYCLES names circles that no longer exist: {stale}"


def test_no_module_imports_its_own_package() -> None:
    """(c) ``from pkg import x`` inside ``pkg`` runs ``pkg/__init__``, which imports its modules: a hidden cycle."""
    bad = [
        f"{i.where}: {i.src} imports {i.target}, the __init__ of its own package (import the defining module)"
        for i in _here().own_package
    ]
    assert not bad, "\n".join(bad)


def test_the_comparator_imports_only_the_shared_part_of_the_dumper() -> None:
    bad = [
        f"{i.where}: imports {i.target}"
        for i in _here().imports
        if _within(i.src, ("comparator",))
        and _within(i.target, ("dumper",))
        and i.target != "dumper"
        and not _within(i.target, SHARED)
        and _exception(i) is None
    ]
    assert not bad, "\n".join(bad)


def test_the_dumper_uses_the_comparator_only_through_its_public_api() -> None:
    """``from comparator import ...`` (what ``comparator/__init__.py`` exports) and nothing deeper, no exception."""
    bad = [
        f"{i.where}: imports {i.target}; export it from comparator/__init__.py and import it from there"
        for i in _here().imports
        if _within(i.src, ("dumper",)) and _within(i.target, ("comparator",)) and i.target != "comparator"
    ]
    assert not bad, "\n".join(bad)


def test_the_capture_side_never_imports_the_comparator() -> None:
    bad = [
        f"{i.where}: imports {i.target}"
        for i in _here().imports
        if _within(i.src, CAPTURE_SIDE + SHARED) and _within(i.target, ("comparator",))
    ]
    assert not bad, "\n".join(bad)


def test_the_shared_part_and_the_renderers_never_import_torch_at_module_level() -> None:
    """Torch only inside functions there; the end-to-end check runs the CLI (tests/comparator/reports)."""
    bad = [
        f"{i.where}: imports {i.target} at module level"
        for i in _here().imports
        if _within(i.src, SHARED + ("comparator",)) and _within(i.target, ("torch", "transformers")) and not i.lazy
    ]
    assert not bad, "\n".join(bad)


def test_every_package_directory_is_a_declared_package() -> None:
    """pyproject's package list names every source directory, so a wheel never misses a module."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {_dotted(p) for p in _module_files(ROOT) if p.name == "__init__.py"} - {"dumper.configs"}
    assert on_disk <= declared, f"not in pyproject.toml: {sorted(on_disk - declared)}"


def test_every_to_json_has_a_from_json() -> None:
    """One JSON codec: whatever a result writes, it reads back (round trips in tests/*/test_*codec*, test_results)."""
    bad = [
        f"{_rel(p)}:{c.lineno}: {c.name}.to_json has no from_json"
        for p in _module_files(ROOT)
        for c in ast.walk(ast.parse(p.read_text()))
        if isinstance(c, ast.ClassDef)
        and "to_json" in (names := {n.name for n in c.body if isinstance(n, ast.FunctionDef)})
        and "from_json" not in names
    ]
    assert not bad, "\n".join(bad)


def report(root: Path, table: Table | None = None) -> str:
    """The analysis of ``root`` as text: modules, edges, circles and their members, upward imports by layer pair."""
    a = analyze(root, table)
    edges = {(i.src, i.target) for i in a.internal}
    lines = [
        f"{root}: {len(a.modules)} modules, {len(edges)} import edges ({len(a.internal)} imports)",
        f"import circles: {len(a.circles)}",
    ]
    lines += [f"  {len(c)} modules: {_circle_text(a, c)}" for c in a.circles]
    pairs: dict[tuple[str, str], list[Import]] = {}
    for imp, src, dst in a.upward:
        pairs.setdefault((src, dst), []).append(imp)
    lines.append(
        f"upward imports: {len(a.upward)} ({sum(not i.lazy for i, _, _ in a.upward)} at module level; "
        f"{len({(i.src, i.target) for i, _, _ in a.upward})} module edges)"
    )
    for (src, dst), imps in sorted(pairs.items()):
        lines.append(f"  {src} -> {dst}: {len(imps)}")
        lines += [f"    {i.where}: {i.src} -> {i.target}{' (lazy)' if i.lazy else ''}" for i in imps]
    lines.append(f"modules with no one layer: {len(a.unplaced)}")
    lines += [f"  {u}" for u in a.unplaced]
    lines.append(f"imports of the own package's __init__: {len(a.own_package)}")
    lines += [f"  {i.where}: {i.src} -> {i.target}" for i in a.own_package]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``--report ROOT [--old-table]``: print :func:`report` for a checkout."""
    if len(argv) not in (2, 3) or argv[0] != "--report" or argv[2:] not in ([], ["--old-table"]):
        print("usage: python tests/test_architecture.py --report ROOT [--old-table]", file=sys.stderr)
        return 2
    print(report(Path(argv[1]).resolve(), OLD_TABLE if argv[2:] else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
