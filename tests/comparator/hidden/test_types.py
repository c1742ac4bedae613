"""The result types as a leaf of comparator.hidden, their files (comparator.reports.files) and the one
JSON entry point (comparator.results.load_report), on a real report: tiny-llama with a one-token bug."""

from __future__ import annotations

import ast
import csv
import json
import re
from pathlib import Path

import pytest

from comparator import compare_dumps
from comparator.hidden import types
from comparator.hidden.types import Report
from comparator.reports.files import json_text, tensor_frame, write_csv, write_json
from comparator.results import load_report, report_from_json
from dumper.errors import CorruptDumpError, UsageError
from tests.conftest import ROOT
from tests.report_dumps import clean_dump, one_token_bug_dump

LAYER, TOKEN = 2, 57


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Report:
    root = tmp_path_factory.mktemp("types")
    return compare_dumps(clean_dump(root / "base"), one_token_bug_dump(root / "bad", layer=LAYER, token=TOKEN))


def test_json_file_is_the_json_text_and_reads_back_equal(report, tmp_path):
    assert not report.passed and report.first_divergent is not None and report.logprobs is not None
    write_json(report, tmp_path / "r.json")
    assert (tmp_path / "r.json").read_text(encoding="utf-8") == json_text(report)
    assert json.loads(json_text(report)) == report.to_json()
    assert load_report(tmp_path / "r.json") == report
    assert report_from_json(report.to_json()) == report


def test_csv_has_one_row_per_tensor_and_the_columns_of_to_row(report, tmp_path):
    write_csv(report, tmp_path / "t.csv")
    with open(tmp_path / "t.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    columns = list(report.tensors[0].to_row())
    assert list(rows[0]) == columns == list(tensor_frame(report).columns)
    assert "metrics" not in columns and {"rel_diff", "cosine", "max_token_rel_diff"} <= set(columns)
    assert [r["name"] for r in rows] == [t.name for t in report.tensors]
    assert [r["passed"] for r in rows] == [str(t.passed) for t in report.tensors]


def test_report_carries_no_renderer():
    assert not any(hasattr(Report, m) for m in ("write_json", "write_csv", "to_dataframe", "dumps"))


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[1, 2]", "not a comparison report (not a JSON object)"),
        ('{"baseline": "a"}', "not a comparison report (no 'target')"),
        ("{", "unreadable report"),
    ],
)
def test_a_malformed_report_file_is_one_line_naming_it(tmp_path, content, problem):
    path = tmp_path / "r.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError) as e:
        load_report(path)
    assert str(e.value).startswith(f"{path}: {problem}") and "\n" not in str(e.value)


def test_a_report_with_a_wrong_field_type_is_corrupt(report):
    d = report.to_json() | {"tensors": 3}
    with pytest.raises(CorruptDumpError, match=r"^stdin: malformed comparison report \("):
        report_from_json(d, "stdin")


def test_missing_file_and_directory_are_refused(tmp_path):
    for path, problem in (
        (tmp_path / "none.json", "cannot open report"),
        (tmp_path, "a directory, not a regular file"),
    ):
        with pytest.raises(UsageError, match=f"^{re.escape(str(path))}: {problem}"):
            load_report(path)


def test_types_import_only_the_core_and_the_leaves_below_them():
    """hidden/types.py is a leaf of comparator.hidden, and no hidden module reaches up to comparator.results."""
    allowed = (
        "dumper.format.jsonfloat",
        "comparator.judging",
        "comparator.logprobs",
        "comparator.routing.types",
        "comparator.hidden.onset",
        "comparator.hidden.registry",
        "comparator.hidden.kv_cache",  # its verdict types: numpy and dumper.format at import (torch to judge fp8)
        "comparator.hidden.speculative_types",  # a leaf: dumper.format.jsonfloat only
        "dumper.format",
    )
    tree = ast.parse(Path(types.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    ours = {m for m in imported if m.split(".")[0] in ("comparator", "dumper")}
    assert all(any(m == a or m.startswith(a + ".") for a in allowed) for m in ours), sorted(ours)
    for path in (ROOT / "comparator" / "hidden").glob("*.py"):
        mods = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert "comparator.results" not in mods, f"{path.name} imports comparator.results"
