"""The logprob verdict: :func:`compare_logprobs` aligns two sides, computes every metric and decides.

A :class:`LogprobVerdict` is a value: ``bool(verdict)`` is "passed", and its JSON keys are a
public contract (:meth:`LogprobVerdict.to_json` / :meth:`LogprobVerdict.from_json`). The checked
metrics are those of the metric table (:mod:`comparator.judging.logprob_metrics`), each under its
own flat key (and its standard error's, ``mean_abs_err_se``...). All arithmetic is float64.
NaN/Inf: a position where both sides hold the same value (the same NaN, or -inf on both) is no
difference; any other non-finite difference counts as an infinite error, so no threshold passes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from comparator.judging.logprob_metrics import LogprobMetric, MetricValue, logprob_metrics
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
    LogprobVerdict,
    PositionSeries,
    SequenceLogprobs,
)
from dumper.errors import NotComparableError, UsageError

__all__ = ["VerdictInputs", "compare_logprobs"]


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


def compare_logprobs(
    base: Sequence[SequenceLogprobs],
    target: Sequence[SequenceLogprobs],
    thresholds: LogprobThresholds,
    *,
    ref_logits: LogitsByRequest | None = None,
    tgt_logits: LogitsByRequest | None = None,
    chunk_rows: int = 2048,
    kl_pass: KlPass | None = None,
) -> LogprobVerdict:
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
        kl_max = argmax_located(
            [AlignedSample(r, pos, np.empty(0), np.empty(0)) for r, pos, _ in kl.per_request],
            [v for _, _, v in kl.per_request],
        )
    llama = llama_stats(
        np.concatenate([s.ref for s in samples]),
        np.concatenate([s.tgt for s in samples]),
        kl=kl_all,
        same_top=None if kl is None else (kl.agree, kl.total),
    )
    return VerdictInputs(
        samples, logprob_errors(samples), k3_stats(samples), topk_errors(samples), pct, kl_max, llama, kl
    )


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
        values=values,
        rmse=c.errors.rmse,
        k3_max=c.k3.max,
        compared_positions=al.compared_positions,
        requests=len(al.samples),
        thresholds=thresholds,
        passed=not judged_failures(thresholds, {n: v.value for n, v in values.items()}, check),
        kl_percentiles=c.kl_percentiles,
        top1_agreement=kl.agree / kl.total if kl is not None and kl.total else None,
        topk_mean_err=c.topk.mean_err if c.topk else None,
        llama=c.llama,
        unmatched_baseline=al.unmatched_baseline,
        unmatched_target=al.unmatched_target,
        noise=check,
        series=tuple(
            PositionSeries(s.request, s.positions, s.ref, s.tgt, *kl_at.get(s.request, (None, None)))
            for s in al.samples
        ),
    )
