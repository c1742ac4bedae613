"""The comparator's environment variables: each ``DRIFTSCOPE_*`` variable it reads is read here.

| variable                            | meaning                                                    |
|-------------------------------------|------------------------------------------------------------|
| ``DRIFTSCOPE_DIFF_THRESHOLD``       | rel_diff threshold of a whole tensor (``--threshold``)     |
| ``DRIFTSCOPE_TOKEN_THRESHOLD``      | per-token rel_diff threshold (``--token-threshold``)       |
| ``DRIFTSCOPE_ACCEPTANCE_TOLERANCE`` | largest relative drop of a speculative target's acceptance |
|                                     | length (``--acceptance-tolerance``)                        |
| ``DRIFTSCOPE_LOGPROB_<NAME>``       | logprob threshold ``<name>``, any metric of the table      |
|                                     | (:mod:`comparator.judging.logprob_metrics`: MSE, K3_MEAN,  |
|                                     | ...); ``off`` disables it (``--logprob-threshold``)        |

Flags win over these, and these over the built-in defaults (:class:`comparator.CompareConfig`).
The variables the dumper reads too (``DRIFTSCOPE_DEBUG``, ``DRIFTSCOPE_JSON_MEMORY_MIB``,
``DRIFTSCOPE_DUMP_DIR``) live in :mod:`dumper.settings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from comparator.judging.values import parse_threshold

__all__ = ["ComparatorSettings", "comparator_settings"]

_LOGPROB = "DRIFTSCOPE_LOGPROB_"


@dataclass(frozen=True)
class ComparatorSettings:
    """The comparator's environment, parsed."""

    diff_threshold: float | None = None
    token_threshold: float | None = None
    acceptance_tolerance: float | None = None
    logprob_thresholds: dict[str, str] = field(default_factory=dict)
    """Raw ``DRIFTSCOPE_LOGPROB_<NAME>`` values by lower-case name (checked by the logprob thresholds,
    which know the metric names)."""


def _threshold(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    return parse_threshold(raw, where=name) if raw else None


def comparator_settings(env: Mapping[str, str] | None = None) -> ComparatorSettings:
    """Read the comparator's environment variables (from ``os.environ`` by default)."""
    env = os.environ if env is None else env
    return ComparatorSettings(
        diff_threshold=_threshold(env, "DRIFTSCOPE_DIFF_THRESHOLD"),
        token_threshold=_threshold(env, "DRIFTSCOPE_TOKEN_THRESHOLD"),
        acceptance_tolerance=_threshold(env, "DRIFTSCOPE_ACCEPTANCE_TOLERANCE"),
        logprob_thresholds={
            k[len(_LOGPROB) :].lower(): v.strip() for k, v in env.items() if k.startswith(_LOGPROB) and v.strip()
        },
    )
