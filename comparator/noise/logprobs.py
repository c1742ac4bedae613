"""Logprob noise: the logprob metrics benign re-runs show, and logprob thresholds derived from them.

Calibration (:func:`logprob_noise`) keeps, per checked metric, the largest value any benign
variant showed, and for the mean-type metrics (:data:`MEAN_METRICS`) the mean and standard
error of the noisiest variant. Judging a target (:func:`resolve_logprob_thresholds`), each
calibrated metric's threshold is

    max(floor[name], factor * noise[name])

(``factor``: ``--noise-factor``, default :data:`comparator.noise.model.DEFAULT_FACTOR`; ``floor``:
:data:`DEFAULT_LOGPROB_FLOORS`, ``--noise-floor NAME=VALUE``); explicit thresholds (flag or
``DRIFTSCOPE_LOGPROB_*``) apply on top, the smaller one wins. A metric the calibration did not
compute (KL without logits) keeps its fixed threshold. Every checked value is also reported as
a multiple of its noise, ``value / max(noise, floor)``, and each mean-type metric gets a z-score
against the calibrated one, ``z = (mean - noise_mean) / sqrt(se² + noise_se²)``: a mean-type
threshold derived from noise fails only when it is exceeded **and** ``z > Z_SIGNIFICANT``, so a
mean that chance alone could lift over it (few positions, one outlier) is left to the max-type
checks, which judge single positions. A derived threshold over
:data:`comparator.noise.fields.EXCESSIVE` x the fixed one it replaces is a warning of the verdict
(``NoiseCheck.warnings``): that noise lets pass what the fixed thresholds fail.

Example::

    from comparator.noise.logprobs import logprob_noise, resolve_logprob_thresholds
    noise = logprob_noise([verdict_of_rerun_1, verdict_of_rerun_2])
    thresholds = resolve_logprob_thresholds("tiny-llama", noise=noise, factor=3.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from dumper.errors import UsageError
from dumper.format import Manifest
from dumper.format.dtypes import MANTISSA_BITS

from comparator.jsonfloat import from_json_float, to_json_float
from comparator.logprobs.thresholds import THRESHOLD_NAMES, LogprobThresholds, explicit_thresholds
from comparator.logprobs.verdict import LogprobVerdict
from comparator.noise.fields import EXCESSIVE, integer, items, number, record
from comparator.thresholds import parse_threshold

__all__ = [
    "DEFAULT_LOGPROB_FLOORS",
    "MEAN_METRICS",
    "Z_SIGNIFICANT",
    "LogprobNoise",
    "MeanNoise",
    "MeanTest",
    "MetricNoise",
    "NoiseBasis",
    "NoiseCheck",
    "logprob_noise",
    "noise_check",
    "resolve_logprob_thresholds",
    "threshold_dtype",
]

MEAN_METRICS: Final = ("mean_abs_err", "k3_mean", "kl_mean")
"""Mean-type metrics with a standard error: calibrated as mean ± SE and tested for significance."""
Z_SIGNIFICANT: Final = 3.0
"""A mean is significantly above the calibrated noise when its z-score exceeds this."""
DEFAULT_LOGPROB_FLOORS: Final[Mapping[str, float]] = {
    "max_abs_err": 1e-4, "topk_max_err": 1e-4, "mean_abs_err": 1e-5,
    "mse": 1e-9, "k3_mean": 5e-10, "kl_mean": 5e-10, "kl_max": 5e-9,
}
"""Absolute floors of noise-derived thresholds: float32 rounding of one computation, measured on
the presets with peaked weights (std 0.2: max |Δlogprob| 1.4e-5, mse 1e-11, k3 and KL means
5e-12, KL max 5e-11 for eager vs SDPA) and on the engines (max |Δlogprob| up to 2.8e-5), with a
margin of 3 to 100, so that a calibration from bit-identical re-runs (noise 0) still passes a
float32 target that rounds differently. README, "Logprobs against noise"."""


@dataclass(frozen=True)
class MeanNoise:
    """A mean-type metric of the noisiest variant: its mean, standard error and position count."""

    mean: float
    se: float
    positions: int

    def to_json(self) -> dict[str, Any]:
        return {"mean": to_json_float(self.mean), "se": to_json_float(self.se), "positions": self.positions}

    @classmethod
    def from_json(cls, d: Any, where: str = "noise file", field: str = "mean") -> MeanNoise:
        """Exact types (:mod:`comparator.noise.fields`): finite numbers >= 0 and an integer."""
        d = record(d, where, field, ("mean", "se", "positions"))
        return cls(number(d["mean"], where, f"{field}.mean"), number(d["se"], where, f"{field}.se"),
                   integer(d["positions"], where, f"{field}.positions"))


@dataclass(frozen=True)
class LogprobNoise:
    """Per logprob metric, the largest value any benign variant showed (None: not computed)."""

    variants: int
    positions: int
    """Compared positions per variant (the smallest over variants)."""
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    means: Mapping[str, MeanNoise] = field(default_factory=dict)
    """For :data:`MEAN_METRICS`: mean ± SE of the variant with the largest mean."""
    by_variant: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)
    """Each variant's value per metric, in variant order."""
    source: str | None = field(default=None, compare=False)
    """The noise file it was read from (not stored)."""

    def to_json(self) -> dict[str, Any]:
        return {"variants": self.variants, "positions": self.positions,
                "metrics": {k: to_json_float(v) for k, v in self.metrics.items()},
                "means": {k: m.to_json() for k, m in self.means.items()},
                "by_variant": {k: [to_json_float(x) for x in v] for k, v in self.by_variant.items()}}

    @classmethod
    def from_json(cls, d: Any, where: str, *, variants: int | None = None) -> LogprobNoise:
        """The ``logprobs`` object of a noise file, exact types (:mod:`comparator.noise.fields`): metric
        names known, values finite numbers >= 0 or null; ``variants``: the count it must record."""
        d = record(d, where, "logprobs", ("variants", "positions", "metrics", "means", "by_variant"))
        count = integer(d["variants"], where, "logprobs.variants", low=1)
        if variants is not None and count != variants:
            raise UsageError(f"{where}: logprobs.variants: {count}, but the file lists {variants} variants")
        metrics = {k: number(v, where, f"logprobs.metrics.{k}", null=True)
                   for k, v in record(d["metrics"], where, "logprobs.metrics", (), THRESHOLD_NAMES).items()}
        means = {k: MeanNoise.from_json(v, where, f"logprobs.means.{k}")
                 for k, v in record(d["means"], where, "logprobs.means", (), MEAN_METRICS).items()}
        by_variant = {k: tuple(number(x, where, f"logprobs.by_variant.{k}[{j}]", null=True)
                               for j, x in enumerate(items(v, where, f"logprobs.by_variant.{k}", length=count)))
                      for k, v in record(d["by_variant"], where, "logprobs.by_variant", (), THRESHOLD_NAMES).items()}
        return cls(variants=count, positions=integer(d["positions"], where, "logprobs.positions", low=1),
                   metrics=metrics, means=means, by_variant=by_variant, source=where)


def _mean_se(v: LogprobVerdict, name: str) -> tuple[float | None, float | None]:
    if name == "kl_mean":
        return v.kl_mean, None if v.llama is None else v.llama.kl_mean_se
    if name == "k3_mean":
        return v.k3_mean, v.k3_mean_se
    return v.mean_abs_err, v.mean_abs_err_se


def logprob_noise(verdicts: Sequence[LogprobVerdict]) -> LogprobNoise:
    """The noise of benign variants' logprob verdicts (each against the baseline).

    A metric is calibrated only when every variant computed it; a non-finite value (NaN on one
    side) is refused, since such a variant is not benign.
    """
    if not verdicts:
        raise UsageError("no logprob verdicts to calibrate from")
    metrics: dict[str, float | None] = {}
    by_variant: dict[str, tuple[float | None, ...]] = {}
    for name in THRESHOLD_NAMES:
        values = tuple(v.metrics()[name] for v in verdicts)
        for i, x in enumerate(values):
            if x is not None and not math.isfinite(x):
                raise UsageError(f"variant {i + 1}: logprob {name} is not finite (a NaN or Inf differs from the "
                                 "baseline): not a benign variant")
        by_variant[name] = values
        metrics[name] = None if any(x is None for x in values) else max(values)  # type: ignore[type-var]
    means: dict[str, MeanNoise] = {}
    for name in MEAN_METRICS:
        pairs = [(*_mean_se(v, name), v.compared_positions) for v in verdicts]
        if all(m is not None and s is not None for m, s, _ in pairs):
            m, s, n = max(pairs, key=lambda p: p[0])  # type: ignore[arg-type, return-value]
            means[name] = MeanNoise(float(m), float(s), int(n))  # type: ignore[arg-type]
    return LogprobNoise(variants=len(verdicts), positions=min(v.compared_positions for v in verdicts),
                        metrics=metrics, means=means, by_variant=by_variant)


@dataclass(frozen=True)
class NoiseBasis:
    """What noise-derived thresholds rest on: the noise, factor and floors, and which metrics took them."""

    noise: LogprobNoise
    factor: float
    floors: Mapping[str, float]
    from_noise: frozenset[str]
    """Metrics whose threshold is the noise-derived one (not an explicit smaller one, not a fixed fallback)."""
    warnings: tuple[str, ...] = ()
    """Noise-derived thresholds over :data:`comparator.noise.fields.EXCESSIVE` x the fixed ones (:func:`_excessive`)."""


def _floors(floors: Mapping[str, float] | None) -> dict[str, float]:
    out = dict(DEFAULT_LOGPROB_FLOORS)
    for k, v in (floors or {}).items():
        if k not in THRESHOLD_NAMES:
            raise UsageError(f"--noise-floor {k}={v:g}: {k!r} is not a logprob metric; known: {', '.join(THRESHOLD_NAMES)}")
        floor = parse_threshold(v, where=f"--noise-floor {k}")
        assert floor is not None  # parse_threshold gives None only with allow_off
        out[k] = floor
    return out


def resolve_logprob_thresholds(model: str | None, *, explicit: Mapping[str, float | None] | None = None,
                               noise: LogprobNoise | None = None, factor: float | None = None,
                               floors: Mapping[str, float] | None = None, dtype: str | None = None,
                               env: Mapping[str, str] | None = None) -> LogprobThresholds:
    """The logprob thresholds of one comparison, for ``comparator logprobs`` and ``comparator A B`` alike.

    Without ``noise``: :meth:`LogprobThresholds.resolve` (explicit > env > table rows of
    ``model`` and ``dtype``, see :func:`threshold_dtype`). With ``noise``: each calibrated metric's
    threshold is ``max(floors[name], factor * noise[name])`` (``factor`` default
    :data:`comparator.noise.model.DEFAULT_FACTOR`, ``floors`` over :data:`DEFAULT_LOGPROB_FLOORS`), and
    an explicit or env threshold applies on top (the smaller wins; ``None`` turns a check off).
    """
    fixed = LogprobThresholds.resolve(model, explicit=explicit, env=env, dtype=dtype)
    if noise is None:
        return fixed
    from comparator.noise.model import DEFAULT_FACTOR, check_noise_factor  # here: comparator.noise.model imports this module

    factor = DEFAULT_FACTOR if factor is None else check_noise_factor(factor)
    lim = _floors(floors)
    chosen = explicit_thresholds(explicit, env)
    values: dict[str, float | None] = {}
    derived: set[str] = set()
    for name in THRESHOLD_NAMES:
        n = noise.metrics.get(name)
        values[name] = getattr(fixed, name)
        if n is None:
            continue  # not calibrated: the fixed threshold
        own = max(lim[name], factor * n)
        if name in chosen and (chosen[name] is None or chosen[name] < own):  # type: ignore[operator]
            continue  # an explicit threshold, stricter (or off)
        values[name] = own
        derived.add(name)
    source = f"noise {noise.source or '(calibration)'} x{factor:g}"
    uncalibrated = [n for n in THRESHOLD_NAMES if noise.metrics.get(n) is None]
    stricter = [n for n in THRESHOLD_NAMES if n not in derived and n not in uncalibrated]
    source += f"; set: {', '.join(stricter)}" if stricter else ""
    source += f"; not calibrated, by {fixed.source}: {', '.join(uncalibrated)}" if uncalibrated else ""
    basis = NoiseBasis(noise, float(factor), lim, frozenset(derived), _excessive(noise, fixed, values, derived))
    return LogprobThresholds(**values, basis=basis, source=source)


def _excessive(noise: LogprobNoise, fixed: LogprobThresholds, values: Mapping[str, float | None],
               derived: set[str]) -> tuple[str, ...]:
    """The warning for noise-derived thresholds over EXCESSIVE x the fixed ones they replace (none: ``()``)."""
    over = [f"{n} <= {values[n]:.3g} (fixed {getattr(fixed, n):g})" for n in THRESHOLD_NAMES
            if n in derived and getattr(fixed, n) is not None and values[n] > EXCESSIVE * getattr(fixed, n)]
    if not over:
        return ()
    return (f"{noise.source or 'the logprob noise'}: noise-derived logprob thresholds over {EXCESSIVE:g}x the fixed "
            f"ones they replace ({fixed.source or 'fixed thresholds'}): {', '.join(over)}; differences the fixed "
            "thresholds fail pass; recalibrate from benign re-runs",)


def threshold_dtype(*sides: Manifest | str | None) -> str | None:
    """The dtype whose threshold rows judge a comparison: the coarsest of the sides' dtypes (a
    dump's manifest says it; float32 baseline vs bfloat16 target: ``bfloat16``); None when no side says."""
    dtypes = [s.capture_signature.get("dtype") if isinstance(s, Manifest) else s for s in sides]
    known = [d for d in dtypes if isinstance(d, str) and d]
    if not known:
        return None
    return min(known, key=lambda d: MANTISSA_BITS.get(d, 0))


@dataclass(frozen=True)
class MetricNoise:
    """One checked metric against its calibrated noise: ``ratio = value / max(noise, floor)``."""

    noise: float
    floor: float
    ratio: float | None
    from_noise: bool
    """The threshold is the noise-derived one (else an explicit, stricter one)."""

    def to_json(self) -> dict[str, Any]:
        return {"noise": to_json_float(self.noise), "floor": self.floor, "ratio": to_json_float(self.ratio),
                "from_noise": self.from_noise}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MetricNoise:
        """Inverse of :meth:`to_json`; a null noise or ratio is infinite (:func:`noise_check` always sets the ratio)."""
        return cls(from_json_float(d["noise"]), float(d["floor"]), from_json_float(d["ratio"]), bool(d["from_noise"]))


_MEAN_TEST_FLOATS: Final = ("mean", "se", "noise_mean", "noise_se", "z")


@dataclass(frozen=True)
class MeanTest:
    """Is a mean-type metric significantly above the calibrated one? ``z`` as in the module doc."""

    mean: float
    se: float
    noise_mean: float
    noise_se: float
    z: float
    significant: bool

    def to_json(self) -> dict[str, Any]:
        return {k: to_json_float(getattr(self, k)) for k in _MEAN_TEST_FLOATS} | {"significant": self.significant}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MeanTest:
        """Inverse of :meth:`to_json`; a null value is infinite (a non-finite mean is infinitely far above)."""
        return cls(*(from_json_float(d[k]) for k in _MEAN_TEST_FLOATS), significant=bool(d["significant"]))


@dataclass(frozen=True)
class NoiseCheck:
    """A verdict's metrics against the calibrated noise (the ``noise`` object of the logprob JSON)."""

    source: str | None
    factor: float
    variants: int
    positions: int
    metrics: Mapping[str, MetricNoise]
    means: Mapping[str, MeanTest]
    warnings: tuple[str, ...] = ()
    """What the verdict warns about: noise that excuses what the fixed thresholds fail, a calibration across models."""

    def excused(self, name: str) -> bool:
        """A noise-derived mean-type threshold is exceeded, but not significantly: it does not fail."""
        entry, test = self.metrics.get(name), self.means.get(name)
        return entry is not None and entry.from_noise and test is not None and not test.significant

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "factor": self.factor, "variants": self.variants, "positions": self.positions,
                "z_significant": Z_SIGNIFICANT, "metrics": {k: m.to_json() for k, m in self.metrics.items()},
                "means": {k: t.to_json() for k, t in self.means.items()}, "warnings": list(self.warnings)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NoiseCheck:
        metrics = {k: MetricNoise.from_json(m) for k, m in d["metrics"].items()}
        means = {k: MeanTest.from_json(t) for k, t in d["means"].items()}
        return cls(d.get("source"), float(d["factor"]), int(d["variants"]), int(d["positions"]), metrics, means,
                   tuple(d.get("warnings", ())))


def _z(mean: float, se: float, noise: MeanNoise) -> float:
    """``(mean - noise.mean) / sqrt(se² + noise.se²)``; a non-finite mean is infinitely far above."""
    if not math.isfinite(mean) or not math.isfinite(se):
        return math.inf
    diff, scale = mean - noise.mean, math.sqrt(se * se + noise.se * noise.se)
    if scale > 0:
        return diff / scale
    return math.inf if diff > 0 else -math.inf if diff < 0 else 0.0


def noise_check(thresholds: LogprobThresholds, metrics: Mapping[str, float | None],
                means: Mapping[str, tuple[float | None, float | None]]) -> NoiseCheck | None:
    """Each computed metric against ``thresholds.basis`` (None without one); ``means`` maps each
    :data:`MEAN_METRICS` name to the target's ``(mean, se)``."""
    basis = thresholds.basis
    if basis is None:
        return None
    noise = basis.noise
    out: dict[str, MetricNoise] = {}
    for name in THRESHOLD_NAMES:
        value, n = metrics.get(name), noise.metrics.get(name)
        if value is None or n is None:
            continue
        ref = max(n, basis.floors[name])
        ratio = math.inf if math.isnan(value) else value / ref if ref > 0 else (0.0 if value == 0 else math.inf)
        out[name] = MetricNoise(n, basis.floors[name], ratio, name in basis.from_noise)
    tests: dict[str, MeanTest] = {}
    for name in MEAN_METRICS:
        mean, se = means.get(name, (None, None))
        ref_mean = noise.means.get(name)
        if mean is None or se is None or ref_mean is None:
            continue
        z = _z(mean, se, ref_mean)
        tests[name] = MeanTest(mean, se, ref_mean.mean, ref_mean.se, z, not z <= Z_SIGNIFICANT)
    return NoiseCheck(noise.source, basis.factor, noise.variants, noise.positions, out, tests, basis.warnings)
