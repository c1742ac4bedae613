"""The logprob metrics a verdict checks: one spec per metric, registered in one table.

A :class:`LogprobMetric` says everything driftscope needs to know about a checked logprob metric:
its name (the verdict's JSON key, the ``thresholds`` key, ``--logprob-threshold NAME=VALUE``,
``DRIFTSCOPE_LOGPROB_<NAME>``, a column of ``configs/logprob_thresholds.json``, a key of NOISE.json's
``logprobs``), its label in the reports, whether it is mean- or max-type, the floor of a threshold
derived from noise, and how its value is computed. Everything that lists logprob metrics reads
:func:`logprob_metrics`, in registration (report) order; registering a metric is one call::

    from comparator.judging.logprob_metrics import LogprobMetric, MetricValue, register_logprob_metric
    register_logprob_metric(LogprobMetric(
        "p99_abs_err", "p99 |Δlogprob|", kind="max", floor=1e-4,
        compute=lambda c: MetricValue(
            float(np.quantile(np.abs(np.concatenate([s.ref - s.tgt for s in c.samples])), 0.99)))))

``compute`` receives the :class:`MetricInputs` :func:`comparator.logprobs.verdict.compare_logprobs`
computes once per verdict and returns a :class:`MetricValue`: the value (None: not computed, e.g.
KL without logits), its standard error for a mean-type metric (mean ± SE, tested for significance
against calibrated noise) and, for a located max-type metric, where the maximum sits (its JSON
value is then ``{"value", "sample", "position"}`` like ``max_abs_err``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from comparator.judging.values import parse_threshold
from dumper.errors import UsageError

__all__ = [
    "MEAN",
    "MAX",
    "Presence",
    "MetricValue",
    "MetricInputs",
    "LogprobMetric",
    "register_logprob_metric",
    "unregister_logprob_metric",
    "logprob_metrics",
    "logprob_metric",
    "metric_names",
    "tested_means",
    "default_floors",
    "check_metric_name",
]

MEAN: Final = "mean"
"""A mean over positions: is the whole run shifted? With a standard error it is z-tested against noise."""
MAX: Final = "max"
"""A largest value: did one position break?"""
Presence = Literal["always", "with_kl", "optional"]
"""When a verdict holds the value, which decides how its JSON ``null`` reads back: ``always`` computed
(null is a non-finite value, read as inf), ``with_kl`` computed with full distributions (the
verdict's ``kl_percentiles`` present), ``optional`` (null: not computed)."""


@dataclass(frozen=True)
class MetricValue:
    """One metric of one verdict: its value (None: not computed), standard error (mean-type metrics
    with one) and, for a located max-type metric, the request and position of the maximum."""

    value: float | None = None
    se: float | None = None
    request: str | None = None
    position: int | None = None


class MetricInputs(Protocol):
    """What a metric's ``compute`` may read, computed once per verdict by :mod:`comparator.logprobs.verdict`
    (:class:`comparator.logprobs.verdict.VerdictInputs`); typed loosely so that judging imports no logprobs."""

    @property
    def samples(self) -> Sequence[Any]:
        """The aligned samples (``request``, ``positions``, ``ref``, ``tgt``, ``delta``, ``ref_top``, ``tgt_top``)."""

    @property
    def errors(self) -> Any:
        """Actual-token errors: ``mse``, ``rmse``, ``mean_abs_err``, ``mean_abs_err_se``, ``max_abs_err`` (located)."""

    @property
    def k3(self) -> Any:
        """k3: ``mean``, ``se``, ``max`` (located)."""

    @property
    def topk(self) -> Any:
        """Top-k errors (``max_err``, ``mean_err``), None without common top-k tokens."""

    @property
    def kl_percentiles(self) -> dict[str, float] | None:
        """Full-distribution KL percentiles (``mean``, ``max``, ...), None without distributions."""

    @property
    def kl_max(self) -> Any:
        """The largest KL, located (value None without distributions)."""

    @property
    def llama(self) -> Any:
        """llama-perplexity's statistics (``kl_mean_se``, ...)."""


Compute = Callable[[Any], "MetricValue | float | None"]
"""A metric's computation: :class:`MetricInputs` in, a :class:`MetricValue` out (a plain float, or None for
"not computed", will do for a metric that is neither located nor has a standard error)."""


@dataclass(frozen=True)
class LogprobMetric:
    """One checked logprob metric (see the module doc).

    Attributes:
        name: lower-case identifier: JSON key, threshold name, ``DRIFTSCOPE_LOGPROB_<NAME>``.
        label: how the reports name it (``max |Δlogprob|``).
        kind: :data:`MEAN` or :data:`MAX`.
        floor: the absolute floor of a threshold derived from noise (``--noise-floor NAME=VALUE`` overrides it).
        compute: :class:`MetricInputs` -> :class:`MetricValue` (:data:`Compute`).
        located: a max-type value with where it sits; its JSON value is ``{"value", "sample", "position"}``.
        se_key: the flat JSON key of its standard error (mean-type only); a metric with one is calibrated as
            mean ± SE and z-tested against the noise.
        presence: when it is computed (:data:`Presence`).
    """

    name: str
    label: str
    kind: str
    floor: float
    compute: Compute
    located: bool = False
    se_key: str | None = None
    presence: Presence = "always"

    def __post_init__(self) -> None:
        check_metric_name(self.name)
        if self.kind not in (MEAN, MAX):
            raise UsageError(f"logprob metric {self.name}: kind must be {MEAN!r} or {MAX!r}, got {self.kind!r}")
        if self.se_key is not None and self.kind != MEAN:
            raise UsageError(f"logprob metric {self.name}: only a mean-type metric has a standard error")
        if self.presence not in ("always", "with_kl", "optional"):
            raise UsageError(
                f"logprob metric {self.name}: presence {self.presence!r} is not one of always, with_kl, optional"
            )
        parse_threshold(self.floor, where=f"logprob metric {self.name}: floor")


def check_metric_name(name: str) -> str:
    """``name`` if it can name a metric: a lower-case identifier (it becomes an env var and a JSON key)."""
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower() and not name.startswith("_")):
        raise UsageError(f"logprob metric name {name!r}: expected a lower-case identifier (e.g. p99_abs_err)")
    return name


_REGISTRY: dict[str, LogprobMetric] = {}


def register_logprob_metric(spec: LogprobMetric) -> LogprobMetric:
    """Add ``spec`` to the table (after the metrics registered before it); a name may be registered once."""
    if spec.name in _REGISTRY:
        raise UsageError(f"logprob metric {spec.name!r} is already registered")
    reserved = {m.se_key for m in _REGISTRY.values()} | {m.name for m in _REGISTRY.values()}
    if spec.se_key is not None and spec.se_key in reserved | {spec.name}:
        raise UsageError(f"logprob metric {spec.name}: se_key {spec.se_key!r} is taken")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_logprob_metric(name: str) -> None:
    """Remove a metric registered with :func:`register_logprob_metric` (tests, plug-ins unloading)."""
    _REGISTRY.pop(name, None)


def logprob_metrics() -> tuple[LogprobMetric, ...]:
    """Every registered metric, in report order."""
    return tuple(_REGISTRY.values())


def metric_names() -> tuple[str, ...]:
    """The names of every registered metric, in report order (the known threshold names)."""
    return tuple(_REGISTRY)


def logprob_metric(name: str) -> LogprobMetric | None:
    """The metric ``name``, None when no such metric is registered."""
    return _REGISTRY.get(name)


def tested_means() -> tuple[str, ...]:
    """Mean-type metrics with a standard error: calibrated as mean ± SE and tested for significance."""
    return tuple(m.name for m in _REGISTRY.values() if m.se_key is not None)


def default_floors() -> dict[str, float]:
    """Each metric's floor of a threshold derived from noise, by name."""
    return {m.name: m.floor for m in _REGISTRY.values()}


def _at(located: Any) -> MetricValue:
    """A located value (``value``, ``request``, ``position``) as a :class:`MetricValue`."""
    return MetricValue(located.value, None, located.request, located.position)


def _kl_mean(c: MetricInputs) -> MetricValue:
    if c.kl_percentiles is None:
        return MetricValue()
    return MetricValue(c.kl_percentiles["mean"], c.llama.kl_mean_se if c.llama is not None else None)


def _builtin() -> None:
    """The built-in metrics (floors: float32 rounding of one computation, measured on the presets with
    peaked weights (std 0.2: max |Δlogprob| 1.4e-5, mse 1e-11, k3 and KL means 5e-12, KL max 5e-11 for
    eager vs SDPA) and on the engines (max |Δlogprob| up to 2.8e-5), with a margin of 3 to 100, so that a
    calibration from bit-identical re-runs (noise 0) still passes a float32 target that rounds
    differently; docs/logprobs.md, "Thresholds from a calibration")."""
    for spec in (
        LogprobMetric("mse", "mse", MEAN, 1e-9, lambda c: MetricValue(c.errors.mse)),
        LogprobMetric(
            "mean_abs_err",
            "mean |Δlogprob|",
            MEAN,
            1e-5,
            lambda c: MetricValue(c.errors.mean_abs_err, c.errors.mean_abs_err_se),
            se_key="mean_abs_err_se",
        ),
        LogprobMetric("max_abs_err", "max |Δlogprob|", MAX, 1e-4, lambda c: _at(c.errors.max_abs_err), located=True),
        LogprobMetric(
            "k3_mean", "k3 mean", MEAN, 5e-10, lambda c: MetricValue(c.k3.mean, c.k3.se), se_key="k3_mean_se"
        ),
        LogprobMetric("kl_mean", "KL mean", MEAN, 5e-10, _kl_mean, se_key="kl_mean_se", presence="with_kl"),
        LogprobMetric("kl_max", "KL max", MAX, 5e-9, lambda c: _at(c.kl_max), located=True, presence="with_kl"),
        LogprobMetric(
            "topk_max_err",
            "top-k max |Δ| (per-sample max)",
            MAX,
            1e-4,
            lambda c: MetricValue(None if c.topk is None else c.topk.max_err),
            presence="optional",
        ),
    ):
        register_logprob_metric(spec)


_builtin()
