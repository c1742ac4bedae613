"""The per-layer table is computed once (:mod:`comparator.reports.layer_table`): the terminal, Markdown and
HTML mark the same row as the first divergence, the row of tensors without a layer included."""

from __future__ import annotations

import dataclasses
import re

from comparator.hidden.localize import first_divergence
from comparator.hidden.types import Report, TensorComparison
from comparator.reports.html import render_html
from comparator.reports.layer_table import FIRST_DIVERGENCE, ONSET, layer_table
from comparator.reports.markdown import to_markdown
from comparator.testing import render_to_string


def _tensor(name: str, layer: int | None, rel_diff: float) -> TensorComparison:
    """A one-sequence tensor that fails at token 3 when ``rel_diff`` is over 1e-3."""
    passed = rel_diff <= 1e-3
    return TensorComparison(
        name=name,
        layer=layer,
        forward_pass=0,
        rank=0,
        shape=(1, 8, 4),
        metrics={"rel_diff": rel_diff, "max_token_rel_diff": 2 * rel_diff, "max_abs_diff": rel_diff, "cosine": 1.0},
        nan_baseline=0,
        inf_baseline=0,
        nan_target=0,
        inf_target=0,
        nonfinite_mismatches=0,
        failing_tokens=0 if passed else 1,
        first_failing_token=None if passed else 3,
        first_failing_row=None if passed else 3,
        first_failing_sequence=None if passed else 0,
        worst_token=3,
        worst_row=3,
        passed=passed,
        sequence=0,
    )


def _report(*tensors: TensorComparison) -> Report:
    located = first_divergence(list(tensors))
    return Report("base", "target", 1e-3, 1e-3, tensors, first_divergent=None if located is None else located[0])


def _html_rows(report: Report) -> list[tuple[str, str]]:
    """(class, verdict cell) of each row of the page's layer table."""
    page = render_html(report)
    body = page[page.index('id="layer-table"') :]
    body = body[: body.index("</table>")]
    return [
        (cls, re.findall(r"<td>(.*?)</td>", row)[-1])
        for cls, row in re.findall(r'<tr class="([^"]*)">(.*?)</tr>', body)
    ]


def test_only_tensors_without_a_layer_failing_mark_their_row_everywhere():
    report = _report(_tensor("embed", None, 0.5), _tensor("layers.0", 0, 0.0), _tensor("layers.1", 1, 0.0))
    assert report.first_divergent is not None and report.first_divergent.layer is None
    rows = layer_table(report).rows
    assert [r.first for r in rows] == [False, False, True]  # layers 0, 1, then the row without a layer
    assert [r.cells[0].text for r in rows] == ["0", "1", "-"]
    md = [line for line in to_markdown(report).splitlines() if line.startswith("| ") and "---" not in line]
    assert md[-1].startswith("| **-** |") and md[-1].endswith(f"| **{FIRST_DIVERGENCE}** |")
    assert sum(FIRST_DIVERGENCE in line for line in md) == 1
    text = [line for line in render_to_string(report).splitlines() if FIRST_DIVERGENCE in line]
    assert len(text) == 1 and text[0].split("│")[1].strip() == "-"
    assert _html_rows(report)[-1] == ("bad first", f"FAIL (1) {FIRST_DIVERGENCE}")
    assert sum("first" in cls.split() for cls, _ in _html_rows(report)) == 1


def test_first_divergence_and_onset_rows_agree_across_formats():
    report = _report(
        _tensor("layers.0", 0, 0.0),
        _tensor("layers.1", 1, 1e-4),
        _tensor("layers.2", 2, 0.5),
        _tensor("norm", None, 0.5),
    )
    report = dataclasses.replace(report, first_divergent=dataclasses.replace(report.first_divergent, onset_layer=1))
    rows = layer_table(report).rows
    assert [(r.first, r.onset, r.passed) for r in rows] == [
        (False, False, True),
        (False, True, True),
        (True, False, False),
        (False, False, False),
    ]
    md = [line for line in to_markdown(report).splitlines() if re.match(r"^\| (\*\*)?[\d-]", line)]
    assert md[1].endswith(f"| PASS {ONSET} |") and md[2].endswith(f"| **{FIRST_DIVERGENCE}** |")
    assert md[3].endswith("| FAIL (1) |")
    assert [v for _, v in _html_rows(report)] == ["PASS", f"PASS {ONSET}", f"FAIL (1) {FIRST_DIVERGENCE}", "FAIL (1)"]
