"""The amplification cell of a per-layer table: one rule for the terminal, Markdown and HTML tables.

A layer's amplification is rel_diff(input of the next layer) / rel_diff(its input)
(:mod:`comparator.hidden.onset`). Where its input matches exactly (rel_diff 0) and the next one
does not, there is no ratio: the report holds inf (``null`` in the JSON), the tables say
:data:`FROM_ZERO` and the table's legend (:data:`FROM_ZERO_LEGEND`) what it means. A benign run
starts from an exact 0 at its first layer (the embeddings match), so in a run that passes such
a cell is not marked as introducing error; in a divergent run it still is, since the error
appears in that layer.
"""

from __future__ import annotations

import math

from comparator.outcome import format_ratio
from comparator.results import LayerSummary, Report

__all__ = ["FROM_ZERO", "FROM_ZERO_LEGEND", "amplification_cell", "has_from_zero"]

FROM_ZERO = "from 0"
"""The amplification cell of a layer whose input matches exactly while the next layer's does not."""
FROM_ZERO_LEGEND = (f"amplification {FROM_ZERO!r}: rel_diff 0 at the layer's input, not at the next layer's, so no "
                    "ratio exists (in a run that passes: not an introduced error)")


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


def has_from_zero(report: Report) -> bool:
    """Whether a row of the per-layer table shows :data:`FROM_ZERO` (then the table gets the legend)."""
    return any(_from_zero(report, s.layer) for s in report.layers())
