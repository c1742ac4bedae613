"""The token x layer heatmap: per-token rel_diff of every tensor of one sequence around the first divergence.

The comparison keeps one summary per tensor, never per-token arrays (a large dump has millions
of rows). Once the first divergence is known, this module recomputes the per-token rel_diff of
that sequence's tensors for a window of positions only, so the extra work and memory are bounded
by ``tensors x WINDOW`` rows, whatever the dump size. The window starts :data:`BEFORE` positions
before the divergence's onset (``first_divergent.onset``, where it starts; the first failing
token when no earlier onset stood out) and holds up to :data:`WINDOW` positions. When the first
failing token lies too far after the onset for one window to hold both (and :data:`BEFORE`
positions after the token), it shows two runs with a gap between them: :data:`WINDOW` // 2
positions from the onset, and the rest from :data:`BEFORE` before the first failing token.

Example::

    report = compare_dumps("dumps/one", "dumps/chunked")
    hm = report.heatmap            # Heatmap(sequence=0, positions=(56, ..., 183), layers=(0, ..., 7), ...)
    window_positions(np.arange(400), 250, onset=20)   # 12..75, then 242..305: two runs, a gap between
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from comparator.hidden.align import LogicalKey, LogicalTensor, Segment, positions_of
from comparator.hidden.metrics import PairStats
from comparator.hidden.types import FirstDivergence, Heatmap

__all__ = ["WINDOW", "BEFORE", "token_heatmap", "clip_logical", "window_runs", "window_positions"]

WINDOW = 128
"""Most positions a heatmap shows."""
BEFORE = 8
"""Positions shown before the onset (and the first failing token), so the edge where the error starts is visible."""

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


def window_runs(
    positions: np.ndarray, token: int | None, *, onset: int | None = None, before: int = BEFORE, width: int = WINDOW
) -> list[np.ndarray]:
    """The runs of the sorted ``positions`` a heatmap shows: at most ``width`` positions in all.

    One run from ``before`` positions ahead of ``onset`` (or of ``token`` without an earlier
    onset) when it also holds ``token`` and ``before`` positions after it; otherwise two runs,
    ``width // 2`` positions from ``before`` ahead of the onset and the rest from ``before``
    ahead of ``token``.
    """
    if token is None:
        return [positions[:width]]
    at = int(np.searchsorted(positions, token))
    start = max(0, at - before)
    if onset is None or onset >= token:
        return [positions[start : start + width]]
    first = max(0, int(np.searchsorted(positions, onset)) - before)
    if at + before <= first + width:
        return [positions[first : first + width]]
    head = positions[first : min(first + width // 2, start)]
    return [head, positions[start : start + width - head.size]]


def window_positions(
    positions: np.ndarray, token: int | None, *, onset: int | None = None, before: int = BEFORE, width: int = WINDOW
) -> np.ndarray:
    """The positions of :func:`window_runs`, concatenated (a jump between runs is the gap)."""
    return np.concatenate(window_runs(positions, token, onset=onset, before=before, width=width))


def _row(pair_stats: StatsFn, b: LogicalTensor, t: LogicalTensor, runs: list[np.ndarray]) -> list[float] | None:
    """Per-token rel_diff of one tensor over every run, or None when it lacks some position of one."""
    out: list[float] = []
    for cols in runs:
        bb, tt = clip_logical(b, int(cols[0]), int(cols[-1]) + 1), clip_logical(t, int(cols[0]), int(cols[-1]) + 1)
        if bb is None or tt is None:
            return None
        pair, pos = pair_stats(bb, tt)
        if not np.array_equal(pos, cols):
            return None
        out += [float(v) for v in pair.token_rel_diff]
    return out


def token_heatmap(
    fd: FirstDivergence | None,
    base: Mapping[LogicalKey, LogicalTensor],
    target: Mapping[LogicalKey, LogicalTensor],
    stats: StatsFn,
    *,
    before: int = BEFORE,
    width: int = WINDOW,
) -> Heatmap | None:
    """Per-token rel_diff of the first divergent sequence's tensors from the onset to the first failing token.

    None when nothing diverged or the divergent tensor was not aligned by position (tensors
    without row positions). Rows are the tensors of that sequence present on both sides that
    hold every position of the window (:func:`window_runs`), ordered by layer, name and call.
    """
    if fd is None or fd.sequence is None:
        return None
    keys = sorted(
        (k for k in base.keys() & target.keys() if k[2] == fd.sequence),
        key=lambda k: (base[k].layer is None, base[k].layer or 0, k[0], k[1]),
    )
    anchor = next((k for k in keys if k[0] == fd.name), None)
    if anchor is None:
        return None
    runs = [
        r
        for r in window_runs(
            positions_of(base[anchor].rows),
            fd.token if fd.token is not None else fd.worst_token,
            onset=fd.onset,
            before=before,
            width=width,
        )
        if r.size
    ]
    if not runs:
        return None
    names = []
    layers = []
    values = []
    for k in keys:
        row = _row(stats, base[k], target[k], runs)
        if row is None:
            continue  # this tensor lacks some positions of the window
        names.append(f"{k[0]}#{k[1]}" if k[1] else k[0])
        layers.append(base[k].layer)
        values.append(tuple(row))
    if not values:
        return None
    return Heatmap(
        sequence=fd.sequence,
        positions=tuple(int(p) for r in runs for p in r),
        layers=tuple(layers),
        names=tuple(names),
        values=tuple(values),
    )
