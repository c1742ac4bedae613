"""The logprob comparison's data: per-request logprobs, aligned samples, located maxima, KL results.

Positions follow SGLang's ``input_token_logprobs`` convention: ``logprobs[i] = log p(token_ids[i]
| token_ids[:i])``, and a logits row or top-k list "at position i" is the distribution that
predicts ``token_ids[i]``. :func:`logprob_delta` is the one definition of "the difference of two
logprobs" (target minus baseline, with the NaN/inf rules every metric follows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from comparator.jsonfloat import from_json_float, to_json_float

__all__ = ["UNKNOWN_TOKEN", "TopK", "SequenceLogprobs", "AlignedSample", "Alignment", "Located", "PositionSeries",
           "LogitsByRequest", "KlResult", "KlPass", "logprob_delta"]

UNKNOWN_TOKEN: Final = -1
"""Token id of a position whose token an engine did not report (before SGLang's
``logprob_start_len``); never compared, and its logprob is always None."""

TopK = tuple[tuple[int, float], ...]
"""Top-k ``(token_id, logprob)`` pairs of one distribution, most likely first."""

@dataclass(frozen=True)
class SequenceLogprobs:
    """Per-position logprobs of one request, aligned with its token ids (SGLang's input_token_logprobs convention).

    Attributes:
        request: request id.
        token_ids: token at each position (prompt, then output if any); ``UNKNOWN_TOKEN`` where
            the engine did not say; ``()`` when only token texts are known.
        logprobs: ``logprobs[i] = log p(token_ids[i] | token_ids[:i])``; None where not computed
            (position 0, before logprob_start_len).
        top: top-k ``(token_id, logprob)`` of the distribution that predicts position i; None
            (whole field or one position) if absent.
        token_texts: token strings, for formats that give no ids (OpenAI ``logprobs.tokens``);
            agreement is then checked on texts.

    Lists are accepted and stored as tuples.
    """

    request: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[TopK | None, ...] | None = None
    token_texts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "request", str(self.request))
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "logprobs", tuple(None if v is None else float(v) for v in self.logprobs))
        if self.top is not None:
            object.__setattr__(self, "top", tuple(
                None if t is None else tuple((int(i), float(v)) for i, v in t) for t in self.top))
        if self.token_texts is not None:
            object.__setattr__(self, "token_texts", tuple(self.token_texts))
        n = len(self)
        if self.token_ids and self.token_texts is not None and len(self.token_texts) != n:
            raise ValueError(f"request {self.request!r}: {n} token ids but {len(self.token_texts)} token texts")
        if len(self.logprobs) != n:
            raise ValueError(f"request {self.request!r}: {n} tokens but {len(self.logprobs)} logprobs")
        if self.top is not None and len(self.top) != n:
            raise ValueError(f"request {self.request!r}: {n} tokens but {len(self.top)} top-k entries")

    def __len__(self) -> int:
        """Number of positions."""
        return len(self.token_ids) if self.token_ids else len(self.token_texts or ())


@dataclass(frozen=True, eq=False)
class AlignedSample:
    """One request's positions where both sides have a logprob, with both values there.

    ``ref_top`` / ``tgt_top`` hold the top-k lists at those positions (None if a side has none).
    """

    request: str
    positions: np.ndarray  # [n] int64
    ref: np.ndarray  # [n] float64, baseline logprobs
    tgt: np.ndarray  # [n] float64, target logprobs
    ref_top: tuple[TopK | None, ...] | None = None
    tgt_top: tuple[TopK | None, ...] | None = None

    @property
    def delta(self) -> np.ndarray:
        """``tgt - ref`` per position; 0 where both are the same non-finite value, +inf where
        they differ non-finitely (NaN on one side)."""
        return logprob_delta(self.ref, self.tgt)


@dataclass(frozen=True)
class Alignment:
    """Result of :func:`align_samples`: matched samples (baseline order) and one-sided request ids."""

    samples: tuple[AlignedSample, ...]
    unmatched_baseline: tuple[str, ...] = ()
    unmatched_target: tuple[str, ...] = ()

    @property
    def compared_positions(self) -> int:
        return int(sum(s.positions.size for s in self.samples))


@dataclass(frozen=True)
class Located:
    """A max-type value with where it occurs (request id, position); all None when not computed.

    In JSON the request id is ``sample`` (the issue's contract: "with sample and position").
    """

    value: float | None = None
    request: str | None = None
    position: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"value": to_json_float(self.value), "sample": self.request, "position": self.position}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None, *, computed: bool) -> Located:
        if not d:
            return cls()
        v = d.get("value")
        value = from_json_float(v) if computed else (None if v is None else float(v))
        pos = d.get("position")
        return cls(value, d.get("sample"), None if pos is None else int(pos))


@dataclass(frozen=True, eq=False)
class PositionSeries:
    """One request's per-position values, for plots and "worst positions" lists (not part of the JSON).

    ``ref`` / ``tgt`` are the two sides' logprobs at ``positions``; ``kl`` is the full-distribution
    KL at ``kl_positions`` (None without logits). The arrays are the ones the verdict was computed
    from, so keeping them costs no extra memory.
    """

    request: str
    positions: np.ndarray  # [n] int64
    ref: np.ndarray  # [n] float64
    tgt: np.ndarray  # [n] float64
    kl_positions: np.ndarray | None = None  # [m] int64
    kl: np.ndarray | None = None  # [m] float64

    @property
    def delta(self) -> np.ndarray:
        """``tgt - ref`` per position (see :attr:`AlignedSample.delta`)."""
        return logprob_delta(self.ref, self.tgt)


LogitsByRequest = Mapping[str, tuple[np.ndarray, np.ndarray]]
"""request id -> (positions [n] ints, logits rows [n, V]); row k is the distribution predicting
``token_ids[positions[k]]`` (for an HF prefill of N tokens, ``logits[0, j]`` sits at position j+1)."""


@dataclass(frozen=True, eq=False)
class KlResult:
    """Full-distribution results of one comparison: per request, the positions both sides have a
    distribution for and KL(P_ref || P_target) there [n] float64; top tokens agreeing, of ``total`` rows."""

    per_request: tuple[tuple[str, np.ndarray, np.ndarray], ...]
    agree: int
    total: int


KlPass = Callable[[Sequence[AlignedSample]], KlResult]
"""Computes the :class:`KlResult` of the matched samples (dump logits, or llama.cpp KLD files streamed)."""


def logprob_delta(ref: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """``tgt - ref``, the difference every metric is built on; 0 where both are equal (incl. the
    same inf, or NaN on both), +inf where NaN otherwise (so no threshold passes it)."""
    with np.errstate(invalid="ignore"):
        d = tgt - ref
    same = (ref == tgt) | (np.isnan(ref) & np.isnan(tgt))
    d[same] = 0.0
    d[np.isnan(d)] = np.inf
    return d

