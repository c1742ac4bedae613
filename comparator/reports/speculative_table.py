"""The per-draft-index table every renderer shows for a comparison with a speculative side.

One row per draft index ``0..k`` of the verify steps of ``report.speculative.draft_side``
(:mod:`comparator.hidden.speculative`): the kept rows compared there, the largest per-token
rel_diff over every compared hidden tensor and where it is, and the largest |Δlogprob| of the
tokens those rows predicted. The terminal (:mod:`comparator.reports.text`) and Markdown show the
same cells; a bug in the verify kernel that hits draft index 2 and later reads as indices 0 and 1
at noise and 2+ far above it.

Example::

    from comparator import compare_dumps
    from comparator.reports.speculative_table import DRAFT_HEAD, draft_rows
    for cells in draft_rows(compare_dumps("dumps/prefill", "dumps/spec").speculative):
        print(dict(zip((label for label, _ in DRAFT_HEAD), cells)))
"""

from __future__ import annotations

from comparator.formatting import format_float
from comparator.hidden.speculative_types import DraftIndexRow, SpeculativeComparison

__all__ = ["DRAFT_HEAD", "draft_rows", "draft_title"]

DRAFT_HEAD: tuple[tuple[str, str], ...] = (
    ("draft index", "num"),
    ("rows", "num"),
    ("max token rel_diff", "num"),
    ("at tensor, seq, pos", "str"),
    ("max |Δlogprob|", "num"),
    ("of token at seq, pos", "str"),
)


def draft_title(sp: SpeculativeComparison) -> str:
    """``rows by draft index of the target's verify steps (kept rows only)``."""
    return f"rows by draft index of the {sp.draft_side}'s verify steps (kept rows only)"


def _cells(r: DraftIndexRow) -> list[str]:
    where = "-" if r.tensor is None else f"{r.tensor}, {r.sequence}, {r.position}"
    lp = "-" if r.logprob_sequence is None else f"{r.logprob_sequence}, {r.logprob_position}"
    return [
        str(r.draft_index),
        str(r.rows),
        "-" if r.values == 0 else format_float(r.max_token_rel_diff),
        where,
        "-" if r.tokens == 0 else format_float(r.max_abs_logprob_diff),
        lp,
    ]


def draft_rows(sp: SpeculativeComparison | None) -> list[list[str]]:
    """The table's cells, one list per draft index (empty: no speculative side)."""
    return [] if sp is None else [_cells(r) for r in sp.draft_index]
