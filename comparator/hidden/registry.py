"""The tensor-pair metrics, as a registry of small pure functions over the streamed sums.

Every metric is one function ``(RowSums) -> float`` and one registration (:func:`metric`): its
name (also its JSON key and CSV column), its table labels, how its cells are written, and
whether a higher value is worse. :func:`~comparator.hidden.metrics.pair_stats` evaluates every
registered metric, in registration order; the results carry them by name
(``TensorComparison.metrics``), and the JSON, CSV, terminal and HTML tables show what they carry.

Adding a metric is one function and one registration, from any module (no library edit)::

    import math
    from comparator.hidden.registry import RowSums, metric

    @metric("rms_diff", label="rms |diff|")
    def rms_diff(s: RowSums) -> float:
        return math.sqrt(s.total("dd") / max(1, s.elements - s.mismatches))

It is then in every comparison made while it is registered (``unregister("rms_diff")`` or the
:func:`registered` context manager take it away again).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from comparator.hidden.kernels import ldexp_or_inf
from comparator.judging.reldiff import rel_diff_of

__all__ = [
    "Metric",
    "RowSums",
    "metric",
    "register",
    "unregister",
    "registered",
    "metrics",
    "get",
    "lookup",
    "columns",
    "evaluate",
    "BuiltinMetrics",
]

Scaled = tuple[float, int]
"""A sum ``s * 2**e`` (``e`` is 0 unless float64 inputs near its limits make the plain sum overflow)."""


@dataclass(frozen=True)
class RowSums:
    """What every metric is computed from: the streamed sums of one tensor pair (``d = x - y`` in float64).

    ``rows``: [rows, 5] float64 per row (the last dim): sum d^2, sum x^2, sum y^2, sum x*y over
    the finite pairs, and the count of NaN/Inf mismatches; scaled sums of squares where ``exps``
    is not None (see :mod:`comparator.hidden.kernels`). ``token`` is the per-row rel_diff already
    derived from them (inf on a row with a mismatch). The whole-tensor totals are :data:`Scaled`.
    """

    rows: np.ndarray
    exps: np.ndarray | None
    token: np.ndarray  # [rows] float64
    dd: Scaled
    xx: Scaled
    yy: Scaled
    xy: Scaled
    max_abs: float
    """max |d| over the finite pairs."""
    sum_abs: Scaled
    """sum |d| over the finite pairs."""
    elements: int
    mismatches: int
    """Pairs where one side is NaN/Inf and the other differs (NaN/NaN and equal infinities agree)."""

    def total(self, which: str) -> float:
        """The total ``dd``, ``xx``, ``yy``, ``xy`` or ``sum_abs`` as one float (inf past float64's range)."""
        s, e = getattr(self, which)
        return ldexp_or_inf(s, e)


MetricFn = Callable[[RowSums], float]


@dataclass(frozen=True)
class Metric:
    """One registered metric.

    Attributes:
        name: key in ``TensorComparison.metrics``, in the JSON report and in the CSV header.
        fn: computes it from the sums; pure, cheap (it runs once per compared tensor).
        label: header of its column in the HTML tensor table.
        short: header in the terminal's tensor table (``--tensors``); None keeps it out of that table.
        fmt: how a cell shows a value; None: the reports' own number format (``1.234e-05``).
        higher_is_worse: a larger value is a larger difference (False for a similarity, cosine).
            A non-finite value is written as JSON ``null``; it reads back as inf for such a metric
            (the value that never passes), as NaN for the others.
        from_norms: a function of ``dd``, ``xx``, ``yy`` and ``token`` alone, so a sketch comparison
            (:mod:`comparator.hidden.sketch`) can estimate it; the others are left out there.
    """

    name: str
    fn: MetricFn | None
    label: str
    short: str | None = None
    fmt: Callable[[float], str] | None = None
    higher_is_worse: bool = True
    from_norms: bool = False

    def text(self, v: float | None, default: Callable[[float], str]) -> str:
        """A table cell for ``v``: ``fmt``, else the renderer's ``default``; ``-`` for a result without it."""
        return "-" if v is None else (self.fmt or default)(v)

    @property
    def null(self) -> float:
        """What a JSON ``null`` of this metric reads back as."""
        return math.inf if self.higher_is_worse else math.nan


_REGISTRY: dict[str, Metric] = {}


def register(m: Metric) -> Metric:
    """Add ``m`` after the metrics already registered; its name must be new."""
    if m.name in _REGISTRY:
        raise ValueError(f"a metric named {m.name!r} is already registered; unregister it first")
    if m.fn is None:
        raise ValueError(f"metric {m.name!r} has no function")
    _REGISTRY[m.name] = m
    return m


def metric(
    name: str,
    *,
    label: str | None = None,
    short: str | None = None,
    fmt: Callable[[float], str] | None = None,
    higher_is_worse: bool = True,
    from_norms: bool = False,
) -> Callable[[MetricFn], MetricFn]:
    """Decorator: register the function as the metric ``name`` (``label`` defaults to the name)."""

    def deco(fn: MetricFn) -> MetricFn:
        register(Metric(name, fn, label or name, short, fmt, higher_is_worse, from_norms))
        return fn

    return deco


def unregister(name: str) -> None:
    """Remove the metric ``name`` (KeyError naming the registered ones when there is none)."""
    if name not in _REGISTRY:
        raise KeyError(f"no metric named {name!r}; registered: {', '.join(_REGISTRY)}")
    del _REGISTRY[name]


@contextmanager
def registered(m: Metric) -> Iterator[Metric]:
    """Register ``m`` for the duration of a ``with`` block (tests, one-off analyses)."""
    register(m)
    try:
        yield m
    finally:
        _REGISTRY.pop(m.name, None)


def metrics() -> tuple[Metric, ...]:
    """The registered metrics, in registration order (the order of the JSON keys and columns)."""
    return tuple(_REGISTRY.values())


def get(name: str) -> Metric:
    """The registered metric ``name`` (KeyError naming the registered ones when there is none)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no metric named {name!r}; registered: {', '.join(_REGISTRY)}") from None


def lookup(name: str) -> Metric:
    """How to show the metric ``name``: its registration, or plain defaults for one not registered
    now (a report written while another metric was registered)."""
    return _REGISTRY.get(name) or Metric(name, None, name)


def columns(carried: Iterable[Mapping[str, float]]) -> list[Metric]:
    """The metrics to show for results carrying ``carried`` metric maps: every name any of them
    holds, in first-seen order (normally the registration order)."""
    names: dict[str, None] = {}
    for m in carried:
        names.update(dict.fromkeys(m))
    return [lookup(n) for n in names]


def evaluate(sums: RowSums, *, from_norms: bool = False) -> dict[str, float]:
    """Every registered metric of ``sums`` (``from_norms``: only those registered so), by name, in registration
    order."""
    return {
        m.name: float(m.fn(sums)) for m in _REGISTRY.values() if m.fn is not None and (m.from_norms or not from_norms)
    }


# --------------------------------------------------------------------------- the built-in metrics


@metric("rel_diff", short="rel_diff", from_norms=True)
def rel_diff(s: RowSums) -> float:
    """||x-y||^2 / (||x||^2 + ||y||^2) (:func:`~comparator.judging.reldiff.rel_diff_of`): 0 for two all-zero
    tensors, inf with a NaN/Inf mismatch."""
    (dd, edd), (xx, exx), (yy, eyy) = s.dd, s.xx, s.yy
    top = max(edd, exx, eyy)  # every term only shrinks: nothing can overflow
    norms = math.ldexp(xx, exx - top) + math.ldexp(yy, eyy - top)
    return math.ldexp(rel_diff_of(dd, norms, mismatched=s.mismatches > 0), edd - top)


@metric("max_token_rel_diff", label="max token rel_diff", short="max token", from_norms=True)
def max_token_rel_diff(s: RowSums) -> float:
    """The largest per-token (per-row) rel_diff: the max-type signal that catches one broken position."""
    return float(np.max(s.token)) if s.token.size else 0.0


@metric("max_abs_diff", label="max |diff|", short="max |diff|")
def max_abs_diff(s: RowSums) -> float:
    """max |x - y|; inf with a NaN/Inf mismatch."""
    return math.inf if s.mismatches else s.max_abs


@metric("mean_abs_diff", label="mean |diff|")
def mean_abs_diff(s: RowSums) -> float:
    """mean |x - y| over the pairs compared (those without a NaN/Inf mismatch)."""
    return ldexp_or_inf(s.sum_abs[0] / max(1, s.elements - s.mismatches), s.sum_abs[1])


@metric("cosine", short="cosine", fmt="{:.6f}".format, higher_is_worse=False)
def cosine(s: RowSums) -> float:
    """<x,y> / (||x|| ||y||) of the whole tensor: 1 for two all-zero tensors, 0 when only one is."""
    (xy, exy), (xx, exx), (yy, eyy) = s.xy, s.xx, s.yy
    if not (xx > 0 and yy > 0):
        return 1.0 if xx == yy else 0.0
    if exy == exx == eyy == 0 and 1e-300 < xx * yy < math.inf:  # the plain formula is safe
        return xy / math.sqrt(xx * yy)
    # each norm brought near 1 by an even power of two (exact), so the product cannot over/underflow
    jx, jy = math.frexp(xx)[1] // 2, math.frexp(yy)[1] // 2
    xx, yy = math.ldexp(xx, -2 * jx), math.ldexp(yy, -2 * jy)
    return math.ldexp(xy, exy - (exx + eyy) // 2 - jx - jy) / math.sqrt(xx * yy)


class BuiltinMetrics:
    """The built-in metrics as attributes of a result that carries its metrics by name.

    ``PairStats`` and ``TensorComparison`` keep ``metrics: Mapping[str, float]``; this gives them
    ``.rel_diff``, ``.cosine``... so code and JSON keys stay as they were before the registry.
    """

    __slots__ = ()
    metrics: Mapping[str, float]

    @property
    def rel_diff(self) -> float:
        return self.metrics["rel_diff"]

    @property
    def max_token_rel_diff(self) -> float:
        return self.metrics["max_token_rel_diff"]

    @property
    def max_abs_diff(self) -> float:
        return self.metrics["max_abs_diff"]

    @property
    def mean_abs_diff(self) -> float:
        return self.metrics["mean_abs_diff"]

    @property
    def cosine(self) -> float:
        return self.metrics["cosine"]
