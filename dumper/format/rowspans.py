"""Row metadata runs read together: which rows of a record hold which sequence's consecutive positions.

A record's ``positions`` (runs growing by 1) and ``sequence_ids`` (runs of one value) are two
run-length encodings of its rows (:func:`dumper.format.manifest.encode_runs`). Merging the two run
lists gives spans of rows that hold one sequence's consecutive positions, in time linear in the
number of runs, not of rows: what the format checks and the comparator's alignment walk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["row_spans"]


def row_spans(
    positions: Sequence[Sequence[int]], sequence_ids: Sequence[Sequence[int]]
) -> Iterator[tuple[int, int, int, int]]:
    """``(first row, sequence, first position, count)`` of each span of rows holding one sequence's consecutive
    positions, in row order; stops at the shorter run list."""
    i = j = used_p = used_s = row = 0
    while i < len(positions) and j < len(sequence_ids):
        (p0, pc), (s0, sc) = positions[i], sequence_ids[j]
        n = min(pc - used_p, sc - used_s)
        if n:
            yield row, s0, p0 + used_p, n
        row, used_p, used_s = row + n, used_p + n, used_s + n
        if used_p == pc:
            i, used_p = i + 1, 0
        if used_s == sc:
            j, used_s = j + 1, 0
