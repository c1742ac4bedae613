"""The result types of a comparison with a speculative side (:mod:`comparator.hidden.speculative`): frozen
dataclasses whose JSON keys are a public contract, each ``to_json`` read back equal by its ``from_json``.

``report.speculative`` is a :class:`SpeculativeComparison`; a leaf, as :mod:`comparator.hidden.types` is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["Acceptance", "DraftIndexRow", "FirstRejection", "AcceptanceCheck", "SpeculativeComparison"]


@dataclass(frozen=True)
class Acceptance:
    """One speculative side's acceptance over ``steps`` verify steps.

    ``per_sequence``/``proposed``: per sequence, each step's accepted and proposed drafts, in order;
    ``rates``: per draft position ``i = 1..k``, ``[i, steps that proposed >= i, of them kept >= i, rate]``.
    """

    side: str
    setting: str | None
    num_speculative_tokens: int | None
    steps: int
    mean_accepted: float | None
    acceptance_length: float | None
    per_sequence: tuple[tuple[int, ...], ...]
    proposed: tuple[tuple[int, ...], ...]
    rates: tuple[tuple[int, int, int, float | None], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "setting": self.setting,
            "num_speculative_tokens": self.num_speculative_tokens,
            "steps": self.steps,
            "mean_accepted": to_json_float(self.mean_accepted),
            "acceptance_length": to_json_float(self.acceptance_length),
            "per_sequence": [list(s) for s in self.per_sequence],
            "proposed": [list(s) for s in self.proposed],
            "rates": [
                {"draft_index": i, "proposed": n, "accepted": a, "rate": to_json_float(r)} for i, n, a, r in self.rates
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Acceptance:
        return cls(
            side=d["side"],
            setting=d.get("setting"),
            num_speculative_tokens=d.get("num_speculative_tokens"),
            steps=int(d["steps"]),
            mean_accepted=d.get("mean_accepted"),
            acceptance_length=d.get("acceptance_length"),
            per_sequence=tuple(tuple(s) for s in d.get("per_sequence", ())),
            proposed=tuple(tuple(s) for s in d.get("proposed", ())),
            rates=tuple((r["draft_index"], r["proposed"], r["accepted"], r["rate"]) for r in d.get("rates", ())),
        )


@dataclass(frozen=True)
class DraftIndexRow:
    """The kept rows at one draft index: ``rows`` (sequence, position) compared there, ``values`` per-token
    values over every hidden tensor, the largest per-token rel_diff (``tensor``, ``sequence``, ``position``),
    and the largest |Δlogprob| of the ``tokens`` those rows predicted (at ``logprob_sequence``,
    ``logprob_position``, the predicted token's position). In JSON an infinite maximum (a NaN/Inf
    mismatch) is ``null`` beside a non-zero count, and reads back as inf."""

    draft_index: int
    rows: int = 0
    values: int = 0
    max_token_rel_diff: float | None = None
    tensor: str | None = None
    sequence: int | None = None
    position: int | None = None
    tokens: int = 0
    max_abs_logprob_diff: float | None = None
    logprob_sequence: int | None = None
    logprob_position: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "draft_index": self.draft_index,
            "rows": self.rows,
            "values": self.values,
            "max_token_rel_diff": to_json_float(self.max_token_rel_diff),
            "tensor": self.tensor,
            "sequence": self.sequence,
            "position": self.position,
            "tokens": self.tokens,
            "max_abs_logprob_diff": to_json_float(self.max_abs_logprob_diff),
            "logprob_sequence": self.logprob_sequence,
            "logprob_position": self.logprob_position,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DraftIndexRow:
        values, tokens = int(d.get("values", 0)), int(d.get("tokens", 0))
        return cls(
            draft_index=int(d["draft_index"]),
            rows=int(d.get("rows", 0)),
            values=values,
            max_token_rel_diff=from_json_float(d.get("max_token_rel_diff")) if values else None,
            tensor=d.get("tensor"),
            sequence=d.get("sequence"),
            position=d.get("position"),
            tokens=tokens,
            max_abs_logprob_diff=from_json_float(d.get("max_abs_logprob_diff")) if tokens else None,
            logprob_sequence=d.get("logprob_sequence"),
            logprob_position=d.get("logprob_position"),
        )


@dataclass(frozen=True)
class FirstRejection:
    """The first position where the target kept no draft and the baseline kept one: the target's ``step`` (its
    index in the sequence's steps) whose drafts would have covered ``position`` at ``draft_index``, and whether it
    ``rejected`` the draft there (else it proposed none); the baseline's step and draft index that kept it."""

    sequence: int
    step: int
    position: int
    draft_index: int
    rejected: bool
    baseline_step: int
    baseline_draft_index: int

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FirstRejection:
        return cls(**d)


@dataclass(frozen=True)
class AcceptanceCheck:
    """Two speculative sides' acceptance over the steps both fed alike (before each sequence's decode fork)."""

    baseline: Acceptance
    target: Acceptance
    tolerance: float
    drop: float | None
    """``1 - target length / baseline length`` (None: no step to compare)."""
    first: FirstRejection | None = None
    layer: int | None = None
    """The first divergent layer of the comparison (None: the hidden states agree)."""
    forked: tuple[int, ...] = ()
    """Sequences cut at a decode fork: only their steps before it count."""

    @property
    def passed(self) -> bool:
        return self.drop is None or self.drop <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "baseline": self.baseline.to_json(),
            "target": self.target.to_json(),
            "tolerance": self.tolerance,
            "drop": to_json_float(self.drop),
            "first": None if self.first is None else self.first.to_json(),
            "layer": self.layer,
            "forked": list(self.forked),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AcceptanceCheck:
        return cls(
            baseline=Acceptance.from_json(d["baseline"]),
            target=Acceptance.from_json(d["target"]),
            tolerance=float(d["tolerance"]),
            drop=d.get("drop"),
            first=None if d.get("first") is None else FirstRejection.from_json(d["first"]),
            layer=d.get("layer"),
            forked=tuple(d.get("forked", ())),
        )


@dataclass(frozen=True)
class SpeculativeComparison:
    """What a comparison with a speculative side says of it (``report.speculative``): each speculative side's
    acceptance, the per-draft-index table (indexed by ``draft_side``'s steps) and, both sides speculative, the
    acceptance check, which alone can fail it."""

    draft_side: str
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    draft_index: tuple[DraftIndexRow, ...] = ()
    comparison: AcceptanceCheck | None = None

    @property
    def passed(self) -> bool:
        return self.comparison is None or self.comparison.passed

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "draft_side": self.draft_side,
            "acceptance": {side: a.to_json() for side, a in self.acceptance.items()},
            "draft_index": [r.to_json() for r in self.draft_index],
            "comparison": None if self.comparison is None else self.comparison.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpeculativeComparison:
        return cls(
            draft_side=d["draft_side"],
            acceptance={side: Acceptance.from_json(a) for side, a in d.get("acceptance", {}).items()},
            draft_index=tuple(DraftIndexRow.from_json(r) for r in d.get("draft_index", ())),
            comparison=None if d.get("comparison") is None else AcceptanceCheck.from_json(d["comparison"]),
        )
