"""The logprob verdict: :func:`compare_logprobs` aligns two sides, computes every metric and decides.

A :class:`LogprobVerdict` is a value: ``bool(verdict)`` is "passed", and its JSON keys are a
public contract (:meth:`LogprobVerdict.to_json` / :meth:`LogprobVerdict.from_json`). The checked
metrics are those of the metric table (:mod:`comparator.judging.logprob_metrics`), each under its
own flat key (and its standard error's, ``mean_abs_err_se``...). All arithmetic is float64.
NaN/Inf: a position where both sides hold the same value (the same NaN, or -inf on both) is no
difference; any other non-finite difference counts as an infinite error, so no threshold passes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dumper.errors import NotComparableError, UsageError

from comparator.jsonfloat import from_json_float, to_json_float
from comparator.judging.logprob_metrics import LogprobMetric, MetricValue, logprob_metric, logprob_metrics, metric_names
from comparator.judging.logprob_noise import NoiseCheck
from comparator.judging.logprob_thresholds import LogprobThresholds, judged_failures
from comparator.judging.noise_thresholds import noise_check
from comparator.logprobs.align import align_samples, check_lengths
from comparator.logprobs.kl import kl_percentiles, logits_kl
from comparator.logprobs.llama_stats import LlamaStats, llama_stats
from comparator.logprobs.metrics import (
    ErrorStats,
    K3Stats,
    TopKStats,
    argmax_located,
    k3_stats,
    logprob_errors,
    topk_errors,
)
from comparator.logprobs.types import (
    AlignedSample,
    Alignment,
    KlPass,
    KlResult,
    Located,
    LogitsByRequest,
    PositionSeries,
    SequenceLogprobs,
)

__all__ = ["LogprobVerdict", "VerdictInputs", "compare_logprobs"]


@dataclass(frozen=True, eq=False)
class VerdictInputs:
    """Everything a metric's ``compute`` may read (:class:`comparator.judging.logprob_metrics.MetricInputs`),
    computed once per verdict from the aligned samples (and their KL, when computed)."""

    samples: tuple[AlignedSample, ...]
    errors: ErrorStats
    k3: K3Stats
    topk: TopKStats | None
    kl_percentiles: dict[str, float] | None
    kl_max: Located
    llama: LlamaStats
    kl: KlResult | None = None


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
            "kl_percentiles": None if self.kl_percentiles is None
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
            rmse=from_json_float(d["rmse"]), k3_max=Located.from_json(d["k3_max"], computed=True),
            compared_positions=int(d["compared_positions"]), requests=int(d["requests"]),
            thresholds=replace(thresholds, source=d.get("threshold_source")), passed=bool(d["passed"]),
            kl_percentiles={k: from_json_float(v) for k, v in d["kl_percentiles"].items()} if has_kl else None,
            top1_agreement=optional(d.get("top1_agreement")), topk_mean_err=optional(d.get("topk_mean_err")),
            llama=LlamaStats.from_json(d),
            unmatched_baseline=tuple(d.get("unmatched_baseline", ())),
            unmatched_target=tuple(d.get("unmatched_target", ())),
            noise=NoiseCheck.from_json(d["noise"]) if d.get("noise") else None,
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False)


def compare_logprobs(base: Sequence[SequenceLogprobs], target: Sequence[SequenceLogprobs],
                     thresholds: LogprobThresholds, *, ref_logits: LogitsByRequest | None = None,
                     tgt_logits: LogitsByRequest | None = None, chunk_rows: int = 2048,
                     kl_pass: KlPass | None = None) -> LogprobVerdict:
    """Align, compute every metric, decide.

    Matched requests must cover the same positions on both sides (:func:`check_lengths`).
    With logits for both sides (or a ``kl_pass`` that reads full distributions some other way,
    e.g. :func:`comparator.logprobs.kl_stream.stream_kl`), KL(P_ref || P_target) is computed over the
    positions both sides have a distribution for, in matched requests: ``kl_mean`` is the mean
    over all those positions (pooled, as llama.cpp), ``kl_max`` the largest with its location.
    llama-perplexity's statistics (:mod:`comparator.logprobs.llama_stats`) come with every verdict; its
    KL and same-top uncertainties only with full distributions.
    """
    al = align_samples(base, target)
    check_lengths(base, target)
    if (ref_logits is None) != (tgt_logits is None):
        raise UsageError("logits given for one side only: KL needs both")
    if ref_logits is not None and tgt_logits is not None:
        if kl_pass is not None:
            raise UsageError("give logits or a kl_pass, not both")
        kl = logits_kl(al.samples, ref_logits, tgt_logits, chunk_rows=chunk_rows)
    else:
        kl = kl_pass(al.samples) if kl_pass is not None else None
    if kl is not None and not kl.per_request:
        raise NotComparableError("no position of a matched request has a full distribution on both sides")
    return _decide(al, thresholds, kl)


def _inputs(samples: tuple[AlignedSample, ...], kl: KlResult | None) -> VerdictInputs:
    """Every statistic of aligned samples (and their KL, if computed) that a metric may read."""
    pct: dict[str, float] | None = None
    kl_max = Located()
    kl_all: np.ndarray | None = None
    if kl is not None:
        kl_all = np.concatenate([v for _, _, v in kl.per_request])
        pct = kl_percentiles(kl_all)
        kl_max = argmax_located([AlignedSample(r, pos, np.empty(0), np.empty(0)) for r, pos, _ in kl.per_request],
                                [v for _, _, v in kl.per_request])
    llama = llama_stats(np.concatenate([s.ref for s in samples]), np.concatenate([s.tgt for s in samples]),
                        kl=kl_all, same_top=None if kl is None else (kl.agree, kl.total))
    return VerdictInputs(samples, logprob_errors(samples), k3_stats(samples), topk_errors(samples), pct, kl_max,
                         llama, kl)


def _computed(m: LogprobMetric, inputs: VerdictInputs) -> MetricValue:
    """``m.compute(inputs)`` as a :class:`MetricValue` (a compute may return a plain float, or None)."""
    r = m.compute(inputs)
    return r if isinstance(r, MetricValue) else MetricValue(None if r is None else float(r))


def _decide(al: Alignment, thresholds: LogprobThresholds, kl: KlResult | None) -> LogprobVerdict:
    """Every metric of the table over aligned samples (and their KL, if computed), and the decision."""
    c = _inputs(al.samples, kl)
    values = {m.name: _computed(m, c) for m in logprob_metrics()}
    check = noise_check(thresholds, values)
    kl_at = {r: (pos, v) for r, pos, v in kl.per_request} if kl is not None else {}
    return LogprobVerdict(
        values=values, rmse=c.errors.rmse, k3_max=c.k3.max, compared_positions=al.compared_positions,
        requests=len(al.samples), thresholds=thresholds,
        passed=not judged_failures(thresholds, {n: v.value for n, v in values.items()}, check),
        kl_percentiles=c.kl_percentiles, top1_agreement=kl.agree / kl.total if kl is not None and kl.total else None,
        topk_mean_err=c.topk.mean_err if c.topk else None, llama=c.llama,
        unmatched_baseline=al.unmatched_baseline, unmatched_target=al.unmatched_target, noise=check,
        series=tuple(PositionSeries(s.request, s.positions, s.ref, s.tgt, *kl_at.get(s.request, (None, None)))
                     for s in al.samples),
    )
