"""The per-layer table of a report, computed once for the terminal, Markdown and HTML.

:func:`layer_table` gives the columns, one row per layer (tensors without a layer last) with each
cell's value and text, and the flags the renderers mark: the failing rows, the first divergence,
the onset layer and the layers that introduce error. The renderers (:mod:`comparator.reports.text`,
:mod:`comparator.reports.markdown`, :mod:`comparator.reports.html`) only format these rows, so the
three tables cannot disagree on what a row says or which row is the first divergence.

A layer's amplification is rel_diff(input of the next layer) / rel_diff(its input)
(:mod:`comparator.hidden.onset`). Where its input matches exactly (rel_diff 0) and the next one
does not, there is no ratio: the report holds inf (``null`` in the JSON), the tables say
:data:`FROM_ZERO` and the table's legend (:data:`FROM_ZERO_LEGEND`) what it means. A benign run
starts from an exact 0 at its first layer (the embeddings match), so in a run that passes such
a cell is not marked as introducing error; in a divergent run it still is, since the error
appears in that layer.

Example::

    from comparator import compare_dumps
    from comparator.reports.layer_table import layer_table
    table = layer_table(compare_dumps("dumps/eager", "dumps/sdpa"))
    for row in table.rows:
        print([c.text for c in row.cells], "FIRST DIVERGENCE" if row.first else "")
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from comparator.formatting import format_available, format_float, format_ratio
from comparator.hidden.types import LayerSummary, Report
from comparator.outcome import status

__all__ = [
    "FROM_ZERO",
    "FROM_ZERO_LEGEND",
    "FIRST_DIVERGENCE",
    "ONSET",
    "Cell",
    "LayerRow",
    "LayerTable",
    "amplification_cell",
    "layer_table",
]

FROM_ZERO = "from 0"
"""The amplification cell of a layer whose input matches exactly while the next layer's does not."""
FROM_ZERO_LEGEND = (
    f"amplification {FROM_ZERO!r}: rel_diff 0 at the layer's input, not at the next layer's, so no "
    "ratio exists (in a run that passes: not an introduced error)"
)
FIRST_DIVERGENCE = "FIRST DIVERGENCE"
"""The mark of the row that holds the report's first divergence."""
ONSET = "ONSET"
"""The mark of the onset layer (where the divergence starts), when it is not the first divergence's row."""

_HEAD: tuple[tuple[str, str], ...] = (
    ("layer", "num"),
    ("tensors", "num"),
    ("rel_diff", "num"),
    ("x noise", "num"),
    ("max token rel_diff", "num"),
    ("max |diff|", "num"),
    ("min cosine", "num"),
    ("amplification", "num"),
    ("first failing token", "num"),
    ("worst token", "num"),
    ("verdict", "str"),
)
"""Every column, (label, ``"num"`` right-aligned or ``"str"``); ``x noise`` only with a noise file."""


@dataclass(frozen=True)
class Cell:
    """One cell: the value it sorts by (None: nothing to sort by) and the text it shows."""

    value: float | int | None
    text: str


@dataclass(frozen=True)
class LayerRow:
    """One layer's cells, in :attr:`LayerTable.head` order; the verdict cell's text is the layer's
    status (``PASS``, ``FAIL (2)``), to which each renderer adds the marks it shows."""

    cells: tuple[Cell, ...]
    passed: bool
    first: bool
    """The row of the first divergence."""
    onset: bool
    """The onset layer, where it is not the first divergence's row."""
    introduced: bool
    """Its amplification marks the layer as introducing error."""


@dataclass(frozen=True)
class LayerTable:
    """The columns, the rows, and the legend to print under them (None: no cell needs one)."""

    head: tuple[tuple[str, str], ...]
    rows: tuple[LayerRow, ...]
    legend: str | None

    def column(self, label: str) -> int:
        """The index of the column ``label`` in :attr:`head` and in each row's cells."""
        return [name for name, _ in self.head].index(label)


def _from_zero(report: Report, layer: int | None) -> bool:
    """Whether ``layer``'s amplification (its first capture point's, as :meth:`Report.layers` takes it) grows
    from an exact 0."""
    amp = next((a for a in report.amplification if a.layer == layer), None) if layer is not None else None
    return amp is not None and amp.before == 0 and amp.ratio is not None and math.isinf(amp.ratio)


def amplification_cell(report: Report, summary: LayerSummary) -> tuple[str, bool]:
    """(the text of ``summary``'s amplification cell, whether to mark it as introducing error)."""
    if _from_zero(report, summary.layer):
        return FROM_ZERO, summary.introduced and not report.passed
    return format_ratio(summary.amplification), summary.introduced


def _row(report: Report, s: LayerSummary, calibrated: bool) -> LayerRow:
    """One layer's row. Its first-divergence mark: the first divergence is at ``s.layer``, which is None
    for the row of tensors without a layer when only such tensors failed (see
    :func:`comparator.hidden.localize.first_divergence`)."""
    fd = report.first_divergent
    first = fd is not None and s.layer == fd.layer
    onset = fd is not None and not first and s.layer is not None and s.layer == fd.onset_layer
    amp, introduced = amplification_cell(report, s)
    cells = [
        Cell(s.layer, "-" if s.layer is None else str(s.layer)),
        Cell(s.tensors, str(s.tensors)),
        Cell(s.max_rel_diff, format_float(s.max_rel_diff)),
    ]
    cells += [Cell(s.noise_ratio, format_ratio(s.noise_ratio))] if calibrated else []
    cells += [
        Cell(s.max_token_rel_diff, format_float(s.max_token_rel_diff)),
        Cell(s.max_abs_diff, format_available(s.max_abs_diff)),
        Cell(s.min_cosine, format_available(s.min_cosine, ".6f")),
        Cell(s.amplification, amp),
    ]
    cells += [Cell(t, "-" if t is None else str(t)) for t in (s.first_failing_token, s.worst_token)]
    cells.append(Cell(None, status(s.passed, s.failed)))
    return LayerRow(cells=tuple(cells), passed=s.passed, first=first, onset=onset, introduced=introduced)


def layer_table(report: Report) -> LayerTable:
    """The per-layer table of ``report``: a row per :meth:`Report.layers` summary, in its order."""
    calibrated = report.noise is not None
    head = _HEAD if calibrated else tuple(c for c in _HEAD if c[0] != "x noise")
    summaries = report.layers()
    legend = FROM_ZERO_LEGEND if any(_from_zero(report, s.layer) for s in summaries) else None
    return LayerTable(head=head, rows=tuple(_row(report, s, calibrated) for s in summaries), legend=legend)
