"""The report page's routing section: a row per MoE layer (the first failing one highlighted as the
layer table highlights its first divergence), the first failing flips, and the notes.

The cells are :mod:`comparator.reports.routing_table`'s, as in the terminal and Markdown; text is
escaped by :func:`comparator.reports.html_parts.escape`.

Example::

    from comparator import compare_dumps
    from comparator.reports.html_routing import routing_section
    report = compare_dumps("dumps/eager", "dumps/bias")
    html = routing_section(report.router)   # '<section id="routing"><h2>Routing: FAIL</h2>...'
"""

from __future__ import annotations

from comparator.outcome import status
from comparator.reports.html_parts import escape, table
from comparator.reports.routing_table import (
    FLIP_HEAD,
    flip_rows,
    flips_title,
    layer_head,
    layer_rows,
    routing_notes,
    routing_summary,
    routing_title,
)
from comparator.routing.types import RouterComparison

__all__ = ["routing_section"]


def _cells(cells: tuple[str, ...], head: tuple[tuple[str, str], ...]) -> str:
    return "".join(
        f'<td class="n">{escape(c)}</td>' if kind == "num" else f"<td>{escape(c)}</td>"
        for c, (_, kind) in zip(cells, head, strict=True)
    )


def routing_section(router: RouterComparison) -> str:
    """``<section id="routing">``: the summary, the per-layer table (``tr.first`` marks the first
    failing layer, ``tr.bad`` every failing one), the flip list and the notes."""
    head = layer_head(router)
    rows = []
    for row in layer_rows(router):
        cls = " ".join(["bad"] * (not row.passed) + ["first"] * row.first)
        rows.append(f'<tr class="{cls}">{_cells(row.cells, head)}</tr>')
    out = [
        f'<section id="routing"><h2>Routing: {status(router.passed)}</h2>',
        f'<p class="muted">{escape(routing_title(router))}: {escape(routing_summary(router))}</p>',
        table(head, rows, table_id="routing-table") if rows else "",
    ]
    if flips := flip_rows(router):
        listed = [("<tr>" if f.benign else '<tr class="bad">') + _cells(f.cells, FLIP_HEAD) + "</tr>" for f in flips]
        out.append(f"<h3>{escape(flips_title(router))}</h3>" + table(FLIP_HEAD, listed, table_id="routing-flips"))
    out += [f'<p class="muted">{escape(n)}</p>' for n in routing_notes(router)]
    return "".join(out) + "</section>"
