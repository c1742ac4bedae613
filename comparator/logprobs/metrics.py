"""Actual-token and top-k logprob metrics: MSE / RMSE / mean and max |delta|, k3, top-k errors.

k3 = (e^d - 1) - d with d = log q - log p (target minus reference) is written once, here
(:func:`k3`); its expectation under the reference distribution is KL(P_ref || P_target), and
it is d^2/2 for small d. Each family has a mean-type number (is the whole run shifted?) and a
max-type number with its (request, position) (did one position break?). Full-distribution KL
lives in :mod:`comparator.logprobs.kl`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from comparator.logprobs.llama_stats import mean_se
from comparator.logprobs.types import AlignedSample, Located, logprob_delta
from dumper.errors import NotComparableError

__all__ = [
    "GREEDY_K3_NOTE",
    "ErrorStats",
    "K3Stats",
    "TopKStats",
    "K3Summary",
    "k3",
    "k3_summary",
    "logprob_errors",
    "k3_stats",
    "topk_errors",
    "argmax_located",
]

GREEDY_K3_NOTE: Final = (
    "k3 over greedy tokens: they are not samples of the distribution, so mean k3 is a biased "
    "estimate of KL (a decode-vs-prefill consistency measure)"
)
"""Said wherever k3 is computed from greedy tokens (``selfcheck`` results' ``k3_note``, the printed summary)."""


@dataclass(frozen=True)
class ErrorStats:
    """Actual-token logprob errors: MSE, RMSE, mean |delta| ± its SE, and the largest |delta| with its location."""

    mse: float
    rmse: float
    max_abs_err: Located
    mean_abs_err: float = 0.0
    mean_abs_err_se: float = 0.0


@dataclass(frozen=True)
class K3Stats:
    """k3 mean (per-sample mean, then mean over samples, as SGLang) ± its SE, and the largest k3."""

    mean: float
    max: Located
    se: float = 0.0


@dataclass(frozen=True)
class TopKStats:
    """Top-k |delta logprob| over tokens in both lists: max over samples of the per-sample max,
    mean over samples of the per-sample mean (SGLang test_logprobs.py)."""

    max_err: float
    mean_err: float
    samples: int


def k3(delta: np.ndarray) -> np.ndarray:
    """k3(d) = (e^d - 1) - d with d = log q - log p: >= 0, mean over x ~ P is KL(P || Q).

    For |d| < 1e-2 a Taylor series is used (expm1(d) - d cancels to nothing for d below ~1e-8);
    elsewhere ``expm1(d) - d``. +inf and -inf give +inf, NaN gives NaN.
    """
    shape = np.shape(delta)
    d = np.atleast_1d(np.asarray(delta, dtype=np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.expm1(d) - d
        small = np.abs(d) < 1e-2
        if np.any(small):
            s = d[small]
            # d^2/2 * (1 + d/3 * (1 + d/4 * (1 + d/5 * (1 + d/6 * (1 + d/7 * (1 + d/8))))))
            series = 1 + s / 8
            for k in (7, 6, 5, 4, 3):
                series = 1 + s / k * series
            out[small] = 0.5 * s * s * series
    out[np.isposinf(d)] = np.inf
    return out.reshape(shape)


def argmax_located(samples: Sequence[AlignedSample], values: Sequence[np.ndarray]) -> Located:
    """The first largest value over all samples (sample order, then position order); ``values[i]``
    holds one value per position of ``samples[i]``."""
    best: Located = Located()
    for s, v in zip(samples, values, strict=True):
        if v.size == 0:
            continue
        j = int(np.argmax(v))  # first maximum; inf beats every finite value
        if best.value is None or v[j] > best.value:
            best = Located(float(v[j]), s.request, int(s.positions[j]))
    return best


def logprob_errors(samples: Sequence[AlignedSample]) -> ErrorStats:
    """MSE = mean of (log q - log p)^2 over all compared positions (pooled), RMSE, mean |delta|
    (pooled) ± its SE (:func:`comparator.logprobs.llama_stats.mean_se`), max |delta|."""
    deltas = [s.delta for s in samples]
    allv = np.concatenate(deltas) if deltas else np.empty(0)
    if allv.size == 0:
        raise NotComparableError("no compared positions")
    with np.errstate(over="ignore"):
        mse = float(np.mean(allv * allv))
    mean_abs, mean_abs_se = mean_se(np.abs(allv))
    return ErrorStats(
        mse=mse,
        rmse=math.sqrt(mse),
        max_abs_err=argmax_located(samples, [np.abs(d) for d in deltas]),
        mean_abs_err=mean_abs,
        mean_abs_err_se=mean_abs_se,
    )


def _mean_of_means_se(values: Sequence[np.ndarray]) -> float:
    """SE of the mean of per-sample means: ``sqrt(sum_s var_s / n_s) / S`` (sample variances);
    0 with 10 positions or fewer in all, as llama.cpp's ``mean_and_uncertainty``; inf if not finite."""
    vals = [v for v in values if v.size]
    if sum(v.size for v in vals) <= 10:
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        total = sum(float(np.var(v, ddof=1)) / v.size for v in vals if v.size >= 2)
    return math.sqrt(total) / len(vals) if math.isfinite(total) else math.inf


def k3_stats(samples: Sequence[AlignedSample]) -> K3Stats:
    """k3 per position; mean per sample, then mean over samples (SGLang's compare_kl_divergence),
    so long requests do not outweigh short ones, ± its SE; plus the largest k3 and where it is."""
    vals = [k3(s.delta) for s in samples]
    means = [float(np.mean(v)) for v in vals if v.size]
    if not means:
        raise NotComparableError("no compared positions")
    return K3Stats(mean=float(np.mean(means)), max=argmax_located(samples, vals), se=_mean_of_means_se(vals))


def topk_errors(samples: Sequence[AlignedSample]) -> TopKStats | None:
    """|delta logprob| of tokens present in both top-k lists at the same position.

    Per sample: max and mean over all such tokens and positions; then the max of the maxima and
    the mean of the means (SGLang test_logprobs.py). Samples without any common top-k token are
    left out; None when no sample has one (no top-k on either side).
    """
    maxes: list[float] = []
    means: list[float] = []
    for s in samples:
        if s.ref_top is None or s.tgt_top is None:
            continue
        ref_vals: list[float] = []
        tgt_vals: list[float] = []
        for ra, ta in zip(s.ref_top, s.tgt_top, strict=True):
            if not ra or not ta:
                continue
            tm = dict(ta)
            for tok, lp in ra:
                if tok in tm:
                    ref_vals.append(lp)
                    tgt_vals.append(tm[tok])
        if not ref_vals:
            continue
        d = np.abs(logprob_delta(np.asarray(ref_vals, np.float64), np.asarray(tgt_vals, np.float64)))
        maxes.append(float(np.max(d)))
        means.append(float(np.mean(d)))
    if not maxes:
        return None
    return TopKStats(max_err=max(maxes), mean_err=float(np.mean(means)), samples=len(maxes))


@dataclass(frozen=True, eq=False)
class K3Summary:
    """k3 of paired logprobs of the same tokens (one request): per position, mean, max and where."""

    delta: np.ndarray  # [n] float64, tgt - ref
    values: np.ndarray  # [n] float64, k3 per position
    mean: float
    max: float
    argmax: int
    """Index of the largest k3 (the first NaN, if any: NaN is the worst)."""
    max_abs_err: float


def k3_summary(ref: Sequence[float], tgt: Sequence[float]) -> K3Summary:
    """k3 of ``tgt`` against ``ref`` position by position (``selfcheck``: prefill vs decode logprobs).

    Plain ``tgt - ref`` differences (a NaN stays NaN and fails any threshold); raises
    NotComparableError for no positions or lengths that differ.
    """
    p, q = np.asarray(ref, dtype=np.float64), np.asarray(tgt, dtype=np.float64)
    if p.shape != q.shape or p.size == 0:
        raise NotComparableError(
            f"k3 needs the same positive number of logprobs on both sides, got {p.size} and {q.size}"
        )
    d = q - p
    vals = k3(d)
    return K3Summary(
        delta=d,
        values=vals,
        mean=float(vals.mean()),
        max=float(vals.max()),
        argmax=int(np.argmax(np.nan_to_num(vals, nan=np.inf))),
        max_abs_err=float(np.abs(d).max()),
    )
