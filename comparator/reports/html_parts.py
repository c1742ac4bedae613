"""The HTML pieces every section of the report page is built from: escaped text, numeric cells with a
sort key, tables. The page (:mod:`comparator.reports.html`) and its routing section
(:mod:`comparator.reports.html_routing`) share them, so text from a dump is escaped one way.

Example::

    from comparator.reports.html_parts import escape, num_cell, table
    print(table([("name", "str"), ("rel_diff", "num")], [f"<tr><td>{escape('a<b')}</td>{num_cell(1e-3)}</tr>"]))
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

from comparator.outcome import format_float

__all__ = ["escape", "sort_key", "num_cell", "table"]


def escape(v: Any) -> str:
    """``v`` as text for an HTML element or a quoted attribute (quotes escaped too)."""
    return html.escape(str(v), quote=True)


def sort_key(x: float | int | None) -> str:
    """A sort key for ``data-v``: what JavaScript's ``Number()`` reads back."""
    if x is None:
        return ""
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    if isinstance(x, float) and math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def num_cell(x: float | int | None, text: str | None = None) -> str:
    """A right-aligned cell showing ``text`` (default: ``x`` formatted), sorted by ``x``."""
    shown = text if text is not None else "-" if x is None else format_float(x) if isinstance(x, float) else str(x)
    return f'<td class="n" data-v="{escape(sort_key(x))}">{escape(shown)}</td>'


def table(head: Sequence[tuple[str, str]], rows: Iterable[str], *, sortable: bool = False, table_id: str = "") -> str:
    """A table; ``head`` holds (label, "num"|"str") pairs, ``rows`` finished ``<tr>`` elements."""
    ths = "".join(f'<th data-type="{t}">{escape(label)}</th>' for label, t in head)
    attrs = (f' id="{escape(table_id)}"' if table_id else "") + (' class="sortable"' if sortable else "")
    return f"<table{attrs}><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
