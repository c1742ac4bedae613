"""The result types of a routing comparison: one flip, one MoE layer, the whole comparison.

Built by :func:`comparator.routing.compare.compare_routing`; held by
:class:`comparator.hidden.types.Report` as ``report.router`` and written as the report JSON's
top-level ``router`` object (``passed``, ``flips``, ``first_flip``, ``layers``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["Flip", "RouterLayer", "RouterComparison", "RankRouting", "CALIBRATED", "MARGIN_RULE_BASIS"]

CALIBRATED = "calibrated"
"""A layer judged against its calibrated routing noise."""
MARGIN_RULE_BASIS = "margin rule"
"""A layer judged by the fixed margin and weight rules (no routing noise for it)."""


@dataclass(frozen=True)
class Flip:
    """One token whose expert set differs: where, what each side chose, and whether noise explains it."""

    layer: int
    sequence: int
    token: int
    """The token's position in its sequence."""
    baseline_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    margin: float
    """The baseline's margin: its lowest chosen expert's score minus its highest unchosen one's."""
    noise_ratio: float
    """``margin`` over the layer's unit (calibrated score noise, or the margin rule's)."""
    benign: bool
    after: int | None = None
    """The earlier layer where this token's experts first flipped (this flip follows from it: benign); None: first."""

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "sequence": self.sequence,
            "token": self.token,
            "baseline_ids": list(self.baseline_ids),
            "target_ids": list(self.target_ids),
            "margin": to_json_float(self.margin),
            "noise_ratio": to_json_float(self.noise_ratio),
            "benign": self.benign,
            "after": self.after,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Flip:
        return cls(
            layer=int(d["layer"]),
            sequence=int(d["sequence"]),
            token=int(d["token"]),
            baseline_ids=tuple(int(i) for i in d["baseline_ids"]),
            target_ids=tuple(int(i) for i in d["target_ids"]),
            margin=from_json_float(d["margin"]),
            noise_ratio=from_json_float(d["noise_ratio"]),
            benign=bool(d["benign"]),
            after=None if d.get("after") is None else int(d["after"]),
        )


@dataclass(frozen=True)
class RankRouting:
    """A tensor-parallel rank of one side whose replicated router chose otherwise than the lowest rank.

    Every rank runs the whole router, so their rows of a pass must be bit-identical; the comparison
    with the other side goes through the lowest rank's rows, so a rank that differs fails on its own.
    """

    side: str
    """``"baseline"`` or ``"target"``."""
    layer: int
    name: str
    """The layer's record prefix (``model.layers.3``)."""
    rank: int
    reference_rank: int
    sequence: int
    token: int
    """The first differing row's position (the lowest (sequence, position) whose rows differ)."""
    ids: tuple[int, ...]
    """This rank's experts at that token."""
    reference_ids: tuple[int, ...]
    rows: int
    """How many rows differ on this rank."""
    parts: tuple[str, ...]
    """The routing parts that differ (``router.ids``, ``router.weights``, ...)."""
    weight_max_diff: float

    def to_json(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "layer": self.layer,
            "name": self.name,
            "rank": self.rank,
            "reference_rank": self.reference_rank,
            "sequence": self.sequence,
            "token": self.token,
            "ids": list(self.ids),
            "reference_ids": list(self.reference_ids),
            "rows": self.rows,
            "parts": list(self.parts),
            "weight_max_diff": to_json_float(self.weight_max_diff),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankRouting:
        return cls(
            side=str(d["side"]),
            layer=int(d["layer"]),
            name=str(d["name"]),
            rank=int(d["rank"]),
            reference_rank=int(d["reference_rank"]),
            sequence=int(d["sequence"]),
            token=int(d["token"]),
            ids=tuple(int(i) for i in d["ids"]),
            reference_ids=tuple(int(i) for i in d["reference_ids"]),
            rows=int(d["rows"]),
            parts=tuple(str(p) for p in d["parts"]),
            weight_max_diff=from_json_float(d["weight_max_diff"]),
        )


@dataclass(frozen=True)
class RouterLayer:
    """The routing comparison of one MoE layer over every token both sides routed."""

    layer: int
    name: str
    """The layer's record prefix (``model.layers.3``)."""
    tokens: int
    experts: int
    top_k: int
    flips: int
    failing_flips: int
    order_differences: int
    """Tokens with the same expert set in another slot order (reported, never a failure)."""
    score_delta_max: float
    """Largest per-token max |Δ score| (the quantity calibration records as score noise)."""
    logits_rel_diff: float
    """Whole-layer rel_diff of the router logits, |x-y|² / (|x|² + |y|²)."""
    weight_max_err: float
    """Largest |Δw| on tokens whose expert sets agree (slots matched by expert id); 0 with none."""
    weight_mean_err: float
    weight_limit: float
    unit: float
    """What a flip's noise ratio divides by: the calibrated score noise, or the margin rule's relative unit."""
    limit_ratio: float
    """A flip is benign when its noise ratio is at most this (the noise factor, or 1 under the margin rule)."""
    basis: str
    """:data:`CALIBRATED` or :data:`MARGIN_RULE_BASIS`."""
    benign_flip_rate: float | None = None
    """The calibrated benign flip rate of this layer (None: not calibrated)."""
    nonfinite: int = 0
    """Tokens whose router values are NaN/Inf on one side or the other (each fails the layer)."""
    worst_flip: Flip | None = None
    flip_rate_limit: float | None = None
    """With calibrated noise: the largest flip rate that passes (``factor`` x the benign rate, at least
    ``factor`` / the calibration's tokens); None under the margin rule, which judges flips one by one only."""

    @property
    def flip_rate(self) -> float:
        return self.flips / self.tokens if self.tokens else 0.0

    @property
    def flip_rate_passed(self) -> bool:
        return self.flip_rate_limit is None or self.flip_rate <= self.flip_rate_limit

    @property
    def weights_passed(self) -> bool:
        return self.weight_max_err <= self.weight_limit

    @property
    def passed(self) -> bool:
        return (
            self.tokens > 0
            and not self.failing_flips
            and self.weights_passed
            and not self.nonfinite
            and self.flip_rate_passed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "name": self.name,
            "passed": self.passed,
            "tokens": self.tokens,
            "experts": self.experts,
            "top_k": self.top_k,
            "flips": self.flips,
            "flip_rate": self.flip_rate,
            "failing_flips": self.failing_flips,
            "order_differences": self.order_differences,
            "score_delta_max": to_json_float(self.score_delta_max),
            "logits_rel_diff": to_json_float(self.logits_rel_diff),
            "weight_max_err": to_json_float(self.weight_max_err),
            "weight_mean_err": to_json_float(self.weight_mean_err),
            "weight_limit": to_json_float(self.weight_limit),
            "unit": to_json_float(self.unit),
            "limit_ratio": to_json_float(self.limit_ratio),
            "basis": self.basis,
            "benign_flip_rate": to_json_float(self.benign_flip_rate) if self.benign_flip_rate is not None else None,
            "nonfinite": self.nonfinite,
            "flip_rate_limit": to_json_float(self.flip_rate_limit) if self.flip_rate_limit is not None else None,
            "worst_flip": self.worst_flip.to_json() if self.worst_flip is not None else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RouterLayer:
        f = {
            k: from_json_float(d[k])
            for k in (
                "score_delta_max",
                "logits_rel_diff",
                "weight_max_err",
                "weight_mean_err",
                "weight_limit",
                "unit",
                "limit_ratio",
            )
        }
        return cls(
            layer=int(d["layer"]),
            name=str(d["name"]),
            tokens=int(d["tokens"]),
            experts=int(d["experts"]),
            top_k=int(d["top_k"]),
            flips=int(d["flips"]),
            failing_flips=int(d["failing_flips"]),
            order_differences=int(d["order_differences"]),
            basis=str(d["basis"]),
            **f,
            benign_flip_rate=None if d.get("benign_flip_rate") is None else from_json_float(d["benign_flip_rate"]),
            nonfinite=int(d.get("nonfinite", 0)),
            flip_rate_limit=None if d.get("flip_rate_limit") is None else from_json_float(d["flip_rate_limit"]),
            worst_flip=Flip.from_json(d["worst_flip"]) if d.get("worst_flip") else None,
        )


@dataclass(frozen=True)
class RouterComparison:
    """Routing of every MoE layer both dumps recorded: per layer, the first flip, the first failing one."""

    layers: tuple[RouterLayer, ...]
    first_flip: Flip | None
    """The first flip in layer order, then sequence, then token (benign or not)."""
    first_failing_flip: Flip | None
    flips_shown: tuple[Flip, ...] = ()
    """The first flips in that order (at most :data:`comparator.routing.compare.SHOWN_FLIPS`)."""
    only_baseline: tuple[int, ...] = ()
    """MoE layers only the baseline routed (not compared)."""
    only_target: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    """Calibrated routing noise so loose it would excuse flips the fixed rules fail by far (printed as warnings)."""
    ranks: tuple[RankRouting, ...] = ()
    """Ranks whose replicated routing differs from their side's lowest rank (each a failure), by layer then rank."""

    @property
    def flips(self) -> int:
        return sum(la.flips for la in self.layers)

    @property
    def failing_flips(self) -> int:
        return sum(la.failing_flips for la in self.layers)

    @property
    def passed(self) -> bool:
        return bool(self.layers) and all(la.passed for la in self.layers) and not self.ranks

    @property
    def first_failing_layer(self) -> RouterLayer | None:
        """The first layer that fails (a flip outside noise, too many flips, the weights, NaN/Inf, nothing compared,
        or a rank that routes it unlike its side's lowest rank)."""
        ranked = {r.layer for r in self.ranks}
        return next((la for la in self.layers if not la.passed or la.layer in ranked), None)

    def rank_failures(self, layer: int) -> list[str]:
        """``target rank 1``: each rank that routes ``layer`` unlike its side's lowest rank."""
        return [f"{r.side} rank {r.rank}" for r in self.ranks if r.layer == layer]

    @property
    def basis(self) -> str:
        """How the layers were judged: calibrated, the margin rule, or both (some layers each)."""
        kinds = sorted({la.basis for la in self.layers})
        return " and ".join(kinds) if kinds else MARGIN_RULE_BASIS

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "flips": self.flips,
            "failing_flips": self.failing_flips,
            "basis": self.basis,
            "first_flip": self.first_flip.to_json() if self.first_flip is not None else None,
            "first_failing_flip": self.first_failing_flip.to_json() if self.first_failing_flip else None,
            "flips_shown": [f.to_json() for f in self.flips_shown],
            "layers": [la.to_json() for la in self.layers],
            "only_baseline": list(self.only_baseline),
            "only_target": list(self.only_target),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RouterComparison:
        ff, fx = d.get("first_flip"), d.get("first_failing_flip")
        return cls(
            layers=tuple(RouterLayer.from_json(la) for la in d["layers"]),
            first_flip=Flip.from_json(ff) if ff else None,
            first_failing_flip=Flip.from_json(fx) if fx else None,
            flips_shown=tuple(Flip.from_json(f) for f in d.get("flips_shown", ())),
            only_baseline=tuple(int(i) for i in d.get("only_baseline", ())),
            only_target=tuple(int(i) for i in d.get("only_target", ())),
            notes=tuple(d.get("notes", ())),
            warnings=tuple(d.get("warnings", ())),
            ranks=tuple(RankRouting.from_json(r) for r in d.get("ranks", ())),
        )
