"""The token x layer heatmap: per-token rel_diff of every tensor of one sequence around the first divergence.

The comparison keeps one summary per tensor, never per-token arrays (a large dump has millions
of rows). Once the first divergence is known, this module recomputes the per-token rel_diff of
that sequence's tensors for a window of positions only (up to :data:`WINDOW` positions starting
:data:`BEFORE` before the first failing token), so the extra work and memory are bounded by
``tensors x WINDOW`` rows, whatever the dump size.

Example::

    report = compare_dumps("dumps/one", "dumps/chunked")
    hm = report.heatmap            # Heatmap(sequence=0, positions=(56, ..., 183), layers=(0, ..., 7), ...)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .align import LogicalKey, LogicalTensor, Segment, positions_of
from .metrics import PairStats
from .report import FirstDivergence, Heatmap

__all__ = ["WINDOW", "BEFORE", "token_heatmap", "clip_logical", "window_positions"]

WINDOW = 128
"""Most positions a heatmap shows."""
BEFORE = 8
"""Positions shown before the first failing token, so the edge where the error starts is visible."""

StatsFn = Callable[[LogicalTensor, LogicalTensor], tuple[PairStats, np.ndarray]]
"""Compares two (clipped) logical tensors: their metrics and aligned positions."""


def _clip(segs: list[Segment], lo: int, hi: int) -> list[Segment]:
    """The parts of position-sorted segments that hold positions ``lo .. hi-1``."""
    out = []
    for s in segs:
        a, b = max(lo, s.pos), min(hi, s.pos + s.count)
        if a < b:
            out.append(Segment(s.rec, s.row + a - s.pos, a, b - a))
    return out


def clip_logical(lt: LogicalTensor, lo: int, hi: int) -> LogicalTensor | None:
    """``lt`` restricted to positions ``lo .. hi-1``; None when some rank holds none of them."""
    by_rank = {r: _clip(segs, lo, hi) for r, segs in lt.by_rank.items()}
    rows = _clip(lt.rows, lo, hi)
    if not rows or not all(by_rank.values()):
        return None
    return LogicalTensor(lt.name, lt.call, lt.sequence, lt.layer, lt.sharded, by_rank=by_rank, rows=rows)


def window_positions(positions: np.ndarray, token: int | None, *, before: int = BEFORE,
                     width: int = WINDOW) -> np.ndarray:
    """Up to ``width`` of the sorted ``positions``, starting ``before`` positions ahead of ``token``."""
    start = 0 if token is None else max(0, int(np.searchsorted(positions, token)) - before)
    return positions[start:start + width]


def token_heatmap(fd: FirstDivergence | None, base: Mapping[LogicalKey, LogicalTensor],
                  target: Mapping[LogicalKey, LogicalTensor], stats: StatsFn, *, before: int = BEFORE,
                  width: int = WINDOW) -> Heatmap | None:
    """Per-token rel_diff of the first divergent sequence's tensors around the first failing token.

    None when nothing diverged or the divergent tensor was not aligned by position (tensors
    without row positions). Rows are the tensors of that sequence present on both sides that
    hold every position of the window, ordered by layer, name and call.
    """
    if fd is None or fd.sequence is None:
        return None
    keys = sorted((k for k in base.keys() & target.keys() if k[2] == fd.sequence),
                  key=lambda k: (base[k].layer is None, base[k].layer or 0, k[0], k[1]))
    anchor = next((k for k in keys if k[0] == fd.name), None)
    if anchor is None:
        return None
    cols = window_positions(positions_of(base[anchor].rows), fd.token if fd.token is not None else fd.worst_token,
                            before=before, width=width)
    if cols.size == 0:
        return None
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    names, layers, values = [], [], []
    for k in keys:
        b, t = clip_logical(base[k], lo, hi), clip_logical(target[k], lo, hi)
        if b is None or t is None:
            continue
        pair, pos = stats(b, t)
        if not np.array_equal(pos, cols):
            continue  # this tensor lacks some positions of the window
        names.append(f"{k[0]}#{k[1]}" if k[1] else k[0])
        layers.append(base[k].layer)
        values.append(tuple(float(v) for v in pair.token_rel_diff))
    if not values:
        return None
    return Heatmap(sequence=fd.sequence, positions=tuple(int(p) for p in cols), layers=tuple(layers),
                   names=tuple(names), values=tuple(values))
