"""llama.cpp's logprob statistics (``llama-perplexity --kl-divergence``), from per-token values.

Given, per scored token, the baseline's and the target's logprob of the correct token (and, with
full distributions on both sides, KL(base || target) and whether the top tokens agree), this
module computes what llama-perplexity prints, with its conventions (tools/perplexity/perplexity.cpp,
``kl_divergence``):

- mean ± uncertainty of a per-token value x: ``m = Σx/n``, ``se = sqrt((Σx²/n - m²)/(n-1))``, and
  ``se = 0`` when that variance is not positive or ``n <= 10`` (its ``mean_and_uncertainty``);
- PPL = exp(mean NLL) ± PPL·se; ``ln(PPL(Q)/PPL(base))`` ± ``sqrt(se_q² + se_b² - 2 cov)`` where
  ``cov`` is the covariance of the two mean NLLs (0 when ``n < 10``); the ratio is exp of that,
  ± ratio·se; the correlation is ``cov / (se_q·se_b)``;
- Δp = p_target - p_base of the correct token (p = e^logprob): mean ± se, percentiles, and
  RMS ± ``0.5/RMS · se(Δp²)``;
- same top token rate r ± ``sqrt(r(1-r)/(n-1))``.

Percentiles interpolate linearly between sorted values (numpy's default, as llama.cpp's
``percentile``). A value that is not finite (a NaN or infinite logprob) makes its statistic
infinite, never NaN, so no threshold passes it. All values are fractions (llama.cpp prints Δp
and rates in percent).

Example::

    import numpy as np
    from comparator.logprobs.llama_stats import llama_stats
    s = llama_stats(np.log([0.5, 0.25]), np.log([0.4, 0.25]))
    s.delta_p["mean"], s.ppl_ratio    # -0.05, 1.118...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["LlamaStats", "llama_stats", "mean_se", "percentiles", "DELTA_P_PERCENTILES", "KL_PERCENTILES", "stats_rows"]

DELTA_P_PERCENTILES: Final = ("99.9", "99", "95", "90", "75", "50", "25", "10", "5", "1", "0.1")
"""The Δp percentiles llama-perplexity prints, with ``max`` before and ``min`` after them."""
KL_PERCENTILES: Final = ("99.9", "99", "95", "90", "50", "10", "5", "1", "0.1")
"""The KLD percentiles llama-perplexity prints, with ``max`` before and ``min`` after them."""

_PPL_KEYS: Final = (
    "ppl_base",
    "ppl_base_se",
    "ppl_target",
    "ppl_target_se",
    "ln_ppl_ratio",
    "ln_ppl_ratio_se",
    "ppl_ratio",
    "ppl_ratio_se",
    "ppl_correlation",
)


def _inf_if_nan(v: float) -> float:
    return math.inf if math.isnan(v) else float(v)


def mean_se(values: np.ndarray) -> tuple[float, float]:
    """``(mean, uncertainty of the mean)`` as llama.cpp's ``mean_and_uncertainty`` (see the module doc)."""
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    if n < 1:
        return 0.0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        m = float(np.sum(v)) / n
        var = float(np.sum(v * v)) / n - m * m
    if not math.isfinite(m):
        return _inf_if_nan(m), math.inf
    return m, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def percentiles(values: np.ndarray, keys: tuple[str, ...]) -> dict[str, float]:
    """``max``, the percentiles named by ``keys`` (``"99.9"`` ...), ``min``; NaN interpolations are inf."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    with np.errstate(invalid="ignore"):
        pct = np.percentile(v, [float(k) for k in keys])
    out = {"max": _inf_if_nan(float(np.max(v)))}
    out.update({k: _inf_if_nan(float(p)) for k, p in zip(keys, pct, strict=True)})
    out["min"] = _inf_if_nan(float(np.min(v)))
    return out


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """Covariance of the means of ``a`` and ``b`` (llama.cpp's ``covariance``; 0 under 10 values)."""
    n = a.size
    if n < 10:
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        return (float(np.sum(a * b)) / n - (float(np.sum(a)) / n) * (float(np.sum(b)) / n)) / (n - 1)


@dataclass(frozen=True)
class LlamaStats:
    """llama-perplexity's statistics of one comparison; the JSON keys (flat, in the verdict) are a contract.

    ``kl_mean_se``, ``kl_quantiles`` and ``same_top_*`` are None without full distributions on
    both sides; ``kl_quantiles`` holds ``max``, the :data:`KL_PERCENTILES` and ``min``;
    ``delta_p`` holds ``mean``, ``mean_se``, ``rms``, ``rms_se``, ``max``, the
    :data:`DELTA_P_PERCENTILES` and ``min``.
    """

    ppl_base: float
    ppl_base_se: float
    ppl_target: float
    ppl_target_se: float
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    ppl_ratio: float
    ppl_ratio_se: float
    ppl_correlation: float
    delta_p: dict[str, float]
    kl_mean_se: float | None = None
    kl_quantiles: dict[str, float] | None = None
    same_top_rate: float | None = None
    same_top_se: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: to_json_float(getattr(self, k)) for k in _PPL_KEYS}
        out["delta_p"] = {k: to_json_float(v) for k, v in self.delta_p.items()}
        out["kl_mean_se"] = to_json_float(self.kl_mean_se)
        out["kl_quantiles"] = (
            None if self.kl_quantiles is None else {k: to_json_float(v) for k, v in self.kl_quantiles.items()}
        )
        out.update({k: to_json_float(getattr(self, k)) for k in ("same_top_rate", "same_top_se")})
        return out

    @staticmethod
    def empty_json() -> dict[str, Any]:
        """The keys of :meth:`to_json`, all null: a verdict without these statistics (none compared)."""
        return {
            **dict.fromkeys(_PPL_KEYS),
            "delta_p": None,
            "kl_mean_se": None,
            "kl_quantiles": None,
            "same_top_rate": None,
            "same_top_se": None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LlamaStats | None:
        """Inverse of :meth:`to_json` (None when ``d`` has no ``delta_p``: no statistics, or an older
        verdict). A null KL or same-top value reads back as inf where ``kl_quantiles`` is present."""
        if not d.get("delta_p"):
            return None
        has_kl = d.get("kl_quantiles") is not None
        kl = (lambda k: from_json_float(d.get(k))) if has_kl else (lambda k: None)
        return cls(
            **{k: from_json_float(d.get(k)) for k in _PPL_KEYS},
            delta_p={k: from_json_float(v) for k, v in d["delta_p"].items()},
            kl_mean_se=kl("kl_mean_se"),
            kl_quantiles={k: from_json_float(v) for k, v in d["kl_quantiles"].items()} if has_kl else None,
            same_top_rate=kl("same_top_rate"),
            same_top_se=kl("same_top_se"),
        )


def _ppl(nll_base: np.ndarray, nll: np.ndarray) -> dict[str, float]:
    """The PPL entries of :class:`LlamaStats` from per-token NLLs of both sides."""
    mb, sb = mean_se(nll_base)
    mq, sq = mean_se(nll)
    cov = _covariance(nll, nll_base)
    with np.errstate(over="ignore", invalid="ignore"):
        ln_ratio = mq - mb
        ln_se = math.sqrt(max(sq * sq + sb * sb - 2.0 * cov, 0.0)) if math.isfinite(ln_ratio) else math.inf
        ratio = math.exp(ln_ratio) if ln_ratio < 700 else math.inf
        ppl_b = math.exp(mb) if mb < 700 else math.inf
        ppl_q = math.exp(mq) if mq < 700 else math.inf
        corr = cov / (sq * sb) if sq > 0 and sb > 0 else 0.0
    return {
        "ppl_base": _inf_if_nan(ppl_b),
        "ppl_base_se": _inf_if_nan(ppl_b * sb),
        "ppl_target": _inf_if_nan(ppl_q),
        "ppl_target_se": _inf_if_nan(ppl_q * sq),
        "ln_ppl_ratio": _inf_if_nan(ln_ratio),
        "ln_ppl_ratio_se": _inf_if_nan(ln_se),
        "ppl_ratio": _inf_if_nan(ratio),
        "ppl_ratio_se": _inf_if_nan(ratio * ln_se),
        "ppl_correlation": _inf_if_nan(corr),
    }


def _delta_p(dp: np.ndarray) -> dict[str, float]:
    m, se = mean_se(dp)
    msq, msq_se = mean_se(dp * dp)
    rms = math.sqrt(msq) if math.isfinite(msq) else math.inf
    rms_se = 0.5 / rms * msq_se if rms > 0 else 0.0
    return {"mean": m, "mean_se": se, "rms": rms, "rms_se": _inf_if_nan(rms_se), **percentiles(dp, DELTA_P_PERCENTILES)}


def llama_stats(
    ref: np.ndarray, tgt: np.ndarray, *, kl: np.ndarray | None = None, same_top: tuple[int, int] | None = None
) -> LlamaStats:
    """The statistics of a comparison: ``ref`` / ``tgt`` are the correct-token logprobs [n] of the
    baseline and target at every compared position (pooled over requests), ``kl`` the per-token
    KL(base || target) and ``same_top`` ``(agreeing rows, rows)`` where both sides had full
    distributions. A NaN logprob on one side counts as an infinitely wrong Δp."""
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    tgt = np.asarray(tgt, dtype=np.float64).reshape(-1)
    if ref.size == 0 or ref.shape != tgt.shape:
        raise ValueError(f"llama_stats needs equal, non-empty arrays; got {ref.shape} and {tgt.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        dp = np.exp(tgt) - np.exp(ref)
    dp[np.isnan(dp)] = np.inf
    kl_se: float | None = None
    kl_q: dict[str, float] | None = None
    if kl is not None and np.size(kl) > 0:
        kl_se, kl_q = mean_se(kl)[1], percentiles(kl, KL_PERCENTILES)
    rate = se = None
    if same_top is not None and same_top[1] > 0:
        agree, n = same_top
        rate = agree / n
        se = math.sqrt(rate * (1.0 - rate) / (n - 1)) if n > 1 else 0.0
    return LlamaStats(
        **_ppl(-ref, -tgt),
        delta_p=_delta_p(dp),
        kl_mean_se=kl_se,
        kl_quantiles=kl_q,
        same_top_rate=rate,
        same_top_se=se,
    )


def _f(v: float | None) -> str:
    return "-" if v is None else "inf" if math.isinf(v) else f"{v:.6g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else "inf" if math.isinf(v) else f"{100 * v:.4g}"


def stats_rows(s: LlamaStats, kl_mean: float | None = None) -> list[tuple[str, str]]:
    """(label, value) rows of the text report (``kl_mean``: the verdict's), in llama-perplexity's
    units: Δp and rates in %."""
    dp = s.delta_p
    rows = [
        ("PPL base", f"{_f(s.ppl_base)} ± {_f(s.ppl_base_se)}"),
        ("PPL target", f"{_f(s.ppl_target)} ± {_f(s.ppl_target_se)}"),
        ("PPL(Q)/PPL(base)", f"{_f(s.ppl_ratio)} ± {_f(s.ppl_ratio_se)}"),
        ("ln(PPL(Q)/PPL(base))", f"{_f(s.ln_ppl_ratio)} ± {_f(s.ln_ppl_ratio_se)}"),
    ]
    if s.kl_quantiles is not None:
        rows += [
            ("KL mean ± SE", f"{_f(kl_mean)} ± {_f(s.kl_mean_se)}"),
            (
                "KL p10 / p5 / p1 / p0.1 / min",
                " / ".join(_f(s.kl_quantiles[k]) for k in ("10", "5", "1", "0.1", "min")),
            ),
        ]
    rows += [
        ("Δp mean ± SE (%)", f"{_pct(dp['mean'])} ± {_pct(dp['mean_se'])}"),
        ("Δp RMS ± SE (%)", f"{_pct(dp['rms'])} ± {_pct(dp['rms_se'])}"),
        (
            "Δp max / p99 / p90 / median / p10 / p1 / min (%)",
            " / ".join(_pct(dp[k]) for k in ("max", "99", "90", "50", "10", "1", "min")),
        ),
    ]
    if s.same_top_rate is not None:
        rows.append(("same top token (%)", f"{_pct(s.same_top_rate)} ± {_pct(s.same_top_se)}"))
    return rows
