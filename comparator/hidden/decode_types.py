"""The decode part of a comparison's report: forks between two decode runs and what was compared.

A leaf like :mod:`comparator.hidden.types` (which holds them in ``Report.decode``); built by
:mod:`comparator.hidden.decode`, put into words by :mod:`comparator.outcome`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["DecodeFork", "DecodeComparison"]


@dataclass(frozen=True)
class DecodeFork:
    """Where two decode runs first generated different tokens for a sequence (:mod:`comparator.hidden.decode`).

    ``gap``: the baseline's logprob of its token minus that of the target's token at that step
    (with ``gap_is_bound``, the target's token is outside the baseline's top-k and ``gap`` is the
    top-k spread, a lower bound); ``noise``: the logprob noise it is judged against; ``near_tie``:
    the gap is within ``factor`` times that noise (None: no top-k or no logprobs to judge by).
    """

    sequence: int
    step: int
    position: int
    baseline_token: int
    target_token: int
    gap: float | None = None
    gap_is_bound: bool = False
    noise: float | None = None
    near_tie: bool | None = None
    factor: float | None = None
    """The multiple of ``noise`` within which ``gap`` is a near-tie (:data:`comparator.hidden.decode.NEAR_TIE`)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gap"], d["noise"] = to_json_float(self.gap), to_json_float(self.noise)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeFork:
        return cls(**{**d, "gap": from_json_float(d["gap"]), "noise": from_json_float(d["noise"])})


@dataclass(frozen=True)
class DecodeComparison:
    """What a comparison of a decode dump compared: decode steps (fed tokens) over its sequences, forks
    between two decode runs (nothing after one is compared; one the logprob noise does not explain
    fails the report), and coverage failures (a claimed step without rows), which fail it too."""

    sequences: int
    steps: int
    forks: tuple[DecodeFork, ...] = ()
    missing: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No claimed step lacks rows, and no fork is a real divergence (one not judged does not fail)."""
        return not self.missing and not any(f.near_tie is False for f in self.forks)

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "sequences": self.sequences, "steps": self.steps,
                "forks": [f.to_json() for f in self.forks], "missing": list(self.missing)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeComparison:
        return cls(sequences=int(d["sequences"]), steps=int(d["steps"]),
                   forks=tuple(DecodeFork.from_json(f) for f in d.get("forks", ())),
                   missing=tuple(d.get("missing", ())))
