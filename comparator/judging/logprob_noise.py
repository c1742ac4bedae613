"""Logprob noise as values: what benign re-runs showed, what thresholds derived from it rest on, and a
verdict's metrics against it.

:class:`LogprobNoise` is the ``logprobs`` object of a noise file (per checked metric the largest value
any benign variant showed, and for the metrics with a standard error
(:func:`~comparator.judging.logprob_metrics.tested_means`) mean ± SE of the noisiest variant);
:class:`NoiseBasis` what :func:`comparator.judging.noise_thresholds.resolve_logprob_thresholds` derived
thresholds from; :class:`NoiseCheck` the ``noise`` object of a logprob verdict
(:func:`comparator.judging.noise_thresholds.noise_check`): each metric as a multiple of its noise
(:class:`MetricNoise`) and each mean's z-score against the calibrated one (:class:`MeanTest`). A
mean-type threshold derived from noise fails only when it is exceeded **and** ``z >`` :data:`Z_SIGNIFICANT`.
Calibration from verdicts is :func:`comparator.noise.logprob_calibration.logprob_noise`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from comparator.judging.fields import integer, items, number, record
from comparator.judging.logprob_metrics import metric_names, tested_means
from dumper.errors import UsageError
from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["Z_SIGNIFICANT", "MeanNoise", "LogprobNoise", "NoiseBasis", "MetricNoise", "MeanTest", "NoiseCheck"]

Z_SIGNIFICANT: Final = 3.0
"""A mean is significantly above the calibrated noise when its z-score exceeds this."""


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
        """Exact types (:mod:`comparator.judging.fields`): finite numbers >= 0 and an integer."""
        d = record(d, where, field, ("mean", "se", "positions"))
        return cls(
            number(d["mean"], where, f"{field}.mean"),
            number(d["se"], where, f"{field}.se"),
            integer(d["positions"], where, f"{field}.positions"),
        )


@dataclass(frozen=True)
class LogprobNoise:
    """Per logprob metric, the largest value any benign variant showed (None: not computed)."""

    variants: int
    positions: int
    """Compared positions per variant (the smallest over variants)."""
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    means: Mapping[str, MeanNoise] = field(default_factory=dict)
    """For the metrics with a standard error: mean ± SE of the variant with the largest mean."""
    by_variant: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)
    """Each variant's value per metric, in variant order."""
    source: str | None = field(default=None, compare=False)
    """The noise file it was read from (not stored)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "variants": self.variants,
            "positions": self.positions,
            "metrics": {k: to_json_float(v) for k, v in self.metrics.items()},
            "means": {k: m.to_json() for k, m in self.means.items()},
            "by_variant": {k: [to_json_float(x) for x in v] for k, v in self.by_variant.items()},
        }

    @classmethod
    def from_json(cls, d: Any, where: str, *, variants: int | None = None) -> LogprobNoise:
        """The ``logprobs`` object of a noise file, exact types (:mod:`comparator.judging.fields`): metric
        names registered, values finite numbers >= 0 or null; ``variants``: the count it must record."""
        d = record(d, where, "logprobs", ("variants", "positions", "metrics", "means", "by_variant"))
        count = integer(d["variants"], where, "logprobs.variants", low=1)
        if variants is not None and count != variants:
            raise UsageError(f"{where}: logprobs.variants: {count}, but the file lists {variants} variants")
        names = metric_names()
        metrics = {
            k: number(v, where, f"logprobs.metrics.{k}", null=True)
            for k, v in record(d["metrics"], where, "logprobs.metrics", (), names).items()
        }
        means = {
            k: MeanNoise.from_json(v, where, f"logprobs.means.{k}")
            for k, v in record(d["means"], where, "logprobs.means", (), tested_means()).items()
        }
        by_variant = {
            k: tuple(
                number(x, where, f"logprobs.by_variant.{k}[{j}]", null=True)
                for j, x in enumerate(items(v, where, f"logprobs.by_variant.{k}", length=count))
            )
            for k, v in record(d["by_variant"], where, "logprobs.by_variant", (), names).items()
        }
        return cls(
            variants=count,
            positions=integer(d["positions"], where, "logprobs.positions", low=1),
            metrics=metrics,
            means=means,
            by_variant=by_variant,
            source=where,
        )


@dataclass(frozen=True)
class NoiseBasis:
    """What noise-derived thresholds rest on: the noise, factor and floors, and which metrics took them."""

    noise: LogprobNoise
    factor: float
    floors: Mapping[str, float]
    from_noise: frozenset[str]
    """Metrics whose threshold is the noise-derived one (not an explicit smaller one, not a fixed fallback)."""
    warnings: tuple[str, ...] = ()
    """Noise-derived thresholds over :data:`comparator.judging.fields.EXCESSIVE` x the fixed ones."""


@dataclass(frozen=True)
class MetricNoise:
    """One checked metric against its calibrated noise: ``ratio = value / max(noise, floor)``."""

    noise: float
    floor: float
    ratio: float | None
    from_noise: bool
    """The threshold is the noise-derived one (else an explicit, stricter one)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "noise": to_json_float(self.noise),
            "floor": self.floor,
            "ratio": to_json_float(self.ratio),
            "from_noise": self.from_noise,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MetricNoise:
        """Inverse of :meth:`to_json`; a null noise or ratio is infinite (:func:`noise_check` always sets the ratio)."""
        return cls(from_json_float(d["noise"]), float(d["floor"]), from_json_float(d["ratio"]), bool(d["from_noise"]))


_MEAN_TEST_FLOATS: Final = ("mean", "se", "noise_mean", "noise_se", "z")


@dataclass(frozen=True)
class MeanTest:
    """Is a mean-type metric significantly above the calibrated one? ``z = (mean - noise_mean) /
    sqrt(se² + noise_se²)``, significant above :data:`Z_SIGNIFICANT`."""

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
        return {
            "source": self.source,
            "factor": self.factor,
            "variants": self.variants,
            "positions": self.positions,
            "z_significant": Z_SIGNIFICANT,
            "metrics": {k: m.to_json() for k, m in self.metrics.items()},
            "means": {k: t.to_json() for k, t in self.means.items()},
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NoiseCheck:
        metrics = {k: MetricNoise.from_json(m) for k, m in d["metrics"].items()}
        means = {k: MeanTest.from_json(t) for k, t in d["means"].items()}
        return cls(
            d.get("source"),
            float(d["factor"]),
            int(d["variants"]),
            int(d["positions"]),
            metrics,
            means,
            tuple(d.get("warnings", ())),
        )
