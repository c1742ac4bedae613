"""Numbers in words: how every output writes a metric, a multiple and a located logprob value.

:mod:`comparator.outcome` re-exports these with the verdict's words; a new output uses them rather
than formatting a float its own way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from comparator.logprobs import Located

__all__ = ["format_float", "format_available", "format_ratio", "format_located"]


def format_float(v: float | None) -> str:
    """A metric in text: ``1.234e-03``, ``0`` (bit-identical), ``inf``, ``nan`` (``nan`` also for None)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if math.isinf(v):
        return "inf"
    return "0" if v == 0 else f"{v:.3e}"


def format_available(v: float | None, fmt: str | None = None) -> str:
    """A metric that a comparison may lack (max |diff| and cosine of a sketch comparison): ``n/a`` for None,
    else ``fmt`` (a format spec) or :func:`format_float`."""
    return "n/a" if v is None else format(v, fmt) if fmt else format_float(v)


def format_ratio(v: float | None) -> str:
    """A multiple (of noise, or a growth factor): ``2.1e+06x``, ``-`` when unknown."""
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return "inf"
    return f"{v:.3g}x"


def format_located(loc: Located) -> str:
    """A max-type logprob value with where it sits: ``1.900e-03 (request 0, position 57)``, ``-`` when not computed."""
    if loc.value is None:
        return "-"
    return f"{format_float(loc.value)} (request {loc.request}, position {loc.position})"
