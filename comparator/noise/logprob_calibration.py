"""Logprob noise from benign verdicts: what calibration keeps of each variant's logprob verdict.

Per checked metric (the metric table, :mod:`comparator.judging.logprob_metrics`) the largest value
any benign variant showed, and for the metrics with a standard error the mean ± SE of the noisiest
variant (:class:`~comparator.judging.logprob_noise.LogprobNoise`). Thresholds derived from it:
:func:`comparator.judging.noise_thresholds.resolve_logprob_thresholds`.

Example::

    from comparator.noise.logprob_calibration import logprob_noise
    noise = logprob_noise([verdict_of_rerun_1, verdict_of_rerun_2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from comparator.judging.logprob_metrics import metric_names, tested_means
from comparator.judging.logprob_noise import LogprobNoise, MeanNoise
from comparator.logprobs.types import LogprobVerdict
from dumper.errors import UsageError

__all__ = ["logprob_noise"]


def logprob_noise(verdicts: Sequence[LogprobVerdict]) -> LogprobNoise:
    """The noise of benign variants' logprob verdicts (each against the baseline).

    A metric is calibrated only when every variant computed it; a non-finite value (NaN on one
    side) is refused, since such a variant is not benign.
    """
    if not verdicts:
        raise UsageError("no logprob verdicts to calibrate from")
    metrics: dict[str, float | None] = {}
    by_variant: dict[str, tuple[float | None, ...]] = {}
    for name in metric_names():
        values = tuple(v.value_of(name).value for v in verdicts)
        for i, x in enumerate(values):
            if x is not None and not math.isfinite(x):
                raise UsageError(
                    f"variant {i + 1}: logprob {name} is not finite (a NaN or Inf differs from the "
                    "baseline): not a benign variant"
                )
        by_variant[name] = values
        metrics[name] = None if any(x is None for x in values) else max(values)  # type: ignore[type-var]
    means: dict[str, MeanNoise] = {}
    for name in tested_means():
        pairs = [(v.value_of(name).value, v.value_of(name).se, v.compared_positions) for v in verdicts]
        if all(m is not None and s is not None for m, s, _ in pairs):
            m, s, n = max(pairs, key=lambda p: p[0])  # type: ignore[arg-type, return-value]
            means[name] = MeanNoise(float(m), float(s), int(n))  # type: ignore[arg-type]
    return LogprobNoise(
        variants=len(verdicts),
        positions=min(v.compared_positions for v in verdicts),
        metrics=metrics,
        means=means,
        by_variant=by_variant,
    )
