"""MoE routing in words: why a routing comparison fails, a flip's margin, the basis a layer was judged by.

:mod:`comparator.outcome` re-exports these with the verdict's other words (the routing clause of a
verdict line is :func:`describe_routing`); the routing tables of every renderer use them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from comparator.formatting import format_float, format_ratio

if TYPE_CHECKING:
    from comparator.routing.types import Flip, RankRouting, RouterComparison, RouterLayer

__all__ = ["judged_by", "flip_ratio", "flip_margin", "routing_failures", "describe_rank", "describe_routing"]

_UNITS = {"calibrated": "noise", "margin rule": "the margin rule"}
"""What a flip's noise ratio is a multiple of, by its layer's basis (:data:`comparator.routing.types.CALIBRATED`,
:data:`~comparator.routing.types.MARGIN_RULE_BASIS`)."""
_JUDGED = {"calibrated": "calibrated noise", "margin rule": "the margin rule"}
"""What a layer of that basis was judged by."""


def judged_by(basis: str) -> str:
    """What a routing ``basis`` judges by, after "judged by": ``calibrated noise``, ``the margin rule``."""
    return _JUDGED.get(basis, basis)


def flip_ratio(flip: Flip, basis: str) -> str:
    """A flip's margin in units of its layer's ``basis``: ``4.29e+03x the margin rule``, ``45x noise``."""
    return f"{format_ratio(flip.noise_ratio)} {_UNITS.get(basis, basis)}"


def flip_margin(flip: Flip, basis: str) -> str:
    """``margin 0.0572, 4.29e+03x the margin rule`` (``45x noise`` when calibrated): why a flip is benign or not."""
    return f"margin {flip.margin:.3g}, {flip_ratio(flip, basis)}"


def routing_failures(layer: RouterLayer) -> list[str]:
    """Why one MoE layer's routing fails, in words (``NaN/Inf``, ``flips``, ``flip rate``, ``weights``,
    ``no tokens``); empty when it passes."""
    return [word for word, failed in (("NaN/Inf", layer.nonfinite), ("flips", layer.failing_flips),
                                      ("flip rate", not layer.flip_rate_passed), ("weights", not layer.weights_passed),
                                      ("no tokens", layer.tokens == 0)) if failed]


def describe_rank(r: RankRouting) -> str:
    """``target rank 1 routes layer 1 unlike rank 0: token 5 of sequence 0 to experts [3, 1], rank 0 [3, 6] ...``."""
    what = (f"to experts {list(r.ids)}, rank {r.reference_rank} {list(r.reference_ids)}" if r.ids != r.reference_ids
            else f"with other {', '.join(p.removeprefix('router.') for p in r.parts)}")
    return (f"{r.side} rank {r.rank} routes layer {r.layer} ({r.name}) unlike rank {r.reference_rank}: token {r.token} "
            f"of sequence {r.sequence} {what} ({r.rows} rows differ, max |Δw| {format_float(r.weight_max_diff)})")


def describe_routing(router: RouterComparison) -> str:
    """Why the routing fails, at its first failing layer: ranks that route unlike their lowest rank, NaN/Inf,
    a flip outside noise, too many flips, the weights."""
    la, flip = router.first_failing_layer, router.first_failing_flip
    rank = next((r for r in router.ranks if la is not None and r.layer == la.layer), None)
    if rank is not None:
        return describe_rank(rank)
    if la is None:
        return "routing passes" if router.passed else "routing compared no MoE layer: none was routed on both sides"
    if la.nonfinite:
        return f"routing has NaN/Inf at layer {la.layer} ({la.nonfinite} of {la.tokens} tokens)"
    if la.failing_flips and flip is not None:
        return (f"routing first flips at layer {flip.layer}, token {flip.token} of sequence {flip.sequence} "
                f"({flip_margin(flip, la.basis)})")
    if not la.flip_rate_passed:
        return (f"routing flips too often at layer {la.layer}: {la.flips} of {la.tokens} tokens "
                f"(rate {format_float(la.flip_rate)} > {format_float(la.flip_rate_limit)})")
    if not la.weights_passed:
        return (f"routing weights differ at layer {la.layer} with the same experts "
                f"(max |Δw| {format_float(la.weight_max_err)} > {format_float(la.weight_limit)})")
    return f"routing compared no tokens at layer {la.layer}"
