"""Fixed logprob thresholds: which metrics are checked, and how far each may go.

Thresholds resolve as: explicit values > ``DRIFTSCOPE_LOGPROB_<NAME>`` environment variables (read
by :func:`comparator.settings.comparator_settings`, checked by :func:`logprob_env_thresholds`) >
the per-model table ``configs/logprob_thresholds.json``, whose rows merge ``default`` <
``default@DTYPE`` < ``MODEL`` < ``MODEL@DTYPE`` (DTYPE: the coarsest dtype of the two sides,
:func:`threshold_dtype`). With a calibrated noise file,
:func:`comparator.judging.noise_thresholds.resolve_logprob_thresholds` derives them from the noise
instead. The names are those of the metric table (:mod:`comparator.judging.logprob_metrics`); every
value is parsed by :func:`comparator.judging.values.parse_threshold`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from comparator.judging.logprob_metrics import metric_names
from comparator.judging.logprob_noise import NoiseBasis, NoiseCheck
from comparator.judging.values import parse_threshold
from comparator.settings import comparator_settings
from dumper.errors import UsageError
from dumper.format import Manifest
from dumper.format.dtypes import FLOAT_NAMES, MANTISSA_BITS
from dumper.resources import config_path

__all__ = [
    "THRESHOLD_TABLE",
    "LogprobThresholds",
    "logprob_env_thresholds",
    "explicit_thresholds",
    "load_threshold_table",
    "judged_failures",
    "threshold_dtype",
]

THRESHOLD_TABLE: Final = config_path("logprob_thresholds.json")
"""Per-model threshold table: ``{"default": {...}, "default@float32": {...}, "<model>": {...},
"<model>@<dtype>": {...}}``; each row overrides only the keys it names (``null`` = not checked)."""


def logprob_env_thresholds(env: Mapping[str, str] | None = None) -> dict[str, float | None]:
    """Thresholds set by ``DRIFTSCOPE_LOGPROB_<NAME>`` (e.g. ``DRIFTSCOPE_LOGPROB_K3_MEAN=1e-3``).

    Only variables that are set (non-empty) appear; ``off`` maps to None (not checked). The
    variables are read by :func:`comparator.settings.comparator_settings`.
    """
    names = metric_names()
    out: dict[str, float | None] = {}
    for name, raw in comparator_settings(env).logprob_thresholds.items():
        var = f"DRIFTSCOPE_LOGPROB_{name.upper()}"
        if name not in names:
            raise UsageError(
                f"{var} is not a logprob threshold; known: "
                f"{', '.join('DRIFTSCOPE_LOGPROB_' + n.upper() for n in names)}"
            )
        out[name] = parse_threshold(raw, where=var, allow_off=True)
    return out


def explicit_thresholds(
    explicit: Mapping[str, float | None] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, float | None]:
    """The thresholds a user set: ``DRIFTSCOPE_LOGPROB_*``, overridden by ``explicit`` (names checked)."""
    values = logprob_env_thresholds(env)
    for k, v in (explicit or {}).items():
        if k not in metric_names():
            raise UsageError(f"unknown logprob threshold {k!r}; known: {list(metric_names())}")
        values[k] = v
    return values


def _split_row(model: str) -> tuple[str, str | None]:
    """``"tiny-llama@bfloat16"`` -> ``("tiny-llama", "bfloat16")``; without a known dtype after ``@``
    (``/tmp/user@host/ckpt``) the whole string is the name."""
    name, sep, dtype = model.rpartition("@")
    return (name, dtype) if sep and name and dtype in FLOAT_NAMES else (model, None)


def load_threshold_table(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, float | None]]:
    """Read the per-model table (default :data:`THRESHOLD_TABLE`); keys validated, ``default`` required."""
    p = Path(path) if path is not None else THRESHOLD_TABLE
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{p}: cannot read the logprob threshold table: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("default"), dict):
        raise UsageError(f"{p}: expected an object with a 'default' entry")
    names = metric_names()
    table: dict[str, dict[str, float | None]] = {}
    for model, entry in raw.items():
        if model.startswith("_"):
            continue  # comments
        if not isinstance(entry, dict):
            raise UsageError(f"{p}: entry {model!r} must be an object")
        unknown = set(entry) - set(names)
        if unknown:
            raise UsageError(f"{p}: entry {model!r} has unknown keys {sorted(unknown)}; known: {list(names)}")
        table[model] = {k: parse_threshold(v, where=f"{p}: {model}: {k}", allow_off=True) for k, v in entry.items()}
    return table


@dataclass(frozen=True, init=False)
class LogprobThresholds:
    """Upper bounds a verdict must meet, by metric name; None = not checked.

    A set threshold passes when ``value <= threshold`` (so NaN never passes); a threshold whose
    metric was not computed (``kl_*`` without logits, ``topk_max_err`` without top-k) is skipped.
    Built from a mapping or by keyword (``LogprobThresholds(kl_max=0.01)``); ``thresholds.NAME`` reads one.
    """

    values: Mapping[str, float | None]
    """Every registered metric's threshold, by name (None: not checked)."""
    basis: NoiseBasis | None = field(default=None, repr=False)
    """The calibrated noise these thresholds derive from (:mod:`comparator.judging.logprob_noise`); None: fixed."""
    source: str | None = field(default=None, compare=False)
    """Where they come from, for the verdict (table rows, noise file); not part of :meth:`to_json`."""

    def __init__(
        self,
        values: Mapping[str, float | None] | None = None,
        *,
        basis: NoiseBasis | None = None,
        source: str | None = None,
        **by_name: float | None,
    ) -> None:
        given = {**(values or {}), **by_name}
        names = metric_names()
        unknown = [k for k in given if k not in names]
        if unknown:
            raise UsageError(f"unknown logprob threshold {unknown[0]!r}; known: {list(names)}")
        checked = {n: parse_threshold(given.get(n), where=f"logprob threshold {n}", allow_off=True) for n in names}
        object.__setattr__(self, "values", checked)
        object.__setattr__(self, "basis", basis)
        object.__setattr__(self, "source", source)

    def __getattr__(self, name: str) -> float | None:
        """``thresholds.kl_max``: the threshold of a registered metric (None: not checked)."""
        values = self.__dict__.get("values")
        if values is None or name.startswith("_") or name not in metric_names():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return values.get(name)

    @classmethod
    def resolve(
        cls,
        model: str | None = None,
        *,
        explicit: Mapping[str, float | None] | None = None,
        env: Mapping[str, str] | None = None,
        table: str | os.PathLike[str] | Mapping[str, Mapping[str, float | None]] | None = None,
        dtype: str | None = None,
    ) -> LogprobThresholds:
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
        source = (
            f"{Path(table).name if isinstance(table, (str, os.PathLike)) else THRESHOLD_TABLE.name} "
            f"{' < '.join(used)}" + (f"; set: {', '.join(chosen)}" if chosen else "")
        )
        return cls(values, source=source)

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
            raise UsageError(
                f"--model {model!r}: no such row in {table or THRESHOLD_TABLE}; known: {', '.join(sorted(tab))}"
            )

    def failures(self, metrics: Mapping[str, float | None]) -> list[str]:
        """Names of set thresholds whose computed metric exceeds them (NaN exceeds everything)."""
        out = []
        for name in metric_names():
            limit, value = self.values.get(name), metrics.get(name)
            if limit is None or value is None:
                continue
            if not value <= limit:
                out.append(name)
        return out

    def to_json(self) -> dict[str, float | None]:
        return {name: self.values.get(name) for name in metric_names()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LogprobThresholds:
        return cls({name: d.get(name) for name in metric_names()})


def judged_failures(
    thresholds: LogprobThresholds, metrics: Mapping[str, float | None], noise: NoiseCheck | None
) -> list[str]:
    """The thresholds failed: every exceeded one, except a noise-derived mean-type threshold whose
    mean is not significantly above the calibrated noise (:meth:`NoiseCheck.excused`)."""
    return [n for n in thresholds.failures(metrics) if noise is None or not noise.excused(n)]


def threshold_dtype(*sides: Manifest | str | None) -> str | None:
    """The dtype whose threshold rows judge a comparison: the coarsest of the sides' dtypes (a
    dump's manifest says it; float32 baseline vs bfloat16 target: ``bfloat16``); None when no side says."""
    dtypes = [s.capture_signature.get("dtype") if isinstance(s, Manifest) else s for s in sides]
    known = [d for d in dtypes if isinstance(d, str) and d]
    if not known:
        return None
    return min(known, key=lambda d: MANTISSA_BITS.get(d, 0))
