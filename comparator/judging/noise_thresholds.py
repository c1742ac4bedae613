"""Thresholds derived from measured noise, for hidden states and logprobs, and a verdict against that noise.

A tensor judged against its noise (:func:`noise_limits`, :class:`NoiseLimits`) fails when

    rel_diff           > max(floor, factor * noise rel_diff)        or
    per-token rel_diff > max(floor, factor * noise per-token max)

where the per-token max is that of the row's phase when the noise measured phases apart (a
decode row against the decode rows' noise, a prompt row against the prompt rows'). A row the
calibration covered row by row (:mod:`comparator.judging.row_noise`) is judged instead by

    per-token rel_diff > max(floor, factor * max(its own noise, the tensor's row floor))

with ``factor`` :data:`DEFAULT_FACTOR` (3) and ``floor`` :data:`DEFAULT_FLOOR` (``--noise-factor``,
``--noise-floor``); fixed thresholds given explicitly still apply on top. Each calibrated logprob
metric's threshold (:func:`resolve_logprob_thresholds`) is ``max(floor[name], factor * noise[name])``
(floors: each metric's :attr:`~comparator.judging.logprob_metrics.LogprobMetric.floor`,
``--noise-floor NAME=VALUE``); explicit thresholds (flag or ``DRIFTSCOPE_LOGPROB_*``) apply on top,
the smaller one wins, and a metric the calibration did not compute keeps its fixed threshold.
Values are also reported as multiples of the noise, ``value / max(noise, floor)``
(:func:`noise_check`), with a z-score per mean-type metric. A derived threshold over
:data:`comparator.judging.fields.EXCESSIVE` x the fixed one it replaces is a warning
(:func:`noise_warnings`, ``NoiseCheck.warnings``): that noise lets pass what the fixed thresholds fail.

Example::

    from comparator.judging.noise_thresholds import resolve_logprob_thresholds
    thresholds = resolve_logprob_thresholds("tiny-llama", noise=noise.logprobs, factor=3.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from comparator.judging.fields import EXCESSIVE
from comparator.judging.logprob_metrics import MetricValue, default_floors, metric_names, tested_means
from comparator.judging.logprob_noise import (
    Z_SIGNIFICANT,
    LogprobNoise,
    MeanNoise,
    MeanTest,
    MetricNoise,
    NoiseBasis,
    NoiseCheck,
)
from comparator.judging.logprob_thresholds import LogprobThresholds, explicit_thresholds
from comparator.judging.noise import NoiseModel, TensorNoise
from comparator.judging.row_noise import RowKeys, RowNoise
from comparator.judging.values import parse_assignments, parse_threshold
from dumper.errors import UsageError
from dumper.format.decode import DECODE, PREFILL

__all__ = [
    "DEFAULT_FACTOR",
    "DEFAULT_FLOOR",
    "NoiseLimits",
    "noise_limits",
    "noise_warnings",
    "check_noise_factor",
    "parse_noise_floor",
    "resolve_logprob_thresholds",
    "noise_check",
]

DEFAULT_FACTOR: Final = 3.0
"""Safety factor over the calibrated noise. A benign layout not used for calibration reached at
most 1.14x the calibrated maximum on the presets (docs/calibration.md, "How many variants"); 3x leaves 2.6x
room for that and still fails a change at 4x the noise."""
DEFAULT_FLOOR: Final = 1e-12
"""Absolute rel_diff floor: a threshold never drops below it, so a calibration of bit-identical
re-runs (noise 0) still passes float32 rounding of the same computation (about 1e-14)."""


@dataclass(frozen=True)
class NoiseLimits:
    """The thresholds one tensor is judged by, and the noise they came from (None: fixed thresholds).

    ``token_threshold`` judges prompt rows (and every row when the noise has no phases);
    ``decode_token_threshold`` (None: the same) judges decode rows."""

    threshold: float
    token_threshold: float
    noise: TensorNoise | None = None
    floor: float = DEFAULT_FLOOR
    decode_token_threshold: float | None = None
    rows: RowNoise | None = None
    """The tensor's row noise (None: pooled noise only)."""
    cover: tuple[int, ...] = ()
    """Per sequence, how many leading positions the calibration covers for this comparison (its token ids agree)."""
    factor: float = DEFAULT_FACTOR
    fixed_token: float | None = None
    """An explicit per-token threshold that applies on top of the row thresholds too."""

    def own_noise(self, keys: RowKeys | None) -> np.ndarray | None:
        """Each row's own noise, at least the tensor's row floor; NaN where not covered (None: no row noise)."""
        if self.rows is None or keys is None:
            return None
        return np.maximum(self.rows.own(keys, self.cover), self.rows.floor)  # NaN stays NaN

    def token_thresholds(self, decode_rows: np.ndarray | None, keys: RowKeys | None = None) -> float | np.ndarray:
        """The per-token threshold of each row (``decode_rows``: which rows are decode rows; None: none known;
        ``keys``: each row's (sequence, position), for row noise)."""
        if decode_rows is None or self.decode_token_threshold is None:
            pooled: float | np.ndarray = self.token_threshold
        else:
            pooled = np.where(decode_rows, self.decode_token_threshold, self.token_threshold)
        own = self.own_noise(keys)
        if own is None:
            return pooled
        by_row = np.maximum(self.floor, self.factor * own)
        if self.fixed_token is not None:
            by_row = np.minimum(by_row, self.fixed_token)
        return np.where(np.isnan(own), pooled, by_row)

    def ratios(
        self, rel_diff: float, token: np.ndarray, decode_rows: np.ndarray | None = None, keys: RowKeys | None = None
    ) -> tuple[float | None, float | None]:
        """``(noise_ratio, token_noise_ratio)``: the values as multiples of ``max(noise, floor)``; each row's
        per-token value against its own noise where covered, else its phase's (arguments as in
        :meth:`token_thresholds`)."""
        if self.noise is None:
            return None, None
        ref: float | np.ndarray = max(self.noise.token_max, self.floor)
        if decode_rows is not None and self.noise.phases:
            ref = np.where(
                decode_rows, _phase_max(self.noise, DECODE, self.floor), _phase_max(self.noise, PREFILL, self.floor)
            )
        own = self.own_noise(keys)
        if own is not None:
            ref = np.where(np.isnan(own), ref, np.maximum(own, self.floor))
        if token.size == 0:
            worst = 0.0
        elif np.ndim(ref) == 0:
            worst = _ratio(float(np.max(token)), float(ref))
        else:
            with np.errstate(divide="ignore", invalid="ignore"):  # the rule of _ratio, row by row
                rows = np.where(ref > 0, token / ref, np.where(token == 0, 0.0, np.inf))
            worst = float(np.where(np.isnan(token), np.inf, rows).max())
        return _ratio(rel_diff, max(self.noise.rel_diff, self.floor)), worst


def _ratio(value: float, noise: float) -> float:
    """``value / noise``; NaN is infinitely far, and against a noise of 0 (``--noise-floor 0``) so is any value > 0."""
    if math.isnan(value):
        return math.inf
    return value / noise if noise > 0 else (0.0 if value == 0 else math.inf)


def _phase_max(noise: TensorNoise, phase: str, floor: float) -> float:
    """The per-token noise of ``phase``'s rows (the tensor's own when not measured apart), at least ``floor``."""
    own = noise.phases.get(phase)
    return max(own.token_max if own is not None else noise.token_max, floor)


def noise_limits(
    noise: TensorNoise,
    factor: float,
    floor: float,
    fixed: tuple[float, float] | None,
    rows: RowNoise | None = None,
    cover: tuple[int, ...] = (),
) -> NoiseLimits:
    """Thresholds from one tensor's noise (per phase where it has phases, per row where ``rows`` covers it under
    ``cover``); ``fixed`` (explicit thresholds) apply on top."""
    threshold = max(floor, factor * noise.rel_diff)
    token = max(floor, factor * (_phase_max(noise, PREFILL, 0.0) if noise.phases else noise.token_max))
    decode = max(floor, factor * _phase_max(noise, DECODE, 0.0)) if noise.phases else None
    if fixed is not None:
        threshold, token = min(threshold, fixed[0]), min(token, fixed[1])
        decode = None if decode is None else min(decode, fixed[1])
    return NoiseLimits(
        threshold, token, noise, floor, decode, rows, cover, factor, fixed[1] if fixed is not None else None
    )


def noise_warnings(noise: NoiseModel, limits: Mapping[str, NoiseLimits], fixed: tuple[float, float]) -> tuple[str, ...]:
    """What a verdict judged against ``noise`` must warn about.

    A calibration across models (:meth:`NoiseModel.mismatch_warning`), and the tensors whose
    thresholds (``limits``, by name, of the tensors judged) derived from noise exceed
    :data:`EXCESSIVE` x the ``fixed`` (rel_diff, per-token) thresholds they replace: such noise lets
    pass what the fixed thresholds fail (a noise value of 1 passes unrelated tensors).
    """
    out = [w for w in (noise.mismatch_warning(),) if w is not None]
    calibrated = {n: lim for n, lim in limits.items() if lim.noise is not None}
    over = [
        (n, lim)
        for n, lim in calibrated.items()
        if lim.threshold > EXCESSIVE * fixed[0]
        or max(lim.token_threshold, lim.decode_token_threshold or 0.0) > EXCESSIVE * fixed[1]
    ]
    if over:
        name, lim = over[0]
        out.append(
            f"{noise.source or 'the noise'}: the noise-derived thresholds of {len(over)} of {len(calibrated)} "
            f"calibrated tensors are over {EXCESSIVE:g}x the fixed thresholds they replace (e.g. {name}: "
            f"rel_diff <= {lim.threshold:.3g}, per-token <= {lim.token_threshold:.3g}; fixed {fixed[0]:g} and "
            f"{fixed[1]:g}): differences the fixed thresholds fail pass; recalibrate from benign re-runs"
        )
    return tuple(out)


def check_noise_factor(factor: float) -> float:
    """``factor`` if it is a finite number >= 1 (``--noise-factor``)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
        raise UsageError(f"--noise-factor must be a finite number >= 1, got {factor!r}")
    return float(factor)


def parse_noise_floor(items: Sequence[str]) -> dict[str, float]:
    """``--noise-floor VALUE`` (rel_diff) or ``--noise-floor NAME=VALUE`` (a logprob metric) items."""
    floors = parse_assignments(items, flag="--noise-floor", default_name="rel_diff")
    return {name: v for name, v in floors.items() if v is not None}  # None only comes with allow_off


def _floors(floors: Mapping[str, float] | None) -> dict[str, float]:
    out = default_floors()
    for k, v in (floors or {}).items():
        if k not in out:
            raise UsageError(f"--noise-floor {k}={v:g}: {k!r} is not a logprob metric; known: {', '.join(out)}")
        floor = parse_threshold(v, where=f"--noise-floor {k}")
        assert floor is not None  # parse_threshold gives None only with allow_off
        out[k] = floor
    return out


def resolve_logprob_thresholds(
    model: str | None,
    *,
    explicit: Mapping[str, float | None] | None = None,
    noise: LogprobNoise | None = None,
    factor: float | None = None,
    floors: Mapping[str, float] | None = None,
    dtype: str | None = None,
    env: Mapping[str, str] | None = None,
) -> LogprobThresholds:
    """The logprob thresholds of one comparison, for ``comparator logprobs`` and ``comparator A B`` alike.

    Without ``noise``: :meth:`LogprobThresholds.resolve` (explicit > env > table rows of ``model``
    and ``dtype``, see :func:`~comparator.judging.logprob_thresholds.threshold_dtype`). With
    ``noise``: each calibrated metric's threshold is ``max(floors[name], factor * noise[name])``
    (``factor`` default :data:`DEFAULT_FACTOR`, ``floors`` over each metric's own), and an explicit
    or env threshold applies on top (the smaller wins; ``None`` turns a check off).
    """
    fixed = LogprobThresholds.resolve(model, explicit=explicit, env=env, dtype=dtype)
    if noise is None:
        return fixed
    factor = DEFAULT_FACTOR if factor is None else check_noise_factor(factor)
    lim = _floors(floors)
    chosen = explicit_thresholds(explicit, env)
    values = dict(fixed.values)
    derived: set[str] = set()
    for name in metric_names():
        n = noise.metrics.get(name)
        if n is None:
            continue  # not calibrated: the fixed threshold
        own = max(lim[name], factor * n)
        if name in chosen and (chosen[name] is None or chosen[name] < own):  # type: ignore[operator]
            continue  # an explicit threshold, stricter (or off)
        values[name] = own
        derived.add(name)
    source = f"noise {noise.source or '(calibration)'} x{factor:g}"
    uncalibrated = [n for n in metric_names() if noise.metrics.get(n) is None]
    stricter = [n for n in metric_names() if n not in derived and n not in uncalibrated]
    source += f"; set: {', '.join(stricter)}" if stricter else ""
    source += f"; not calibrated, by {fixed.source}: {', '.join(uncalibrated)}" if uncalibrated else ""
    basis = NoiseBasis(noise, float(factor), lim, frozenset(derived), _excessive(noise, fixed, values, derived))
    return LogprobThresholds(values, basis=basis, source=source)


def _excessive(
    noise: LogprobNoise, fixed: LogprobThresholds, values: Mapping[str, float | None], derived: set[str]
) -> tuple[str, ...]:
    """The warning for noise-derived thresholds over EXCESSIVE x the fixed ones they replace (none: ``()``)."""
    base = fixed.values
    over = [
        f"{n} <= {values[n]:.3g} (fixed {base[n]:g})"
        for n in metric_names()
        if n in derived and base.get(n) is not None and values[n] > EXCESSIVE * base[n]
    ]  # type: ignore[operator]
    if not over:
        return ()
    return (
        f"{noise.source or 'the logprob noise'}: noise-derived logprob thresholds over {EXCESSIVE:g}x the fixed "
        f"ones they replace ({fixed.source or 'fixed thresholds'}): {', '.join(over)}; differences the fixed "
        "thresholds fail pass; recalibrate from benign re-runs",
    )


def _z(mean: float, se: float, noise: MeanNoise) -> float:
    """``(mean - noise.mean) / sqrt(se² + noise.se²)``; a non-finite mean is infinitely far above."""
    if not math.isfinite(mean) or not math.isfinite(se):
        return math.inf
    diff, scale = mean - noise.mean, math.sqrt(se * se + noise.se * noise.se)
    if scale > 0:
        return diff / scale
    return math.inf if diff > 0 else -math.inf if diff < 0 else 0.0


def noise_check(thresholds: LogprobThresholds, values: Mapping[str, MetricValue]) -> NoiseCheck | None:
    """Each computed metric (``values``, by name) against ``thresholds.basis`` (None without one); each
    metric with a standard error also gets its z-score against the calibrated mean."""
    basis = thresholds.basis
    if basis is None:
        return None
    noise = basis.noise
    out: dict[str, MetricNoise] = {}
    for name in metric_names():
        v = values.get(name)
        value, n = None if v is None else v.value, noise.metrics.get(name)
        if value is None or n is None:
            continue
        ref = max(n, basis.floors[name])
        ratio = math.inf if math.isnan(value) else value / ref if ref > 0 else (0.0 if value == 0 else math.inf)
        out[name] = MetricNoise(n, basis.floors[name], ratio, name in basis.from_noise)
    tests: dict[str, MeanTest] = {}
    for name in tested_means():
        v, ref_mean = values.get(name), noise.means.get(name)
        if v is None or v.value is None or v.se is None or ref_mean is None:
            continue
        z = _z(v.value, v.se, ref_mean)
        tests[name] = MeanTest(v.value, v.se, ref_mean.mean, ref_mean.se, z, not z <= Z_SIGNIFICANT)
    return NoiseCheck(noise.source, basis.factor, noise.variants, noise.positions, out, tests, basis.warnings)
