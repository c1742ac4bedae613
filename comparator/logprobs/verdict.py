"""The logprob verdict: :func:`compare_logprobs` aligns two sides, computes every metric and decides.

A :class:`LogprobVerdict` is a value: ``bool(verdict)`` is "passed", and its JSON keys are a
public contract (:meth:`LogprobVerdict.to_json` / :meth:`LogprobVerdict.from_json`). All
arithmetic is float64. NaN/Inf: a position where both sides hold the same value (the same NaN,
or -inf on both) is no difference; any other non-finite difference counts as an infinite error,
so no threshold passes it. Mean-type values carry a standard error (llama.cpp's
``mean_and_uncertainty``): ``mean_abs_err_se``, ``k3_mean_se`` and the llama statistics' ``kl_mean_se``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dumper.errors import NotComparableError, UsageError

from comparator.jsonfloat import from_json_float, to_json_float
from comparator.logprobs.align import align_samples, check_lengths
from comparator.logprobs.kl import kl_percentiles, logits_kl
from comparator.logprobs.llama_stats import LlamaStats, llama_stats
from comparator.logprobs.metrics import argmax_located, k3_stats, logprob_errors, topk_errors
from comparator.logprobs.thresholds import LogprobThresholds, judged_failures
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

if TYPE_CHECKING:
    from comparator.noise.logprobs import NoiseCheck

__all__ = ["LogprobVerdict", "compare_logprobs"]

@dataclass(frozen=True)
class LogprobVerdict:
    """The logprob-level verdict; ``bool(verdict)`` is ``passed``; JSON keys are a public contract.

    ``kl_*`` / ``top1_agreement`` are None without logits, ``topk_*`` None without common top-k
    tokens; ``mean_abs_err``, ``mean_abs_err_se`` and ``k3_mean_se`` are None only in JSON written
    before they existed. ``passed`` is stored (decided once, by :func:`compare_logprobs`). In
    JSON, non-finite floats are null; they read back as inf for metrics that were computed, and
    None where the metric was optional (``topk_*``, ``top1_agreement``).
    """

    mse: float
    rmse: float
    max_abs_err: Located
    k3_mean: float
    k3_max: Located
    compared_positions: int
    requests: int
    thresholds: LogprobThresholds
    passed: bool
    kl_mean: float | None = None
    kl_max: Located = field(default_factory=Located)
    kl_percentiles: dict[str, float] | None = None
    top1_agreement: float | None = None
    topk_max_err: float | None = None
    topk_mean_err: float | None = None
    llama: LlamaStats | None = None
    """llama-perplexity's statistics (Δp, PPL ratio, KL and same-top uncertainties); flat keys in JSON."""
    unmatched_baseline: tuple[str, ...] = ()
    unmatched_target: tuple[str, ...] = ()
    mean_abs_err: float | None = None
    """Mean |Δlogprob| over all compared positions (pooled)."""
    mean_abs_err_se: float | None = None
    k3_mean_se: float | None = None
    noise: NoiseCheck | None = None
    """Each metric against the calibrated noise (None: fixed thresholds); :mod:`comparator.noise.logprobs`."""
    series: tuple[PositionSeries, ...] = field(default=(), compare=False, repr=False)
    """Per-request per-position values (in memory only; empty after :meth:`from_json`)."""

    def __bool__(self) -> bool:
        return self.passed

    def metrics(self) -> dict[str, float | None]:
        """The values the thresholds check, by threshold name."""
        return {"mse": self.mse, "mean_abs_err": self.mean_abs_err, "max_abs_err": self.max_abs_err.value,
                "k3_mean": self.k3_mean, "kl_mean": self.kl_mean, "kl_max": self.kl_max.value,
                "topk_max_err": self.topk_max_err}

    def failures(self) -> list[str]:
        """Names of the thresholds this verdict fails (see :func:`judged_failures`)."""
        return judged_failures(self.thresholds, self.metrics(), self.noise)

    def to_json(self) -> dict[str, Any]:
        return {
            "mse": to_json_float(self.mse),
            "rmse": to_json_float(self.rmse),
            "max_abs_err": self.max_abs_err.to_json(),
            "k3_mean": to_json_float(self.k3_mean),
            "k3_max": self.k3_max.to_json(),
            "kl_mean": to_json_float(self.kl_mean),
            "kl_max": self.kl_max.to_json(),
            "kl_percentiles": None if self.kl_percentiles is None
            else {k: to_json_float(v) for k, v in self.kl_percentiles.items()},
            "top1_agreement": to_json_float(self.top1_agreement),
            "topk_max_err": to_json_float(self.topk_max_err),
            "topk_mean_err": to_json_float(self.topk_mean_err),
            **(self.llama.to_json() if self.llama is not None else LlamaStats.empty_json()),
            "compared_positions": self.compared_positions,
            "requests": self.requests,
            "unmatched_baseline": list(self.unmatched_baseline),
            "unmatched_target": list(self.unmatched_target),
            "thresholds": self.thresholds.to_json(),
            "threshold_source": self.thresholds.source,
            "mean_abs_err": to_json_float(self.mean_abs_err),
            "mean_abs_err_se": to_json_float(self.mean_abs_err_se),
            "k3_mean_se": to_json_float(self.k3_mean_se),
            "noise": None if self.noise is None else self.noise.to_json(),
            "passed": self.passed,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LogprobVerdict:
        def optional(v: Any) -> float | None:
            return None if v is None else float(v)

        has_kl = d.get("kl_percentiles") is not None
        noise = None
        if d.get("noise"):
            from comparator.noise.logprobs import NoiseCheck  # comparator.noise.logprobs imports this module

            noise = NoiseCheck.from_json(d["noise"])
        thresholds = LogprobThresholds.from_json(d["thresholds"])
        return cls(
            mse=from_json_float(d["mse"]), rmse=from_json_float(d["rmse"]),
            max_abs_err=Located.from_json(d["max_abs_err"], computed=True),
            k3_mean=from_json_float(d["k3_mean"]), k3_max=Located.from_json(d["k3_max"], computed=True),
            compared_positions=int(d["compared_positions"]), requests=int(d["requests"]),
            thresholds=replace(thresholds, source=d.get("threshold_source")), passed=bool(d["passed"]),
            kl_mean=from_json_float(d["kl_mean"]) if has_kl else None,
            kl_max=Located.from_json(d.get("kl_max"), computed=has_kl),
            kl_percentiles={k: from_json_float(v) for k, v in d["kl_percentiles"].items()} if has_kl else None,
            top1_agreement=optional(d.get("top1_agreement")),
            topk_max_err=optional(d.get("topk_max_err")), topk_mean_err=optional(d.get("topk_mean_err")),
            llama=LlamaStats.from_json(d),
            unmatched_baseline=tuple(d.get("unmatched_baseline", ())),
            unmatched_target=tuple(d.get("unmatched_target", ())),
            mean_abs_err=None if "mean_abs_err" not in d else from_json_float(d["mean_abs_err"]),
            mean_abs_err_se=None if "mean_abs_err_se" not in d else from_json_float(d["mean_abs_err_se"]),
            k3_mean_se=None if "k3_mean_se" not in d else from_json_float(d["k3_mean_se"]),
            noise=noise,
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
    return _verdict(al, thresholds, kl)


def _verdict(al: Alignment, thresholds: LogprobThresholds, kl: KlResult | None) -> LogprobVerdict:
    """Every metric of aligned samples (and their KL, if computed), and the decision."""
    samples = al.samples
    err = logprob_errors(samples)
    k = k3_stats(samples)
    tk = topk_errors(samples)
    kl_mean: float | None = None
    kl_max = Located()
    pct: dict[str, float] | None = None
    top1: float | None = None
    kl_at: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    kl_all: np.ndarray | None = None
    if kl is not None:
        kl_all = np.concatenate([v for _, _, v in kl.per_request])
        pct = kl_percentiles(kl_all)
        kl_mean = pct["mean"]
        kl_max = argmax_located([AlignedSample(r, pos, np.empty(0), np.empty(0)) for r, pos, _ in kl.per_request],
                                 [v for _, _, v in kl.per_request])
        top1 = kl.agree / kl.total if kl.total else None
        kl_at = {r: (pos, v) for r, pos, v in kl.per_request}
    llama = llama_stats(np.concatenate([s.ref for s in samples]), np.concatenate([s.tgt for s in samples]),
                        kl=kl_all, same_top=None if kl is None else (kl.agree, kl.total))
    metrics = {"mse": err.mse, "mean_abs_err": err.mean_abs_err, "max_abs_err": err.max_abs_err.value,
               "k3_mean": k.mean, "kl_mean": kl_mean, "kl_max": kl_max.value, "topk_max_err": tk.max_err if tk else None}
    check = None
    if thresholds.basis is not None:
        from comparator.noise.logprobs import noise_check  # comparator.noise.logprobs imports this module

        check = noise_check(thresholds, metrics, {"mean_abs_err": (err.mean_abs_err, err.mean_abs_err_se),
                                                  "k3_mean": (k.mean, k.se), "kl_mean": (kl_mean, llama.kl_mean_se)})
    return LogprobVerdict(
        mse=err.mse, rmse=err.rmse, max_abs_err=err.max_abs_err, k3_mean=k.mean, k3_max=k.max,
        compared_positions=al.compared_positions, requests=len(samples), thresholds=thresholds,
        passed=not judged_failures(thresholds, metrics, check),
        kl_mean=kl_mean, kl_max=kl_max, kl_percentiles=pct, top1_agreement=top1,
        topk_max_err=tk.max_err if tk else None, topk_mean_err=tk.mean_err if tk else None, llama=llama,
        unmatched_baseline=al.unmatched_baseline, unmatched_target=al.unmatched_target,
        mean_abs_err=err.mean_abs_err, mean_abs_err_se=err.mean_abs_err_se, k3_mean_se=k.se, noise=check,
        series=tuple(PositionSeries(s.request, s.positions, s.ref, s.tgt, *kl_at.get(s.request, (None, None)))
                     for s in samples),
    )
