"""The logprob comparison's data: per-request logprobs, aligned samples, located maxima, KL results,
and the verdict (:class:`LogprobVerdict`, computed by :func:`comparator.logprobs.verdict.compare_logprobs`).

Positions follow SGLang's ``input_token_logprobs`` convention: ``logprobs[i] = log p(token_ids[i]
| token_ids[:i])``, and a logits row or top-k list "at position i" is the distribution that
predicts ``token_ids[i]``. :func:`logprob_delta` is the one definition of "the difference of two
logprobs" (target minus baseline, with the NaN/inf rules every metric follows).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np

from comparator.judging.logprob_metrics import LogprobMetric, MetricValue, logprob_metric, logprob_metrics, metric_names
from comparator.judging.logprob_noise import NoiseCheck
from comparator.judging.logprob_thresholds import LogprobThresholds, judged_failures
from comparator.logprobs.llama_stats import LlamaStats
from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = [
    "UNKNOWN_TOKEN",
    "TopK",
    "SequenceLogprobs",
    "AlignedSample",
    "Alignment",
    "Located",
    "PositionSeries",
    "LogitsByRequest",
    "KlResult",
    "KlPass",
    "LogprobVerdict",
    "logprob_delta",
]

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
            object.__setattr__(
                self, "top", tuple(None if t is None else tuple((int(i), float(v)) for i, v in t) for t in self.top)
            )
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


def _read_float(d: Mapping[str, Any], key: str | None, presence: str, has_kl: bool) -> float | None:
    """A metric's (or its SE's) JSON value, read back by the metric's presence
    (:data:`~comparator.judging.logprob_metrics.Presence`)."""
    if key is None or key not in d or (presence == "with_kl" and not has_kl):
        return None
    raw = d[key]
    if presence == "optional":
        return None if raw is None else float(raw)
    return from_json_float(raw)


def _read_metric(m: LogprobMetric, d: Mapping[str, Any], has_kl: bool) -> MetricValue:
    se = _read_float(d, m.se_key, m.presence, has_kl)
    if not m.located:
        return MetricValue(_read_float(d, m.name, m.presence, has_kl), se)
    at = Located.from_json(d.get(m.name), computed=m.presence == "always" or (m.presence == "with_kl" and has_kl))
    return MetricValue(at.value, se, at.request, at.position)


@dataclass(frozen=True)
class LogprobVerdict:
    """The logprob-level verdict; ``bool(verdict)`` is ``passed``; JSON keys are a public contract.

    ``values`` holds every checked metric (the metric table) by name; ``verdict.NAME`` reads one
    (a :class:`Located` for a located metric, else its value) and ``verdict.NAME_SE_KEY`` its
    standard error. KL values and ``top1_agreement`` are None without logits, top-k ones without
    common top-k tokens; a metric is None only in JSON written before it existed. ``passed`` is
    stored (decided once, by :func:`compare_logprobs`). In JSON, non-finite floats are null; they
    read back as inf for metrics that were computed, and None where the metric was optional.
    """

    values: Mapping[str, MetricValue]
    rmse: float
    k3_max: Located
    compared_positions: int
    requests: int
    thresholds: LogprobThresholds
    passed: bool
    kl_percentiles: dict[str, float] | None = None
    top1_agreement: float | None = None
    topk_mean_err: float | None = None
    llama: LlamaStats | None = None
    """llama-perplexity's statistics (Δp, PPL ratio, KL and same-top uncertainties); flat keys in JSON."""
    unmatched_baseline: tuple[str, ...] = ()
    unmatched_target: tuple[str, ...] = ()
    noise: NoiseCheck | None = None
    """Each metric against the calibrated noise (None: fixed thresholds); :mod:`comparator.judging.logprob_noise`."""
    series: tuple[PositionSeries, ...] = field(default=(), compare=False, repr=False)
    """Per-request per-position values (in memory only; empty after :meth:`from_json`)."""

    def __bool__(self) -> bool:
        return self.passed

    def __getattr__(self, name: str) -> Any:
        """``verdict.max_abs_err`` (a :class:`Located`), ``verdict.mse``, ``verdict.k3_mean_se``: a metric of the
        table, or its standard error."""
        values = self.__dict__.get("values")
        if values is not None and not name.startswith("_"):
            spec = logprob_metric(name)
            if spec is not None:
                v = values.get(name, MetricValue())
                return Located(v.value, v.request, v.position) if spec.located else v.value
            for m in logprob_metrics():
                if m.se_key == name:
                    return values.get(m.name, MetricValue()).se
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def value_of(self, name: str) -> MetricValue:
        """The metric ``name`` (an empty :class:`MetricValue` when this verdict did not compute it)."""
        return self.values.get(name, MetricValue())

    def metrics(self) -> dict[str, float | None]:
        """The values the thresholds check, by threshold name."""
        return {name: self.value_of(name).value for name in metric_names()}

    def failures(self) -> list[str]:
        """Names of the thresholds this verdict fails (see :func:`judged_failures`)."""
        return judged_failures(self.thresholds, self.metrics(), self.noise)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in logprob_metrics():
            v = self.value_of(m.name)
            out[m.name] = Located(v.value, v.request, v.position).to_json() if m.located else to_json_float(v.value)
            if m.se_key is not None:
                out[m.se_key] = to_json_float(v.se)
        details = {
            "rmse": to_json_float(self.rmse),
            "k3_max": self.k3_max.to_json(),
            "kl_percentiles": None
            if self.kl_percentiles is None
            else {k: to_json_float(v) for k, v in self.kl_percentiles.items()},
            "top1_agreement": to_json_float(self.top1_agreement),
            "topk_mean_err": to_json_float(self.topk_mean_err),
            **(self.llama.to_json() if self.llama is not None else LlamaStats.empty_json()),
            "compared_positions": self.compared_positions,
            "requests": self.requests,
            "unmatched_baseline": list(self.unmatched_baseline),
            "unmatched_target": list(self.unmatched_target),
            "thresholds": self.thresholds.to_json(),
            "threshold_source": self.thresholds.source,
            "noise": None if self.noise is None else self.noise.to_json(),
            "passed": self.passed,
        }
        for k, v in details.items():
            out.setdefault(k, v)  # a metric's own key (kl_mean_se) over the llama statistics' copy of it
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LogprobVerdict:
        def optional(v: Any) -> float | None:
            return None if v is None else float(v)

        has_kl = d.get("kl_percentiles") is not None
        thresholds = LogprobThresholds.from_json(d["thresholds"])
        return cls(
            values={m.name: _read_metric(m, d, has_kl) for m in logprob_metrics()},
            rmse=from_json_float(d["rmse"]),
            k3_max=Located.from_json(d["k3_max"], computed=True),
            compared_positions=int(d["compared_positions"]),
            requests=int(d["requests"]),
            thresholds=replace(thresholds, source=d.get("threshold_source")),
            passed=bool(d["passed"]),
            kl_percentiles={k: from_json_float(v) for k, v in d["kl_percentiles"].items()} if has_kl else None,
            top1_agreement=optional(d.get("top1_agreement")),
            topk_mean_err=optional(d.get("topk_mean_err")),
            llama=LlamaStats.from_json(d),
            unmatched_baseline=tuple(d.get("unmatched_baseline", ())),
            unmatched_target=tuple(d.get("unmatched_target", ())),
            noise=NoiseCheck.from_json(d["noise"]) if d.get("noise") else None,
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False)
