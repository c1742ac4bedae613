"""Logprob-level comparison: per-token logprob errors, the k3 KL estimate, top-k errors, full KL.

The hidden-state comparison says *where* two engines start to differ; this module says *whether
the difference matters* for the model's predictions. Both runs score the same fixed tokens
(teacher forcing), so position ``i`` of one run is directly comparable with position ``i`` of the
other. Three granularities:

- the actual token's logprob, one number per position: MSE / RMSE / max abs error, and
  k3 = (e^d - 1) - d with d = log q - log p (target minus reference), whose expectation under
  the reference distribution is KL(P_ref || P_target) and which is d^2/2 for small d;
- the top-k logprobs (if both engines returned them): max and mean |d| over tokens in both lists;
- full logits rows (if available): exact KL(P_ref || P_target) per position, its percentiles
  (llama.cpp style) and top-1 agreement.

Each family has a mean-type number (is the whole run shifted?) and a max-type number with its
(request, position) (did one position break?). Positions follow SGLang's ``input_token_logprobs``
convention: ``logprobs[i] = log p(token_ids[i] | token_ids[:i])``, and a logits row or top-k list
"at position i" is the distribution that predicts ``token_ids[i]``.

All arithmetic is float64. NaN/Inf: a position where both sides hold the same value (the same
NaN, or -inf on both) is no difference; any other non-finite difference counts as an infinite
error, so no threshold passes it.

Thresholds resolve as: explicit values > ``DRIFTSCOPE_LOGPROB_<NAME>`` environment variables (read
by :func:`logprob_env_thresholds` only; ``dumper/settings.py`` holds every other
``DRIFTSCOPE_*`` variable) > the per-model table ``configs/logprob_thresholds.json``, whose rows
merge ``default`` < ``default@DTYPE`` < ``MODEL`` < ``MODEL@DTYPE`` (DTYPE: the coarsest dtype of
the two dumps, :func:`comparator.noise.logprobs.threshold_dtype`). With a calibrated noise file,
:func:`comparator.noise.logprobs.resolve_logprob_thresholds` derives them from the noise instead.

Mean-type values carry a standard error (llama.cpp's ``mean_and_uncertainty``,
:func:`comparator.logprobs.llama_stats.mean_se`): ``mean_abs_err_se``, ``k3_mean_se`` and the llama
statistics' ``kl_mean_se``.

Example::

    from comparator.logprobs import SequenceLogprobs, LogprobThresholds, compare_logprobs
    a = SequenceLogprobs("r0", (5, 7, 9), (None, -1.0, -2.0))
    b = SequenceLogprobs("r0", (5, 7, 9), (None, -1.1, -2.0))
    verdict = compare_logprobs([a], [b], LogprobThresholds.resolve("tiny-llama"))
    verdict.mse, verdict.max_abs_err.position    # 0.005, 1
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from dumper.errors import NotComparableError, UsageError
from dumper.resources import config_path
from comparator.settings import comparator_settings

from comparator.jsonfloat import from_json_float, to_json_float
from comparator.logprobs.llama_stats import LlamaStats, llama_stats, mean_se

if TYPE_CHECKING:
    from comparator.noise.logprobs import NoiseBasis, NoiseCheck

__all__ = [
    "UNKNOWN_TOKEN",
    "GREEDY_K3_NOTE",
    "TopK",
    "SequenceLogprobs",
    "AlignedSample",
    "Alignment",
    "Located",
    "ErrorStats",
    "K3Stats",
    "TopKStats",
    "LogprobThresholds",
    "LogprobVerdict",
    "PositionSeries",
    "THRESHOLD_NAMES",
    "THRESHOLD_TABLE",
    "k3",
    "align_samples",
    "check_lengths",
    "logprob_errors",
    "k3_stats",
    "topk_errors",
    "kl_rows",
    "top1_agreement",
    "kl_percentiles",
    "logprob_env_thresholds",
    "explicit_thresholds",
    "judged_failures",
    "load_threshold_table",
    "compare_logprobs",
    "KlResult",
    "KlPass",
    "logits_kl",
]

UNKNOWN_TOKEN: Final = -1
"""Token id of a position whose token an engine did not report (before SGLang's
``logprob_start_len``); never compared, and its logprob is always None."""

TopK = tuple[tuple[int, float], ...]
"""Top-k ``(token_id, logprob)`` pairs of one distribution, most likely first."""

THRESHOLD_NAMES: Final = ("mse", "mean_abs_err", "max_abs_err", "k3_mean", "kl_mean", "kl_max", "topk_max_err")
"""Checked metrics, in report order; env var of each: ``DRIFTSCOPE_LOGPROB_<NAME upper>``."""

THRESHOLD_TABLE: Final = config_path("logprob_thresholds.json")
"""Per-model threshold table: ``{"default": {...}, "default@float32": {...}, "<model>": {...},
"<model>@<dtype>": {...}}``; each row overrides only the keys it names (``null`` = not checked)."""

_KL_PERCENTILES: Final = ("99.9", "99", "95", "90", "50")
GREEDY_K3_NOTE: Final = ("k3 over greedy tokens: they are not samples of the distribution, so mean k3 is a biased "
                         "estimate of KL (a decode-vs-prefill consistency measure)")
"""Said wherever k3 is computed from greedy tokens (``selfcheck`` results' ``k3_note``, the printed summary)."""


# --------------------------------------------------------------------------- data types


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
        return _delta(self.ref, self.tgt)


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


# --------------------------------------------------------------------------- elementwise


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


def _delta(ref: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """``tgt - ref``; 0 where both are equal (incl. the same inf, or NaN on both), +inf where NaN otherwise."""
    with np.errstate(invalid="ignore"):
        d = tgt - ref
    same = (ref == tgt) | (np.isnan(ref) & np.isnan(tgt))
    d[same] = 0.0
    d[np.isnan(d)] = np.inf
    return d


# --------------------------------------------------------------------------- alignment


def _index(side: Sequence[SequenceLogprobs], name: str) -> dict[str, SequenceLogprobs]:
    out: dict[str, SequenceLogprobs] = {}
    for s in side:
        if s.request in out:
            raise UsageError(f"duplicate request id {s.request!r} in the {name} logprobs")
        out[s.request] = s
    return out


def _check_tokens(a: SequenceLogprobs, b: SequenceLogprobs) -> None:
    """Raise NotComparableError at the first position both cover whose tokens differ."""
    n = min(len(a), len(b))
    if a.token_ids and b.token_ids:
        x = np.asarray(a.token_ids[:n], dtype=np.int64)
        y = np.asarray(b.token_ids[:n], dtype=np.int64)
        bad = np.flatnonzero((x != y) & (x != UNKNOWN_TOKEN) & (y != UNKNOWN_TOKEN))
        if bad.size:
            i = int(bad[0])
            raise NotComparableError(
                f"request {a.request!r}: token mismatch at position {i}: baseline token id {int(x[i])}, "
                f"target token id {int(y[i])}")
    elif a.token_texts is not None and b.token_texts is not None:
        for i, (s, t) in enumerate(zip(a.token_texts[:n], b.token_texts[:n], strict=True)):
            if s != t:
                raise NotComparableError(
                    f"request {a.request!r}: token mismatch at position {i}: baseline token {s!r}, target token {t!r}")
    elif n:
        raise NotComparableError(
            f"request {a.request!r}: cannot check token agreement: one side has ids, the other only text")


def align_samples(base: Sequence[SequenceLogprobs], target: Sequence[SequenceLogprobs]) -> Alignment:
    """Match requests by id and keep the positions where both sides have a logprob.

    Token ids (else texts) must agree wherever both sides know the token, or the logprobs score
    different things: a mismatch raises NotComparableError naming the request, position and both
    tokens. Requests on one side only are listed, not an error; no matched request or no compared
    position is a NotComparableError (an empty comparison must never pass).
    """
    b, t = _index(base, "baseline"), _index(target, "target")
    samples = []
    for rid, a in b.items():
        c = t.get(rid)
        if c is None:
            continue
        _check_tokens(a, c)
        n = min(len(a), len(c))
        pos = np.asarray([i for i in range(n) if a.logprobs[i] is not None and c.logprobs[i] is not None],
                         dtype=np.int64)
        samples.append(AlignedSample(
            request=rid, positions=pos,
            ref=np.asarray([a.logprobs[i] for i in pos], dtype=np.float64),
            tgt=np.asarray([c.logprobs[i] for i in pos], dtype=np.float64),
            ref_top=None if a.top is None else tuple(a.top[i] for i in pos),
            tgt_top=None if c.top is None else tuple(c.top[i] for i in pos),
        ))
    out = Alignment(tuple(samples), tuple(r for r in b if r not in t), tuple(r for r in t if r not in b))
    if not samples:
        raise NotComparableError(
            f"no request id in common ({len(b)} baseline, {len(t)} target requests): nothing to compare")
    if out.compared_positions == 0:
        raise NotComparableError(
            f"{len(samples)} matched requests but no position where both sides have a logprob")
    return out


def check_lengths(base: Sequence[SequenceLogprobs], target: Sequence[SequenceLogprobs]) -> None:
    """Raise NotComparableError for a request whose two sides cover different numbers of positions.

    A shorter side is missing data (a truncated response, a prompt without its output): comparing
    only the common prefix would pass positions that were never compared.
    """
    lengths = {s.request: len(s) for s in target}
    for a in base:
        n = lengths.get(a.request)
        if n is not None and n != len(a):
            raise NotComparableError(
                f"request {a.request!r}: the baseline covers {len(a)} positions, the target {n}; both sides must "
                "score the same tokens (the same prompt, and the same output if any)")


# --------------------------------------------------------------------------- metrics


def _argmax_located(samples: Sequence[AlignedSample], values: Sequence[np.ndarray]) -> Located:
    """The first largest value over all samples (sample order, then position order)."""
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
    return ErrorStats(mse=mse, rmse=math.sqrt(mse), max_abs_err=_argmax_located(samples, [np.abs(d) for d in deltas]),
                      mean_abs_err=mean_abs, mean_abs_err_se=mean_abs_se)


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
    return K3Stats(mean=float(np.mean(means)), max=_argmax_located(samples, vals), se=_mean_of_means_se(vals))


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
        d = np.abs(_delta(np.asarray(ref_vals, np.float64), np.asarray(tgt_vals, np.float64)))
        maxes.append(float(np.max(d)))
        means.append(float(np.mean(d)))
    if not maxes:
        return None
    return TopKStats(max_err=max(maxes), mean_err=float(np.mean(means)), samples=len(maxes))


# --------------------------------------------------------------------------- full distributions


def _float_rows(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 2:
        raise UsageError(f"{name} must be [rows, vocab], got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise UsageError(f"{name} must be a float array, got {a.dtype} (widen bfloat16 bits with "
                         "dumper.format.to_float64 first)")
    return a


def _pair_rows(ref: np.ndarray, tgt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, tgt = _float_rows(ref, "ref_logits"), _float_rows(tgt, "tgt_logits")
    if ref.shape != tgt.shape:
        raise NotComparableError(f"logits shapes differ: baseline {ref.shape}, target {tgt.shape}")
    return ref, tgt


def _log_softmax_inplace(x: np.ndarray) -> np.ndarray:
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
            lp = _log_softmax_inplace(np.array(ref[lo:hi], dtype=np.float64))
            lq = _log_softmax_inplace(np.array(tgt[lo:hi], dtype=np.float64))
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


# --------------------------------------------------------------------------- thresholds


def _parse_threshold(name: str, raw: Any, where: str) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        s = raw.strip()
        if s.lower() in ("off", "none", "null"):
            return None
        try:
            raw = float(s)
        except ValueError:
            raise UsageError(f"{where}: {name}={s!r} is not a number (or 'off')") from None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw < 0:
        raise UsageError(f"{where}: {name}={raw!r} must be a finite number >= 0 (or off/null)")
    return float(raw)


def logprob_env_thresholds(env: Mapping[str, str] | None = None) -> dict[str, float | None]:
    """Thresholds set by ``DRIFTSCOPE_LOGPROB_<NAME>`` (e.g. ``DRIFTSCOPE_LOGPROB_K3_MEAN=1e-3``).

    Only variables that are set (non-empty) appear; ``off`` maps to None (not checked). The
    variables are read by :func:`comparator.settings.comparator_settings`.
    """
    out: dict[str, float | None] = {}
    for name, raw in comparator_settings(env).logprob_thresholds.items():
        var = f"DRIFTSCOPE_LOGPROB_{name.upper()}"
        if name not in THRESHOLD_NAMES:
            raise UsageError(f"{var} is not a logprob threshold; known: "
                             f"{', '.join('DRIFTSCOPE_LOGPROB_' + n.upper() for n in THRESHOLD_NAMES)}")
        out[name] = _parse_threshold(var, raw, "environment")
    return out


def explicit_thresholds(explicit: Mapping[str, float | None] | None = None,
                        env: Mapping[str, str] | None = None) -> dict[str, float | None]:
    """The thresholds a user set: ``DRIFTSCOPE_LOGPROB_*``, overridden by ``explicit`` (names checked)."""
    values = logprob_env_thresholds(env)
    for k, v in (explicit or {}).items():
        if k not in THRESHOLD_NAMES:
            raise UsageError(f"unknown logprob threshold {k!r}; known: {list(THRESHOLD_NAMES)}")
        values[k] = v
    return values


_ROW_DTYPES: Final = ("float64", "float32", "float16", "bfloat16")


def _split_row(model: str) -> tuple[str, str | None]:
    """``"tiny-llama@bfloat16"`` -> ``("tiny-llama", "bfloat16")``; without a known dtype after ``@``
    (``/tmp/user@host/ckpt``) the whole string is the name."""
    name, sep, dtype = model.rpartition("@")
    return (name, dtype) if sep and name and dtype in _ROW_DTYPES else (model, None)


def load_threshold_table(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, float | None]]:
    """Read the per-model table (default :data:`THRESHOLD_TABLE`); keys validated, ``default`` required."""
    p = Path(path) if path is not None else THRESHOLD_TABLE
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{p}: cannot read the logprob threshold table: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("default"), dict):
        raise UsageError(f"{p}: expected an object with a 'default' entry")
    table: dict[str, dict[str, float | None]] = {}
    for model, entry in raw.items():
        if model.startswith("_"):
            continue  # comments
        if not isinstance(entry, dict):
            raise UsageError(f"{p}: entry {model!r} must be an object")
        unknown = set(entry) - set(THRESHOLD_NAMES)
        if unknown:
            raise UsageError(f"{p}: entry {model!r} has unknown keys {sorted(unknown)}; known: {list(THRESHOLD_NAMES)}")
        table[model] = {k: _parse_threshold(k, v, f"{p}: {model}") for k, v in entry.items()}
    return table


@dataclass(frozen=True)
class LogprobThresholds:
    """Upper bounds a verdict must meet; None = not checked.

    A set threshold passes when ``value <= threshold`` (so NaN never passes); a threshold whose
    metric was not computed (``kl_*`` without logits, ``topk_max_err`` without top-k) is skipped.
    """

    mse: float | None = None
    mean_abs_err: float | None = None
    max_abs_err: float | None = None
    k3_mean: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    topk_max_err: float | None = None
    basis: NoiseBasis | None = field(default=None, repr=False)
    """The calibrated noise these thresholds derive from (:mod:`comparator.noise.logprobs`); None: fixed."""
    source: str | None = field(default=None, compare=False)
    """Where they come from, for the verdict (table rows, noise file); not part of :meth:`to_json`."""

    def __post_init__(self) -> None:
        for name in THRESHOLD_NAMES:
            _parse_threshold(name, getattr(self, name), "thresholds")

    @classmethod
    def resolve(cls, model: str | None = None, *, explicit: Mapping[str, float | None] | None = None,
                env: Mapping[str, str] | None = None,
                table: str | os.PathLike[str] | Mapping[str, Mapping[str, float | None]] | None = None,
                dtype: str | None = None) -> LogprobThresholds:
        """Explicit values > ``DRIFTSCOPE_LOGPROB_*`` env vars > the table rows of ``model`` and ``dtype``.

        ``explicit`` maps threshold names to values; a name mapped to None turns that check off.
        The rows merge ``default`` < ``default@DTYPE`` < ``MODEL`` < ``MODEL@DTYPE``, each naming
        only the keys it sets; ``model`` is looked up as given, then by its last path component
        (``/models/tiny-llama``). ``model`` may carry a dtype itself (``default@bfloat16``), which
        then wins over ``dtype``. ``table`` is a path or an already loaded table.
        """
        tab = load_threshold_table(table) if table is None or isinstance(table, (str, os.PathLike)) else table
        if "default" not in tab:
            raise UsageError("logprob threshold table has no 'default' entry")
        name, own = _split_row(model) if model else (None, None)
        dtype = own or dtype
        if name:
            name = name if name in tab or f"{name}@{dtype}" in tab else Path(name.rstrip("/")).name
        rows = ["default"] + ([f"default@{dtype}"] if dtype else [])
        if name and name != "default":
            rows += [name] + ([f"{name}@{dtype}"] if dtype else [])
        values: dict[str, float | None] = {}
        used = [r for r in rows if r in tab]
        for r in used:
            values.update(tab[r])
        chosen = explicit_thresholds(explicit, env)
        values.update(chosen)
        source = f"{Path(table).name if isinstance(table, (str, os.PathLike)) else THRESHOLD_TABLE.name} " \
                 f"{' < '.join(used)}" + (f"; set: {', '.join(chosen)}" if chosen else "")
        return cls(**{k: values.get(k) for k in THRESHOLD_NAMES}, source=source)

    @staticmethod
    def check_row(model: str, table: str | os.PathLike[str] | None = None) -> None:
        """Raise :class:`UsageError` when ``model`` (as given with ``--model``) names no row of the table.

        The baseline's own model name may be missing from the table (it then uses ``default``); a
        name the user typed must not silently fall back, since a typo would loosen the thresholds.
        ``NAME@DTYPE`` names row ``NAME`` judged as ``DTYPE`` (a ``NAME@DTYPE`` row alone also counts).
        """
        tab = load_threshold_table(table)
        names = {_split_row(k)[0] for k in tab}
        name, _ = _split_row(model)
        if model not in tab and name not in names and Path(name.rstrip("/")).name not in names:
            raise UsageError(f"--model {model!r}: no such row in {table or THRESHOLD_TABLE}; "
                             f"known: {', '.join(sorted(tab))}")

    def failures(self, metrics: Mapping[str, float | None]) -> list[str]:
        """Names of set thresholds whose computed metric exceeds them (NaN exceeds everything)."""
        out = []
        for name in THRESHOLD_NAMES:
            limit, value = getattr(self, name), metrics.get(name)
            if limit is None or value is None:
                continue
            if not value <= limit:
                out.append(name)
        return out

    def to_json(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in THRESHOLD_NAMES}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LogprobThresholds:
        return cls(**{name: d.get(name) for name in THRESHOLD_NAMES})


# --------------------------------------------------------------------------- verdict


def judged_failures(thresholds: LogprobThresholds, metrics: Mapping[str, float | None],
                    noise: NoiseCheck | None) -> list[str]:
    """The thresholds failed: every exceeded one, except a noise-derived mean-type threshold whose
    mean is not significantly above the calibrated noise (:meth:`NoiseCheck.excused`)."""
    return [n for n in thresholds.failures(metrics) if noise is None or not noise.excused(n)]


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
        return _delta(self.ref, self.tgt)


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
            from comparator.noise.logprobs import NoiseCheck  # logprob_noise builds on this module

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


# --------------------------------------------------------------------------- glue

LogitsByRequest = Mapping[str, tuple[np.ndarray, np.ndarray]]
"""request id -> (positions [n] ints, logits rows [n, V]); row k is the distribution predicting
``token_ids[positions[k]]`` (for an HF prefill of N tokens, ``logits[0, j]`` sits at position j+1)."""


def _common_rows(rid: str, ref: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray],
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


@dataclass(frozen=True, eq=False)
class KlResult:
    """Full-distribution results of one comparison: per request, the positions both sides have a
    distribution for and KL(P_ref || P_target) there [n] float64; top tokens agreeing, of ``total`` rows."""

    per_request: tuple[tuple[str, np.ndarray, np.ndarray], ...]
    agree: int
    total: int


KlPass = Callable[[Sequence[AlignedSample]], KlResult]
"""Computes the :class:`KlResult` of the matched samples (dump logits, or llama.cpp KLD files streamed)."""


def logits_kl(samples: Sequence[AlignedSample], ref_logits: LogitsByRequest, tgt_logits: LogitsByRequest, *,
              chunk_rows: int = 2048) -> KlResult:
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
        kl_max = _argmax_located([AlignedSample(r, pos, np.empty(0), np.empty(0)) for r, pos, _ in kl.per_request],
                                 [v for _, _, v in kl.per_request])
        top1 = kl.agree / kl.total if kl.total else None
        kl_at = {r: (pos, v) for r, pos, v in kl.per_request}
    llama = llama_stats(np.concatenate([s.ref for s in samples]), np.concatenate([s.tgt for s in samples]),
                        kl=kl_all, same_top=None if kl is None else (kl.agree, kl.total))
    metrics = {"mse": err.mse, "mean_abs_err": err.mean_abs_err, "max_abs_err": err.max_abs_err.value,
               "k3_mean": k.mean, "kl_mean": kl_mean, "kl_max": kl_max.value, "topk_max_err": tk.max_err if tk else None}
    check = None
    if thresholds.basis is not None:
        from comparator.noise.logprobs import noise_check  # logprob_noise builds on this module

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
