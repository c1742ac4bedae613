"""The rows every renderer shows for a routing comparison: one per MoE layer, one per listed flip.

The terminal (:mod:`comparator.reports.text`), Markdown and HTML show the same columns from these
rows, in the words of :mod:`comparator.outcome`; each renderer only styles them (the first failing
layer highlighted, as the hidden-state table highlights its first divergence).

Example::

    from comparator import compare_dumps
    from comparator.reports.routing_table import layer_head, layer_rows
    router = compare_dumps("dumps/eager", "dumps/bias").router
    for row in layer_rows(router):
        print(dict(zip((label for label, _ in layer_head(router)), row.cells)))
"""

from __future__ import annotations

from dataclasses import dataclass

from comparator.formatting import format_float, format_ratio
from comparator.outcome import FAIL, describe_rank, flip_ratio, judged_by, routing_failures, status
from comparator.routing.types import Flip, RouterComparison

__all__ = [
    "FLIP_HEAD",
    "FIRST_FAILURE",
    "SHOWN_FLIPS",
    "LayerRow",
    "FlipRow",
    "layer_head",
    "layer_rows",
    "routing_title",
    "flip_rows",
    "flips_title",
    "routing_notes",
    "routing_summary",
]

_HEAD: tuple[tuple[str, str], ...] = (
    ("layer", "num"),
    ("tokens", "num"),
    ("experts / top-k", "num"),
    ("flips (rate)", "num"),
    ("failing flips", "num"),
    ("order diffs", "num"),
    ("worst flip (seq/token margin, x unit)", "str"),
    ("max |Δw| vs limit", "str"),
    ("mean |Δw|", "num"),
    ("logits rel_diff", "num"),
    ("basis", "str"),
    ("verdict", "str"),
)
"""Every per-layer column; ``basis`` only when the layers were judged on different bases."""
FLIP_HEAD: tuple[tuple[str, str], ...] = (
    ("layer", "num"),
    ("sequence", "num"),
    ("token", "num"),
    ("experts baseline -> target", "str"),
    ("margin", "num"),
    ("x unit", "num"),
    ("verdict", "str"),
)
"""The flip list's columns: (label, ``"num"`` right-aligned or ``"str"``)."""
FIRST_FAILURE = "FIRST FAILURE"
"""The verdict cell's mark on the first layer whose routing fails."""
SHOWN_FLIPS = 10
"""Flips listed under the table (the JSON lists more; the counts cover all)."""


@dataclass(frozen=True)
class LayerRow:
    """One MoE layer's cells, in :func:`layer_head` order."""

    cells: tuple[str, ...]
    passed: bool
    first: bool
    """The first layer whose routing fails."""


@dataclass(frozen=True)
class FlipRow:
    """One flip's cells, in :data:`FLIP_HEAD` order."""

    cells: tuple[str, ...]
    benign: bool


def _mixed(router: RouterComparison) -> bool:
    return len({la.basis for la in router.layers}) > 1


def layer_head(router: RouterComparison) -> tuple[tuple[str, str], ...]:
    """The per-layer columns, (label, ``"num"`` right-aligned or ``"str"``); a basis column only when
    the layers were judged on different bases (else :func:`routing_title` names the one)."""
    return _HEAD if _mixed(router) else tuple(c for c in _HEAD if c[0] != "basis")


def routing_title(router: RouterComparison) -> str:
    """``routing, judged by the margin rule`` (the one basis of every layer), or ``routing``."""
    bases = {la.basis for la in router.layers}
    return f"routing, judged by {judged_by(bases.pop())}" if len(bases) == 1 else "routing"


def layer_rows(router: RouterComparison) -> list[LayerRow]:
    """One row per compared MoE layer, in layer order, in :func:`layer_head`'s columns."""
    first, mixed = router.first_failing_layer, _mixed(router)
    rows = []
    for la in router.layers:
        f = la.worst_flip
        worst = "-" if f is None else f"{f.sequence}/{f.token} {f.margin:.3g}, {format_ratio(f.noise_ratio)}"
        sign = "<=" if la.weights_passed else ">"
        weights = f"{format_float(la.weight_max_err)} {sign} {format_float(la.weight_limit)}"
        why = ", ".join(routing_failures(la) + router.rank_failures(la.layer))
        passed = la.passed and not router.rank_failures(la.layer)
        is_first = first is not None and la.layer == first.layer
        cells = [
            str(la.layer),
            str(la.tokens),
            f"{la.experts} / {la.top_k}",
            f"{la.flips} ({la.flip_rate:.2%})",
            str(la.failing_flips),
            str(la.order_differences),
            worst,
            weights,
            format_float(la.weight_mean_err),
            format_float(la.logits_rel_diff),
        ] + [la.basis] * mixed
        cells.append(f"{FIRST_FAILURE} ({why})" if is_first else status(passed, why))
        rows.append(LayerRow(cells=tuple(cells), passed=passed, first=is_first))
    return rows


def _listed(router: RouterComparison) -> list[Flip]:
    """The failing flips among the first ones (the first failing flip always), else the first benign ones."""
    failing = [f for f in router.flips_shown if not f.benign]
    if router.first_failing_flip is not None and router.first_failing_flip not in failing:
        failing.insert(0, router.first_failing_flip)
    return (failing or list(router.flips_shown))[:SHOWN_FLIPS]


def flips_title(router: RouterComparison) -> str:
    """What the flip list holds: ``first failing flips (3 of 6)`` or ``first flips, all benign (2 of 2)``."""
    if router.failing_flips:
        return f"first failing flips ({min(router.failing_flips, SHOWN_FLIPS)} of {router.failing_flips})"
    return f"first flips, all benign ({min(router.flips, SHOWN_FLIPS)} of {router.flips})"


def flip_rows(router: RouterComparison) -> list[FlipRow]:
    """The listed flips (see :func:`flips_title`); empty when no token flipped."""
    basis = {la.layer: la.basis for la in router.layers}
    rows = []
    for f in _listed(router):
        ids = f"{list(f.baseline_ids)} -> {list(f.target_ids)}"
        rows.append(
            FlipRow(
                cells=(
                    str(f.layer),
                    str(f.sequence),
                    str(f.token),
                    ids,
                    f"{f.margin:.3g}",
                    flip_ratio(f, basis.get(f.layer, "")),
                    "benign" if f.benign else FAIL,
                ),
                benign=f.benign,
            )
        )
    return rows


def routing_summary(router: RouterComparison) -> str:
    """``FAIL (layers 1, 2): 7 flips (7 failing) over 240 tokens in 3 MoE layers``: the routing's word and counts."""
    failing = [la.layer for la in router.layers if not la.passed or router.rank_failures(la.layer)]
    why = f"layer{'s' * (len(failing) > 1)} {', '.join(map(str, failing))}" if failing else None
    flips = f"{router.flips} flip{'s' * (router.flips != 1)}"
    return (
        f"{status(router.passed, why)}: {flips} ({router.failing_flips} failing) over "
        f"{sum(la.tokens for la in router.layers)} tokens in {len(router.layers)} MoE layers"
    )


def routing_notes(router: RouterComparison) -> list[str]:
    """The ranks that route unlike their side's lowest rank, the comparison's notes, and the MoE layers only one
    side routed."""
    out = [describe_rank(r) for r in router.ranks] + list(router.notes)
    for side, layers in (("baseline", router.only_baseline), ("target", router.only_target)):
        if layers:
            out.append(f"MoE layers only the {side} routed, not compared: {', '.join(map(str, layers))}")
    if not router.layers:
        out.append("no MoE layer routed on both sides: the routing was not compared")
    return out
