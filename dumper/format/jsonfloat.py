"""How metrics cross JSON: one rule for every report.

A non-finite metric (an infinite rel_diff from a NaN mismatch, say) is written as ``null`` so
the file stays standard JSON; it reads back as infinity, the value that can never pass.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["to_json_float", "from_json_float"]


def to_json_float(v: float | None) -> float | None:
    """``v`` as a JSON number, or ``None`` when it is missing or not finite."""
    return None if v is None or not math.isfinite(v) else float(v)


def from_json_float(v: Any) -> float:
    """Inverse of :func:`to_json_float` for a metric that was computed: ``null`` is infinity."""
    return math.inf if v is None else float(v)
