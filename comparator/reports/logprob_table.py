"""The rows every renderer shows for the checked logprob metrics: one per metric of the table.

The metrics, their labels and their order come from :mod:`comparator.judging.logprob_metrics`, so
a registered metric appears in the terminal table (:mod:`comparator.reports.text`), Markdown and
HTML alike; each renderer adds its own detail rows (RMSE, k3 max, KL percentiles...) after them.

Example::

    from comparator.reports.logprob_table import metric_rows
    for row in metric_rows(verdict):
        print(row.label, row.value, row.threshold, "FAIL" if row.failing else "")
"""

from __future__ import annotations

from dataclasses import dataclass

from comparator.formatting import format_float, format_located
from comparator.judging.logprob_metrics import logprob_metric, logprob_metrics
from comparator.logprobs.types import Located, LogprobVerdict

__all__ = ["LogprobRow", "metric_rows", "metric_label"]


@dataclass(frozen=True)
class LogprobRow:
    """One checked metric of a verdict, as text: its label (``± SE`` when it has one), value, threshold."""

    name: str
    label: str
    value: str
    threshold: str
    """``-`` when not checked."""
    failing: bool


def metric_label(name: str) -> str:
    """The reports' label of the metric ``name`` (the name itself when no such metric is registered)."""
    m = logprob_metric(name)
    return name if m is None else m.label


def metric_rows(v: LogprobVerdict) -> list[LogprobRow]:
    """The checked metrics ``v`` computed, in report order (a metric it did not compute is left out)."""
    th, failing = v.thresholds.to_json(), set(v.failures())
    rows = []
    for m in logprob_metrics():
        val = v.value_of(m.name)
        if val.value is None:
            continue
        if m.located:
            text = format_located(Located(val.value, val.request, val.position))
        else:
            text = format_float(val.value) + ("" if val.se is None else f" ± {format_float(val.se)}")
        limit = th.get(m.name)
        rows.append(
            LogprobRow(
                m.name,
                m.label + (" ± SE" if m.se_key is not None else ""),
                text,
                "-" if limit is None else f"{limit:g}",
                m.name in failing,
            )
        )
    return rows
