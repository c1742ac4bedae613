"""Full-distribution metrics from logits rows: exact KL(P_ref || P_target), top-1 agreement, KL percentiles.

All arithmetic is float64 on log-softmax values, ``chunk_rows`` rows at a time, so memory stays
a few ``chunk_rows x V`` arrays whatever the row count. :func:`logits_kl` runs them over the
matched requests of a comparison whose both sides hold logits in memory;
:func:`comparator.logprobs.kl_stream.stream_kl` does the same from disk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np

from comparator.logprobs.types import AlignedSample, KlResult, LogitsByRequest
from dumper.errors import NotComparableError, UsageError

__all__ = ["kl_rows", "top1_agreement", "kl_percentiles", "log_softmax_inplace", "logits_kl"]

_KL_PERCENTILES: Final = ("99.9", "99", "95", "90", "50")


def _float_rows(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 2:
        raise UsageError(f"{name} must be [rows, vocab], got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise UsageError(
            f"{name} must be a float array, got {a.dtype} (widen bfloat16 bits with dumper.format.to_float64 first)"
        )
    return a


def _pair_rows(ref: np.ndarray, tgt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, tgt = _float_rows(ref, "ref_logits"), _float_rows(tgt, "tgt_logits")
    if ref.shape != tgt.shape:
        raise NotComparableError(f"logits shapes differ: baseline {ref.shape}, target {tgt.shape}")
    return ref, tgt


def log_softmax_inplace(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of a float64 array, in place, via the max-shifted logsumexp."""
    m = np.max(x, axis=1, keepdims=True)
    m[~np.isfinite(m)] = 0.0  # all -inf (or inf/NaN) rows: leave them to produce NaN/-inf, no warning storm
    x -= m
    s = np.sum(np.exp(x), axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        x -= np.log(s)
    return x


def kl_rows(ref_logits: np.ndarray, tgt_logits: np.ndarray, *, chunk_rows: int = 2048) -> np.ndarray:
    """KL(P_ref || P_target) of each row of two [rows, V] logits arrays, as float64 [rows].

    Computed as sum_i p_i (log p_i - log q_i) on float64 log-softmax values, so tail tokens far
    below float32's (or even float64's) smallest probability still contribute exactly (a term
    with p_i == 0 is 0). ``chunk_rows`` rows are widened at a time: temporaries are a few
    ``chunk_rows x V`` float64 arrays whatever the row count. A row with NaN logits is 0 if both
    sides are bitwise the same there, else +inf.
    """
    ref, tgt = _pair_rows(ref_logits, tgt_logits)
    if chunk_rows < 1:
        raise UsageError(f"chunk_rows must be >= 1, got {chunk_rows}")
    rows = ref.shape[0]
    out = np.empty(rows, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        for lo in range(0, rows, chunk_rows):
            hi = min(lo + chunk_rows, rows)
            lp = log_softmax_inplace(np.array(ref[lo:hi], dtype=np.float64))
            lq = log_softmax_inplace(np.array(tgt[lo:hi], dtype=np.float64))
            np.subtract(lp, lq, out=lq)  # lq := log p - log q
            np.exp(lp, out=lp)  # lp := p
            zero = lp == 0.0
            np.multiply(lp, lq, out=lq)
            lq[zero] = 0.0
            kl = np.sum(lq, axis=1)
            bad = np.flatnonzero(np.isnan(kl))
            for r in bad:
                a, b = ref[lo + r], tgt[lo + r]
                kl[r] = 0.0 if np.array_equal(a, b, equal_nan=True) else np.inf
            out[lo:hi] = np.maximum(kl, 0.0)  # exact KL >= 0; rounding can leave -1e-17
    return out


def top1_agreement(ref_logits: np.ndarray, tgt_logits: np.ndarray, *, chunk_rows: int = 2048) -> tuple[int, int]:
    """``(rows whose argmax token is the same on both sides, rows)``; argmax ties pick the lowest id."""
    ref, tgt = _pair_rows(ref_logits, tgt_logits)
    agree = 0
    for lo in range(0, ref.shape[0], chunk_rows):
        hi = lo + chunk_rows
        agree += int(np.count_nonzero(np.argmax(ref[lo:hi], axis=1) == np.argmax(tgt[lo:hi], axis=1)))
    return agree, int(ref.shape[0])


def kl_percentiles(values: np.ndarray) -> dict[str, float]:
    """llama.cpp-style KL summary: ``mean``, ``max`` and percentiles 99.9, 99, 95, 90, 50 (median).

    The verdict's ``kl_quantiles`` (:mod:`comparator.logprobs.llama_stats`) adds the lower ones llama-perplexity prints.

    np.percentile with linear interpolation; a percentile that interpolates between two
    infinite values (NaN) is reported as inf.
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise NotComparableError("no KL values to summarize")
    with np.errstate(invalid="ignore"):
        pct = np.percentile(v, [float(k) for k in _KL_PERCENTILES])
        out = {"mean": float(np.mean(v)), "max": float(np.max(v))}
    for k, p in zip(_KL_PERCENTILES, pct, strict=True):
        out[k] = math.inf if math.isnan(p) else float(p)
    for k in ("mean", "max"):
        if math.isnan(out[k]):
            out[k] = math.inf
    return out


def _common_rows(
    rid: str,
    ref: tuple[np.ndarray, np.ndarray],
    tgt: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions both sides have, and the two sides' rows there (row order = position order)."""
    out = []
    for side, (pos, rows) in (("baseline", ref), ("target", tgt)):
        p = np.asarray(pos, dtype=np.int64).reshape(-1)
        r = _float_rows(rows, f"{side} logits of request {rid!r}")
        if p.size != r.shape[0]:
            raise UsageError(f"{side} logits of request {rid!r}: {p.size} positions but {r.shape[0]} rows")
        if np.unique(p).size != p.size:
            raise UsageError(f"{side} logits of request {rid!r}: repeated positions")
        out.append((p, r))
    (pa, ra), (pb, rb) = out
    common, ia, ib = np.intersect1d(pa, pb, assume_unique=True, return_indices=True)
    return common, ra[ia], rb[ib]


def logits_kl(
    samples: Sequence[AlignedSample],
    ref_logits: LogitsByRequest,
    tgt_logits: LogitsByRequest,
    *,
    chunk_rows: int = 2048,
) -> KlResult:
    """Exact KL (:func:`kl_rows`) and top-1 agreement over the positions of matched requests that
    have logits rows on both sides."""
    per: list[tuple[str, np.ndarray, np.ndarray]] = []
    agree = total = 0
    for s in samples:
        if s.request not in ref_logits or s.request not in tgt_logits:
            continue
        pos, ra, rb = _common_rows(s.request, ref_logits[s.request], tgt_logits[s.request])
        if pos.size == 0:
            continue
        per.append((s.request, pos, kl_rows(ra, rb, chunk_rows=chunk_rows)))
        a, n = top1_agreement(ra, rb, chunk_rows=chunk_rows)
        agree, total = agree + a, total + n
    if not per:
        raise NotComparableError("logits given, but no position of a matched request has logits on both sides")
    return KlResult(tuple(per), agree, total)
