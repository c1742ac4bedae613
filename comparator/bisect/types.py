"""What a bisection found: each tested build's run, and the answer (first bad build, or the candidates).

Built by :func:`comparator.bisect.search.bisect`, written as ``--json OUT`` and, run by run, as the
state file of ``--work DIR`` (:mod:`comparator.bisect.state`) that ``--resume`` reads back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["GOOD", "BAD", "SKIP", "OUTCOMES", "BuildRun", "BisectResult"]

GOOD = "good"
"""The build's dump passes against the baseline."""
BAD = "bad"
"""The build's dump diverges from the baseline."""
SKIP = "skip"
"""The build could not be judged: its command failed or timed out, or it left no dump that compares (never good or
bad, as ``git bisect skip``)."""
OUTCOMES = (GOOD, BAD, SKIP)


@dataclass(frozen=True)
class BuildRun:
    """One tested build: how its run ended and, judged, where its dump first diverges."""

    index: int
    """The build's line among the builds (0: the first, expected good)."""
    build: str
    outcome: str
    """:data:`GOOD`, :data:`BAD` or :data:`SKIP`."""
    exit_code: int | None
    """The command's exit code (None: killed at the timeout)."""
    seconds: float
    """Wall time of the command and the judging."""
    first_divergent: dict[str, Any] | None = None
    """A bad build's ``first_divergent`` (the report JSON's: layer, token, name, ...); None otherwise."""
    headline: str = ""
    """The verdict line of a judged build; for a skip, why (the command's last line, a timeout, the dump's error)."""
    run_id: str | None = None
    """The run store's id of this build's stored run (``--store``); None when not stored."""

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "build": self.build,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "seconds": to_json_float(self.seconds),
            "first_divergent": self.first_divergent,
            "headline": self.headline,
            "run_id": self.run_id,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BuildRun:
        outcome = d["outcome"]
        if outcome not in OUTCOMES or not isinstance(d["build"], str) or type(d["index"]) is not int:
            raise ValueError(f"not a tested build: {d!r:.200}")
        code = d.get("exit_code")
        return cls(
            index=d["index"],
            build=d["build"],
            outcome=outcome,
            exit_code=code if type(code) is int else None,
            seconds=from_json_float(d["seconds"]),
            first_divergent=d.get("first_divergent"),
            headline=str(d.get("headline", "")),
            run_id=d.get("run_id"),
        )


@dataclass(frozen=True)
class BisectResult:
    """The answer: the first bad build (or, where skips hide it, every build that may be it) and every run."""

    builds: tuple[str, ...]
    tested: tuple[BuildRun, ...]
    """Every tested build, in the order they ran."""
    last_good: int | None
    first_bad: int | None
    """The first bad build's index when it is known; None when skipped builds leave several candidates."""
    candidates: tuple[int, ...]
    """The builds that may be the first bad one: ``(first_bad,)`` when it is known."""
    verdict: dict[str, Any] | None = None
    """The whole report JSON of the first bad build (None when it is not known)."""
    bound: int = 0
    """The most runs a bisection of these builds takes without skips: ceil(log2(N)) + 2."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def runs(self) -> int:
        return len(self.tested)

    @property
    def skipped(self) -> int:
        return sum(r.outcome == SKIP for r in self.tested)

    def to_json(self) -> dict[str, Any]:
        name = lambda i: None if i is None else self.builds[i]  # noqa: E731
        return {
            "builds": list(self.builds),
            "first_bad": name(self.first_bad),
            "first_bad_index": self.first_bad,
            "last_good": name(self.last_good),
            "last_good_index": self.last_good,
            "candidates": [self.builds[i] for i in self.candidates],
            "candidate_indices": list(self.candidates),
            "runs": self.runs,
            "bound": self.bound,
            "skipped": self.skipped,
            "tested": [r.to_json() for r in self.tested],
            "verdict": self.verdict,
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BisectResult:
        return cls(
            builds=tuple(d["builds"]),
            tested=tuple(BuildRun.from_json(r) for r in d["tested"]),
            last_good=d["last_good_index"],
            first_bad=d["first_bad_index"],
            candidates=tuple(d["candidate_indices"]),
            verdict=d.get("verdict"),
            bound=int(d["bound"]),
            notes=tuple(d.get("notes", ())),
        )
