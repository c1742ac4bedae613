"""What ``compare_drills`` found: per module path, the ops each build dispatched there and how far apart they are.

A :class:`DrillComparison` holds one :class:`PathComparison` per module path of either log, in
order; each holds the :class:`PairComparison` of every pair of ops aligned there. Ratios are
multiples of the two sides' rounding (:mod:`comparator.drill.compare`); in JSON a ratio is a
number, ``"inf"``, or ``null`` where nothing was measured.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Basis",
    "Pairing",
    "PathStatus",
    "OpBrief",
    "PairComparison",
    "PathComparison",
    "DrillSide",
    "DrillComparison",
    "format_ratio",
]


class Basis(enum.Enum):
    """What a pair's ratio rests on."""

    ROWS = "rows"
    """Both sides' stored rows at common tokens, measured against both sides' rounding."""
    HASH = "hash"
    """Equal hashes of the whole first outputs (no rows to measure, or no common token): ratio 0."""
    UNKNOWN = "unknown"
    """No rows to measure and different (or missing) hashes: nothing can be said."""
    NOT_COMPARABLE = "not comparable"
    """Rows of different sizes per token: the two ops computed different things."""


class Pairing(enum.Enum):
    """How the ops of one path were paired."""

    SLOTS = "slots"
    """Both sides dispatched the same ops there: each pair by its slot."""
    OUTPUT = "output"
    """The op lists differ (a fused or split op): only the module's output, its last op with rows on each side."""
    NONE = "none"
    """Nothing to pair: the path is on one side only, or one side has no output there."""


class PathStatus(enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    NOT_COMPARED = "n/a"
    """No pair of the path was measured (one side only, unknown, not comparable)."""


def ratio_to_json(v: float | None) -> float | str | None:
    """A ratio for JSON: a number, ``"inf"`` for an infinite one, ``null`` for none measured."""
    return None if v is None else v if math.isfinite(v) else "inf"


def ratio_from_json(v: Any) -> float | None:
    if v is None:
        return None
    if v == "inf":
        return math.inf
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"not a ratio: {v!r:.60}")
    return float(v)


def format_ratio(v: float | None) -> str:
    """``812``, ``0.61``, ``inf``, ``-``: a ratio in a table cell or a verdict line."""
    if v is None:
        return "-"
    return "inf" if not math.isfinite(v) else f"{v:.3g}"


def _within(worst: float) -> str:
    """``within 0.61x the two sides' rounding``, or ``bit for bit`` where every measured row was equal."""
    return "bit for bit" if worst == 0 else f"within {worst:.2g}x the two sides' rounding"


@dataclass(frozen=True)
class OpBrief:
    """One op of a log as a comparison names it: ``aten.silu [1, 41, 1536] bfloat16``."""

    index: int
    op: str
    """The op without a ``.default`` overload (``aten.silu``, ``_C.silu_and_mul``)."""
    path: str
    slot: int
    shape: tuple[int, ...]
    """The first output's shape (empty: no output)."""
    dtype: str
    """The first output's dtype (``-``: no output)."""
    rows: bool
    """Whether the log stores the first output's rows."""

    def __str__(self) -> str:
        return f"{self.op} [{', '.join(map(str, self.shape))}] {self.dtype}"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "path": self.path,
            "slot": self.slot,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "rows": self.rows,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OpBrief:
        return cls(
            index=int(d["index"]),
            op=str(d["op"]),
            path=str(d["path"]),
            slot=int(d["slot"]),
            shape=tuple(int(n) for n in d["shape"]),
            dtype=str(d["dtype"]),
            rows=bool(d["rows"]),
        )


@dataclass(frozen=True)
class PairComparison:
    """One op of A against one op of B: the largest ratio over their common token rows."""

    index_a: int
    index_b: int
    """The two ops' indices in their logs."""
    basis: Basis
    ratio: float | None
    """The largest per-row ``rms(a - b) / (rms(bound_a) + rms(bound_b))``; None where nothing was measured."""
    token: int | None
    """The position of the row with ``ratio`` (None: not measured on rows, or every row equal)."""
    note: str = ""
    """Why a pair was not measured (``basis`` unknown or not comparable)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "index_a": self.index_a,
            "index_b": self.index_b,
            "basis": self.basis.value,
            "ratio": ratio_to_json(self.ratio),
            "token": self.token,
            "note": self.note,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PairComparison:
        return cls(
            index_a=int(d["index_a"]),
            index_b=int(d["index_b"]),
            basis=Basis(d["basis"]),
            ratio=ratio_from_json(d["ratio"]),
            token=None if d["token"] is None else int(d["token"]),
            note=str(d.get("note", "")),
        )


@dataclass(frozen=True)
class PathComparison:
    """One module path: what each side dispatched there and the worst of its aligned pairs."""

    path: str
    ops_a: tuple[OpBrief, ...]
    ops_b: tuple[OpBrief, ...]
    pairing: Pairing
    pairs: tuple[PairComparison, ...]
    status: PathStatus

    @property
    def passed(self) -> bool:
        return self.status is PathStatus.PASS

    @property
    def diverged(self) -> bool:
        return self.status is PathStatus.FAIL

    def worst(self) -> PairComparison | None:
        """The measured pair with the largest ratio (the first of equals); None when none was measured."""
        measured = [p for p in self.pairs if p.ratio is not None]
        return max(measured, key=lambda p: p.ratio if p.ratio is not None else -1.0, default=None)

    @property
    def ratio(self) -> float | None:
        pair = self.worst()
        return None if pair is None else pair.ratio

    @property
    def token(self) -> int | None:
        pair = self.worst()
        return None if pair is None else pair.token

    def op_a(self, index: int) -> OpBrief:
        return next(o for o in self.ops_a if o.index == index)

    def op_b(self, index: int) -> OpBrief:
        return next(o for o in self.ops_b if o.index == index)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ops_a": [o.to_json() for o in self.ops_a],
            "ops_b": [o.to_json() for o in self.ops_b],
            "pairing": self.pairing.value,
            "pairs": [p.to_json() for p in self.pairs],
            "ratio": ratio_to_json(self.ratio),
            "token": self.token,
            "status": self.status.value,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PathComparison:
        return cls(
            path=str(d["path"]),
            ops_a=tuple(OpBrief.from_json(o) for o in d["ops_a"]),
            ops_b=tuple(OpBrief.from_json(o) for o in d["ops_b"]),
            pairing=Pairing(d["pairing"]),
            pairs=tuple(PairComparison.from_json(p) for p in d["pairs"]),
            status=PathStatus(d["status"]),
        )


@dataclass(frozen=True)
class DrillSide:
    """One of the two logs: where it is, what it drilled, and its own verdict against its float64 reference."""

    path: str
    layer: int
    half: str
    engine: str | None
    dtype: str | None
    model: str | None
    factor: float
    ops: int
    first_beyond: OpBrief | None
    """The log's first op beyond ``factor`` times its own rounding (``DrillLog.first_beyond``)."""
    first_beyond_ratio: float | None
    first_beyond_token: int | None
    summary: str
    """``DrillLog.summary()``: the log's own verdict line."""

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "layer": self.layer,
            "half": self.half,
            "engine": self.engine,
            "dtype": self.dtype,
            "model": self.model,
            "factor": self.factor,
            "ops": self.ops,
            "first_beyond": None if self.first_beyond is None else self.first_beyond.to_json(),
            "first_beyond_ratio": ratio_to_json(self.first_beyond_ratio),
            "first_beyond_token": self.first_beyond_token,
            "summary": self.summary,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DrillSide:
        first = d.get("first_beyond")
        token = d.get("first_beyond_token")
        return cls(
            path=str(d["path"]),
            layer=int(d["layer"]),
            half=str(d["half"]),
            engine=d.get("engine"),
            dtype=d.get("dtype"),
            model=d.get("model"),
            factor=float(d["factor"]),
            ops=int(d["ops"]),
            first_beyond=None if first is None else OpBrief.from_json(first),
            first_beyond_ratio=ratio_from_json(d.get("first_beyond_ratio")),
            first_beyond_token=None if token is None else int(token),
            summary=str(d["summary"]),
        )


@dataclass(frozen=True)
class DrillComparison:
    """Two drills of one half compared path by path; true when no path differs beyond ``factor``."""

    a: DrillSide
    b: DrillSide
    factor: float
    """A pair differs beyond noise above this many times the two sides' rounding."""
    paths: tuple[PathComparison, ...]
    """Every module path of either log, in the order of first dispatch (A's, B's own paths after the one
    they follow in B)."""
    notes: tuple[str, ...] = ()
    """What was not compared, or compared otherwise than op by op, and why."""

    @property
    def first(self) -> PathComparison | None:
        """The first path that differs beyond ``factor``; None when none does."""
        return next((p for p in self.paths if p.diverged), None)

    @property
    def first_path(self) -> str | None:
        return None if self.first is None else self.first.path

    @property
    def passed(self) -> bool:
        return self.first is None

    def __bool__(self) -> bool:
        return self.passed

    @property
    def summary(self) -> str:
        """The verdict in one line: the first differing path, what each side ran there, how far apart, where."""
        first = self.first
        if first is None:
            return self._pass_line()
        pair = first.worst()
        assert pair is not None  # a diverged path has a measured pair
        before = [p for p in self.paths[: self.paths.index(first)] if p.passed]
        if before:
            who = "the path before it agrees" if len(before) == 1 else f"the {len(before)} paths before it agree"
            tail = f"{who} {_within(max(p.ratio or 0.0 for p in before))}"
        else:
            tail = "it is the first path compared"
        at = f" at token {pair.token}" if pair.token is not None else ""
        return (
            f"DIVERGED at {first.path}: A {first.op_a(pair.index_a)} vs B {first.op_b(pair.index_b)}, "
            f"{format_ratio(pair.ratio)}x the two sides' rounding{at} ({tail})"
        )

    def _pass_line(self) -> str:
        measured = [p for p in self.paths if p.passed]
        worst = max((p.ratio or 0.0 for p in measured), default=0.0)
        who = "1 path agrees" if len(measured) == 1 else f"{len(measured)} paths agree"
        line = f"PASS: {who} {_within(worst)} (factor {self.factor:g})"
        skipped = [p.path for p in self.paths if p.status is PathStatus.NOT_COMPARED]
        if skipped:
            more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            line += f"; not compared: {', '.join(skipped[:3])}{more}"
        return line

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "factor": self.factor,
            "passed": self.passed,
            "first_path": self.first_path,
            "summary": self.summary,
            "paths": [p.to_json() for p in self.paths],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DrillComparison:
        return cls(
            a=DrillSide.from_json(d["a"]),
            b=DrillSide.from_json(d["b"]),
            factor=float(d["factor"]),
            paths=tuple(PathComparison.from_json(p) for p in d["paths"]),
            notes=tuple(str(n) for n in d.get("notes", ())),
        )
