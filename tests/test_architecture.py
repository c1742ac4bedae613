"""The house rules of docs/ARCHITECTURE.md, checked on the source: sizes and import direction.

Read as text with :mod:`ast` (nothing is imported), so a rule broken anywhere in the tree fails
here with the file and line, whichever tests happen to run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dumper", "comparator")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

SHARED = ("dumper.errors", "dumper.settings", "dumper.progress", "dumper.prompts", "dumper.tokenizers",
          "dumper.resources", "dumper.format", "dumper.cli.common")
"""The torch-free part of ``dumper`` that the comparator may import (and ``dumper`` itself, whose
``__init__`` loads the hook API lazily)."""
LAZY_EXCEPTIONS = {("comparator/cli/main.py", "dumper.engines.sglang")}
"""Imports inside a function that the rules allow: the CLI converts an SGLang dumper directory."""
CAPTURE_SIDE = ("dumper.format", "dumper.hooks", "dumper.engines")
"""dumper subpackages that never import the comparator (the jobs and the CLI may)."""


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, deferred) for every import in ``path``; deferred: in a function or
    under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deferred = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                or (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    lazy = {id(n) for f in deferred for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in lazy
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno, id(node) in lazy
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{_rel(path)}:{node.lineno}: relative import; the tree uses absolute imports")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_module_and_function_sizes(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)}: {lines} lines (at most {MAX_MODULE_LINES})"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, \
                f"{_rel(path)}:{node.lineno}: {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})"


def test_the_comparator_imports_only_the_shared_part_of_the_dumper() -> None:
    bad = [f"{_rel(p)}:{line}: imports {mod}" for p in _modules() if _rel(p).startswith("comparator/")
           for mod, line, lazy in _imports(p)
           if _within(mod, ("dumper",)) and mod != "dumper" and not _within(mod, SHARED)
           and not (lazy and (_rel(p), mod) in LAZY_EXCEPTIONS)]
    assert not bad, "\n".join(bad)


def test_the_capture_side_never_imports_the_comparator() -> None:
    bad = [f"{_rel(p)}:{line}: imports {mod}" for p in _modules() if _within(_dotted(p), CAPTURE_SIDE + SHARED)
           for mod, line, _ in _imports(p) if _within(mod, ("comparator",))]
    assert not bad, "\n".join(bad)


def test_the_shared_part_and_the_renderers_never_import_torch_at_module_level() -> None:
    """Torch only inside functions there; the end-to-end check runs the CLI (tests/comparator/reports)."""
    bad = [f"{_rel(p)}:{line}: imports {mod} at module level" for p in _modules()
           if _within(_dotted(p), SHARED + ("comparator",))
           for mod, line, lazy in _imports(p) if _within(mod, ("torch", "transformers")) and not lazy]
    assert not bad, "\n".join(bad)


def test_every_package_directory_is_a_declared_package() -> None:
    """pyproject's package list names every source directory, so a wheel never misses a module."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {_dotted(p) for p in _modules() if p.name == "__init__.py"} - {"dumper.configs"}
    assert on_disk <= declared, f"not in pyproject.toml: {sorted(on_disk - declared)}"


def test_every_to_json_has_a_from_json() -> None:
    """One JSON codec: whatever a result writes, it reads back (round trips in tests/*/test_*codec*, test_results)."""
    bad = [f"{_rel(p)}:{c.lineno}: {c.name}.to_json has no from_json" for p in _modules()
           for c in ast.walk(ast.parse(p.read_text())) if isinstance(c, ast.ClassDef)
           and "to_json" in (names := {n.name for n in c.body if isinstance(n, ast.FunctionDef)})
           and "from_json" not in names]
    assert not bad, "\n".join(bad)
