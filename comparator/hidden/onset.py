"""Where a divergence starts, and which layer introduces it.

A threshold says where an error first becomes large; the error usually starts earlier. Two
estimates, one for each direction of the dump:

- **onset token**: the lowest position of the first divergent tensor whose per-token rel_diff
  departs from the noise. With a calibrated noise file that is the first position over the
  tensor's noise threshold. Without one, the noise is estimated from the run itself: the
  positions up to the first failing token are split at the single change point that best
  separates a low run from a high one (least squares on log10 of the values), and the split
  counts only when the two runs sit at least :data:`MIN_DECADES` apart; otherwise the onset is
  the first failing token. Values at or below the dumps' rounding floor (:func:`rounding_floor`:
  the coarser dtype's machine epsilon squared, what one rounding per element gives) count as that
  floor, exact zeros included: bit-identical positions followed by rounding-level ones are one
  run, not a 16-decade step.
- **onset layer**: the same over layers, on each layer's largest rel_diff up to the first
  divergent layer (calibrated: the first layer with a tensor over its noise threshold). It can
  be lower than the first divergent layer when an error is introduced small and amplified later.

**Amplification** of layer k is rel_diff(input of layer k+1) / rel_diff(input of layer k) at one
capture point: the growth of the error across layer k. A layer whose amplification stands far
above the typical (median) one introduces error; one near it passes inherited error on.

Example::

    import numpy as np
    from comparator.hidden.onset import change_point
    change_point(np.array([0, 0, 0, 1e-8, 1e-6, 1e-3]))   # 3
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dumper.format.dtypes import DTYPES, FLOAT_CODES
from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = [
    "MIN_DECADES",
    "INTRODUCED_FACTOR",
    "change_point",
    "token_onset",
    "Amplification",
    "amplification",
    "layer_onset",
    "point_of",
    "rounding_floor",
]

MIN_DECADES = 1.0
"""How far apart (in decades of rel_diff) the runs before and after a change point must sit."""
INTRODUCED_FACTOR = 10.0
"""A layer whose amplification is this many times the median amplification introduces error."""
_LOG_FLOOR = 1e-30
"""Values below this (exact zeros) count as this, so log10 stays finite, where no dtype says more."""


def rounding_floor(dtypes: Iterable[str]) -> float:
    """The rel_diff one rounding per element reaches in the coarsest of ``dtypes`` (safetensors codes): its
    machine epsilon squared (float32 1.4e-14, bfloat16 6.1e-5); :data:`_LOG_FLOOR` when none is a float dtype.
    A difference below it cannot be told from rounding by its size."""
    bits = [DTYPES[c].mantissa_bits for c in dtypes if c in FLOAT_CODES]
    return float(2.0 ** (-2 * (min(bits) - 1))) if bits else _LOG_FLOOR


def change_point(values: np.ndarray, *, min_decades: float = MIN_DECADES, floor: float = _LOG_FLOOR) -> int | None:
    """The index splitting ``values`` into a low run and a high run (None when no split stands out).

    Least squares over log10 of the values, each at least ``floor`` (:func:`rounding_floor`); the
    split must leave the high run's mean at least ``min_decades`` above the low run's. The last
    value belongs to the high run.
    """
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    if n < 2:
        return None
    logs = np.log10(np.maximum(np.where(np.isnan(v), np.inf, v), max(floor, _LOG_FLOOR)))
    logs = np.minimum(logs, 300.0)  # inf (a NaN/Inf mismatch) counts as a very large value
    c1, c2 = np.cumsum(logs), np.cumsum(logs * logs)
    k = np.arange(1, n)  # low run = [0, k), high run = [k, n)
    lo_n, hi_n = k, n - k
    lo_s, hi_s = c1[k - 1], c1[-1] - c1[k - 1]
    lo_q, hi_q = c2[k - 1], c2[-1] - c2[k - 1]
    sse = (lo_q - lo_s**2 / lo_n) + (hi_q - hi_s**2 / hi_n)
    best = int(np.argmin(sse))
    split = int(k[best])
    if hi_s[best] / hi_n[best] - lo_s[best] / lo_n[best] < min_decades:
        return None
    low_max = max(float(np.max(v[:split])), floor)
    # the high run starts at its first value above everything before the split (and above the floor)
    above = np.flatnonzero(~(v[split:] <= low_max))
    return split + int(above[0]) if above.size else split


def token_onset(
    token: np.ndarray,
    positions: np.ndarray | None,
    first_row: int,
    noise_threshold: float | np.ndarray | None,
    floor: float = _LOG_FLOOR,
) -> tuple[int, str]:
    """``(onset, method)``: the row index where the divergence of one tensor starts.

    ``noise_threshold``: the tensor's calibrated per-token threshold, or each row's (row noise; None: estimate
    from the run,
    values under ``floor`` counting as it). Rows are taken in position order up to the first failing
    row ``first_row``.
    """
    order = np.argsort(positions, kind="stable") if positions is not None else np.arange(token.size)
    upto = order[: int(np.flatnonzero(order == first_row)[0]) + 1]
    vals = token[upto]
    if noise_threshold is not None:
        limit = noise_threshold[upto] if isinstance(noise_threshold, np.ndarray) else noise_threshold
        departs = np.flatnonzero(~(vals <= limit))
        return int(upto[departs[0]]) if departs.size else first_row, "calibrated"
    cp = change_point(vals, floor=floor)
    if cp is None:
        return first_row, "threshold"
    return int(upto[cp]), "change-point"


def layer_onset(
    values: Sequence[tuple[int, float, bool | None]], first_layer: int, floor: float = _LOG_FLOOR
) -> tuple[int, str]:
    """``(onset_layer, method)`` from ``(layer, largest rel_diff, departs from calibrated noise or None)``.

    Layers up to ``first_layer`` are considered, in order; uncalibrated, values under ``floor`` count as it.
    """
    rows = sorted((r for r in values if r[0] <= first_layer), key=lambda r: r[0])
    calibrated = [r for r in rows if r[2] is not None]
    if calibrated:
        hit = next((r[0] for r in calibrated if r[2]), first_layer)
        return min(hit, first_layer), "calibrated"
    if len(rows) < 2:
        return first_layer, "threshold"
    cp = change_point(np.array([r[1] for r in rows]), floor=floor)
    if cp is None:
        return first_layer, "threshold"
    return rows[cp][0], "change-point"


@dataclass(frozen=True)
class Amplification:
    """Growth of the error across one layer at one capture point."""

    layer: int
    point: str | None
    before: float
    """rel_diff of the input of ``layer``."""
    after: float
    """rel_diff of the input of ``layer + 1`` (the next captured layer at this point)."""
    ratio: float | None
    """``after / before``; inf when ``before`` is 0 and ``after`` is not; None when both are 0."""
    introduced: bool
    """The ratio stands far above the typical one: this layer introduces error."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("before", "after", "ratio"):
            d[k] = to_json_float(d[k])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Amplification:
        before = from_json_float(d["before"])
        after = from_json_float(d["after"])
        ratio = d.get("ratio")
        # a null ratio is "none" or non-finite: the ratio of what was read back tells which
        return cls(
            layer=int(d["layer"]),
            point=d.get("point"),
            before=before,
            after=after,
            ratio=_ratio(before, after) if ratio is None else float(ratio),
            introduced=bool(d["introduced"]),
        )


def _ratio(before: float, after: float) -> float | None:
    if math.isnan(before) or math.isnan(after):
        return math.inf
    if before == 0:
        return None if after == 0 else math.inf
    if math.isinf(before):  # nothing left to grow: as 0 -> 0, no ratio (inf / inf would be NaN)
        return None if math.isinf(after) else after / before
    return after / before


def amplification(
    values: Sequence[tuple[int, str | None, float]],
    departs: Mapping[tuple[int, str | None], bool] | None = None,
    order: Mapping[str | None, int] | None = None,
) -> list[Amplification]:
    """Per-layer amplification from ``(layer, point, rel_diff)`` of consecutive captured layers.

    Only layers k whose next layer k+1 is captured at the same point get a value; a ratio is
    ``introduced`` when it exceeds :data:`INTRODUCED_FACTOR` times the median finite ratio of
    its point (with at least three ratios to take a median of), or is infinite. ``departs``
    (calibrated noise): whether ``(layer, point)``'s value departs from its noise; where known
    for layer k+1, layer k introduces error only if it does. ``order``: where each point sits in a
    layer (:func:`dumper.format.points.order_in_layer`), the order of each layer's values (else by name).
    """
    by_point: dict[str | None, dict[int, float]] = {}
    for layer, point, rel in values:
        cur = by_point.setdefault(point, {})
        cur[layer] = max(cur.get(layer, 0.0), rel) if not math.isnan(rel) else math.inf
    out: list[Amplification] = []
    for point, layers in by_point.items():
        pairs = [(k, layers[k], layers[k + 1]) for k in sorted(layers) if k + 1 in layers]
        ratios = [_ratio(b, a) for _, b, a in pairs]
        finite = [r for r in ratios if r is not None and math.isfinite(r) and r > 0]
        median = float(np.median(finite)) if len(finite) >= 3 else None
        for (k, b, a), r in zip(pairs, ratios, strict=True):
            introduced = r is not None and (math.isinf(r) or (median is not None and r > INTRODUCED_FACTOR * median))
            introduced = introduced and (departs or {}).get((k + 1, point), True)
            out.append(Amplification(layer=k, point=point, before=b, after=a, ratio=r, introduced=introduced))
    out.sort(key=lambda a: (a.layer, (order or {}).get(a.point, 0), a.point or ""))
    return out


def point_of(name: str) -> str:
    """The capture point of a tensor name: what follows its layer index (``self_attn.input``), else the name."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[i + 1 :]) or name
    return name
