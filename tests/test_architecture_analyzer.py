"""The import analyzer of tests/test_architecture.py on a small tree written here: what it counts and how."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_architecture import LAYERS, OLD_TABLE, _place, analyze, linear, main, report

TREE = {
    "dumper/__init__.py": "",
    "dumper/errors.py": "",
    "dumper/format/__init__.py": "from dumper.format.manifest import M\n",
    "dumper/format/manifest.py": "from dumper.format import atomic\n",
    "dumper/format/atomic.py": "from dumper.errors import E\nimport numpy\n",
    "dumper/hooks/__init__.py": "",
    "dumper/hooks/a.py": "from dumper.hooks.b import f\n",
    "dumper/hooks/b.py": "def f():\n    from dumper.hooks import a\n",
    "dumper/engines/__init__.py": "",
    "dumper/engines/sglang.py": "",
    "comparator/__init__.py": "",
    "comparator/_kernels.c": "",
    "comparator/results.py": "",
    "comparator/newthing.py": "",
    "comparator/hidden/__init__.py": "",
    "comparator/hidden/x.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from comparator.results import R\n"
    ),
    "comparator/hidden/k.py": "from comparator import _kernels\n",
    "comparator/noise/__init__.py": "",
    "comparator/noise/n.py": "import comparator.hidden.x\n",
    "comparator/store/__init__.py": "",
    "comparator/store/y.py": "from comparator.store import Z\n",
    "comparator/cli/__init__.py": "",
    "comparator/cli/main.py": "def convert():\n    import dumper.engines.sglang\n",
    "comparator/cli/bad.py": "import dumper.engines.sglang\n",
}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_every_import_counts_and_resolves_to_a_module(tree: Path) -> None:
    a = analyze(tree)
    edges = {(i.src, i.target, i.lazy) for i in a.internal}
    assert ("dumper.format.manifest", "dumper.format.atomic", False) in edges  # from a.b import c: the module a.b.c
    assert ("comparator.store.y", "comparator.store", False) in edges  # from a.b import name: a.b
    assert ("dumper.hooks.b", "dumper.hooks.a", True) in edges  # inside a function
    assert ("comparator.hidden.x", "comparator.results", True) in edges  # under if TYPE_CHECKING
    assert {i.target for i in a.imports if i.src == "comparator.hidden.k"} == {"comparator._kernels"}  # C extension
    assert not any(i.target in ("numpy", "comparator._kernels") for i in a.internal)


def test_the_four_checks(tree: Path) -> None:
    a = analyze(tree)
    assert a.circles == [["dumper.hooks.a", "dumper.hooks.b"]]  # the function-level import does not dodge it
    assert {(i.src, i.target, src, dst) for i, src, dst in a.upward} == {
        ("comparator.hidden.x", "comparator.results", "comparator.hidden", "comparator.results"),
        ("comparator.cli.bad", "dumper.engines.sglang", "comparator.cli", "dumper.engines"),  # not lazy: no exception
    }
    assert a.used_exceptions == {0}  # comparator.cli.main's lazy import is the named exception
    assert [(i.where, i.target) for i in a.own_package] == [("comparator/store/y.py:1", "comparator.store")]
    assert a.unplaced == ["comparator/newthing.py: comparator.newthing matches no layer pattern"]


def test_the_most_specific_pattern_places_a_module_and_a_tie_is_no_place(tree: Path) -> None:
    table = linear(LAYERS)
    assert _place("dumper.cli.common", table)[0] == "core"  # beats dumper.cli.*
    assert _place("dumper.prefill.presets", table)[0] == "dumper.prefill"
    assert _place("dumper.jobs.sweep.run", table)[0] == "dumper.jobs"
    twice = (("a", ("comparator.*",), ()), ("b", ("comparator.*",), ()), ("c", ("dumper.*",), ()))
    assert (
        "comparator/results.py: comparator.results matches comparator.* (a) and comparator.* (b)"
        in analyze(tree, twice).unplaced
    )


def test_the_old_table_allows_what_it_lists_transitively(tree: Path) -> None:
    """noise may import hidden (the old table), which may import the top level: no upward import there."""
    old = {(i.src, i.target) for i, _, _ in analyze(tree, OLD_TABLE).upward}
    assert ("comparator.noise.n", "comparator.hidden.x") not in old
    assert ("comparator.hidden.x", "comparator.results") not in old
    assert ("comparator.cli.bad", "dumper.engines.sglang") not in old  # the old CLI row: everything


def test_report_and_its_command_line(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = report(tree)
    assert "import circles: 1\n  2 modules: dumper.hooks.a <-> dumper.hooks.b" in text
    assert "  comparator.hidden -> comparator.results: 1\n    comparator/hidden/x.py:3:" in text
    assert main(["--report", str(tree)]) == 0 and capsys.readouterr().out.strip() == text
    assert main(["--report"]) == 2


def test_a_relative_import_is_refused_with_its_file_and_line(tree: Path) -> None:
    (tree / "comparator/results.py").write_text("\nfrom . import hidden\n")
    with pytest.raises(AssertionError, match=r"comparator/results.py:2: relative import"):
        analyze(tree)
