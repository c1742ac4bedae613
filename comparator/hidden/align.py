"""Alignment: which rows of the baseline meet which rows of the target.

Two dumps of the same tokens can be laid out differently: one pass of 2048 tokens versus 4
chunks of 512, one prompt at a time versus a padded batch, one process versus two
tensor-parallel ranks. Rows are therefore matched by what they mean,
(name, call, sequence id, absolute token position), whenever both sides record positions and
sequence ids; the rest falls back to (name, forward pass, rank, call).

A *logical tensor* is one name's rows for one sequence, reassembled across passes, batch rows
and ranks: replicated ranks contribute one representative (the lowest rank; the others are
checked against it, and one that differs is also compared through its :func:`replica_view`),
sharded ranks contribute column pieces concatenated in rank order.
Nothing is read here: plans hold record references and row offsets only, so a comparison can
stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dumper.errors import CorruptDumpError, NotComparableError
from dumper.format import PAD_SEQUENCE, Manifest, TensorRecord
from dumper.format.rowspans import row_spans
from dumper.format.speculative import rejected_ranges

__all__ = [
    "Segment",
    "LogicalTensor",
    "RowRun",
    "Piece",
    "logical_tensors",
    "match_rows",
    "column_pieces",
    "fallback_pairs",
    "split_by_mode",
    "positions_of",
    "replica_view",
    "LogicalKey",
    "FallbackKey",
]

LogicalKey = tuple[str, int, int]
"""(name, call, sequence id)."""
FallbackKey = tuple[str, int, int, int]
"""(name, forward pass, rank, call) for tensors without row positions."""


@dataclass(frozen=True)
class Segment:
    """``count`` consecutive rows of ``rec`` from ``row`` holding positions ``pos .. pos+count-1``."""

    rec: TensorRecord
    row: int
    pos: int
    count: int


@dataclass
class LogicalTensor:
    """One name's rows for one sequence on one side, per rank, sorted by position."""

    name: str
    call: int
    sequence: int
    layer: int | None
    sharded: bool
    by_rank: dict[int, list[Segment]] = field(default_factory=dict)
    rows: list[Segment] = field(default_factory=list)
    """Whole tensors: each position once, from the lowest rank holding it. Sharded: rank 0's rows."""
    replicas: list[tuple[Segment, Segment]] = field(default_factory=list)
    """(reference rows, the same positions on a higher rank) that must be identical."""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank)

    def columns(self) -> list[tuple[int, int, int]]:
        """(rank, first column, width) of each piece of the full last dim."""
        ranks = self.ranks if self.sharded else [-1]
        out, col = [], 0
        for r in ranks:
            width = (self.by_rank[r] if r >= 0 else self.rows)[0].rec.shape[-1]
            out.append((r, col, width))
            col += width
        return out

    def segments(self, rank: int) -> list[Segment]:
        """Rows of one column piece (``rank`` -1: the merged rows of a whole tensor)."""
        return self.rows if rank < 0 else self.by_rank[rank]

    def describe(self) -> str:
        return f"{self.name} (sequence {self.sequence})"


def _sub(seg: Segment, lo: int, hi: int) -> Segment:
    """The rows of ``seg`` holding positions ``lo .. hi-1``."""
    return Segment(seg.rec, seg.row + lo - seg.pos, lo, hi - lo)


def _merge_ranks(lt: LogicalTensor) -> None:
    """Fill ``rows`` and ``replicas`` of a whole (unsharded) tensor.

    Positions held by one rank only (context or data parallel) are taken from it; positions
    held by several (tensor-parallel replicas) are taken from the lowest rank and the others
    are queued for the identity check.
    """
    chosen: list[Segment] = []
    for rank in lt.ranks:
        added: list[Segment] = []
        for seg in lt.by_rank[rank]:
            cursor, end = seg.pos, seg.pos + seg.count
            for c in chosen:
                c_end = c.pos + c.count
                if c_end <= cursor or c.pos >= end:
                    continue
                if c.pos > cursor:
                    added.append(_sub(seg, cursor, c.pos))
                lo, hi = max(c.pos, cursor), min(c_end, end)
                lt.replicas.append((_sub(c, lo, hi), _sub(seg, lo, hi)))
                cursor = hi
            if cursor < end:
                added.append(_sub(seg, cursor, end))
        chosen = sorted(chosen + added, key=lambda s: s.pos)
    lt.rows = chosen


def replica_view(lt: LogicalTensor, rank: int) -> LogicalTensor:
    """``lt`` as ``rank`` holds it: that rank's replica rows in place of the representative's.

    Positions the rank does not replicate keep the representative's rows, so the view covers
    the same positions as ``lt`` and aligns with the other side the same way. Nothing is read.
    """
    mine = sorted((other for _, other in lt.replicas if other.rec.rank == rank), key=lambda s: s.pos)
    rows: list[Segment] = []
    for seg in lt.rows:
        cursor, end = seg.pos, seg.pos + seg.count
        for m in mine:
            lo, hi = max(m.pos, cursor), min(m.pos + m.count, end)
            if lo >= hi:
                continue
            if lo > cursor:
                rows.append(_sub(seg, cursor, lo))
            cursor = hi
        if cursor < end:
            rows.append(_sub(seg, cursor, end))
    return LogicalTensor(
        lt.name,
        lt.call,
        lt.sequence,
        lt.layer,
        lt.sharded,
        by_rank=lt.by_rank,
        rows=sorted(rows + mine, key=lambda s: s.pos),
    )


@dataclass(frozen=True)
class RowRun:
    """Aligned rows: ``count`` positions from ``pos``, at ``index`` in the aligned position list."""

    base: Segment
    base_row: int
    target: Segment
    target_row: int
    pos: int
    count: int


@dataclass(frozen=True)
class Piece:
    """A column range shared by one baseline rank and one target rank."""

    base_rank: int
    base_col: int
    target_rank: int
    target_col: int
    width: int


def _has_rows(rec: TensorRecord) -> bool:
    return rec.positions is not None and rec.sequence_ids is not None and len(rec.shape) >= 2


def _segments(rec: TensorRecord) -> list[tuple[int, Segment]]:
    """Split a record's rows into (sequence, Segment) runs, dropping padding rows.

    Works on the run-length encoded metadata directly (two sorted run lists are merged), so
    its cost grows with the number of runs, not of rows.
    """
    pos_runs, seq_runs = rec.positions or [], rec.sequence_ids or []
    if sum(c for _, c in pos_runs) != rec.rows or sum(c for _, c in seq_runs) != rec.rows:
        raise CorruptDumpError(
            f"{rec.file}: tensor {rec.name!r} has row metadata for another number of rows than its {rec.rows} rows"
        )
    return [(s, Segment(rec, row, p, n)) for row, s, p, n in row_spans(pos_runs, seq_runs) if s != PAD_SEQUENCE]


def split_by_mode(baseline: Manifest, target: Manifest) -> tuple[set[str], set[str]]:
    """Names aligned by rows (every record on both sides has positions) and names that fall back."""
    names = {r.name for r in baseline.tensors} | {r.name for r in target.tensors}
    without = {r.name for r in (*baseline.tensors, *target.tensors) if not _has_rows(r)}
    return names - without, without


def _kept(
    segs: list[tuple[int, Segment]], rejected: dict[tuple[int, int], tuple[int, int]]
) -> list[tuple[int, Segment]]:
    """``segs`` without the rows of rejected drafts (:func:`dumper.format.speculative.rejected_ranges`)."""
    out: list[tuple[int, Segment]] = []
    for seq, seg in segs:
        cut = rejected.get((seg.rec.forward_pass, seq))
        if cut is None or cut[0] >= seg.pos + seg.count or cut[1] <= seg.pos:
            out.append((seq, seg))
            continue
        if cut[0] > seg.pos:
            out.append((seq, _sub(seg, seg.pos, cut[0])))
        if cut[1] < seg.pos + seg.count:
            out.append((seq, _sub(seg, cut[1], seg.pos + seg.count)))
    return out


def logical_tensors(manifest: Manifest, names: set[str], where: str) -> dict[LogicalKey, LogicalTensor]:
    """Group the rows of ``names`` into logical tensors keyed by (name, call, sequence).

    The rows of drafts a speculative decode rejected are left out: only kept rows are compared.
    """
    out: dict[LogicalKey, LogicalTensor] = {}
    rejected = rejected_ranges(manifest.extra)
    for rec in manifest.tensors:
        if rec.name not in names:
            continue
        segs = _segments(rec)
        for seq, seg in _kept(segs, rejected) if rejected else segs:
            key = (rec.name, rec.call, seq)
            lt = out.get(key)
            if lt is None:
                lt = out[key] = LogicalTensor(rec.name, rec.call, seq, rec.layer, rec.shard_dim is not None)
            elif lt.sharded != (rec.shard_dim is not None):
                raise NotComparableError(f"{where}: {rec.name!r} is sharded on some ranks and whole on others")
            lt.by_rank.setdefault(rec.rank, []).append(seg)
    for lt in out.values():
        for rank, segs in lt.by_rank.items():
            segs.sort(key=lambda s: s.pos)
            for a, b in zip(segs, segs[1:], strict=False):
                if b.pos < a.pos + a.count:
                    raise NotComparableError(
                        f"{where}: {lt.describe()} holds token position {b.pos} twice on rank {rank} "
                        f"(passes {a.rec.forward_pass} and {b.rec.forward_pass}); cannot align"
                    )
            if lt.sharded and segs[0].rec.shard_dim != len(segs[0].rec.shape) - 1:
                raise NotComparableError(
                    f"{where}: {lt.name!r} is sharded along dim {segs[0].rec.shard_dim}; "
                    "only the last (hidden) dim can be reassembled row by row"
                )
        if lt.sharded:
            ref = lt.by_rank[lt.ranks[0]]
            for rank in lt.ranks[1:]:
                if _coverage(ref) != _coverage(lt.by_rank[rank]):
                    raise NotComparableError(
                        f"{where}: shards of {lt.describe()} hold different token positions "
                        f"on ranks {lt.ranks[0]} and {rank}; cannot join them"
                    )
            lt.rows = ref
        else:
            _merge_ranks(lt)
    return out


def positions_of(segs: list[Segment]) -> np.ndarray:
    """All positions of position-sorted segments, in order."""
    return np.concatenate([np.arange(s.pos, s.pos + s.count) for s in segs]) if segs else np.zeros(0, np.int64)


def _coverage(segs: list[Segment]) -> list[tuple[int, int]]:
    """The position intervals ``[start, end)`` that position-sorted segments cover, merged."""
    out: list[tuple[int, int]] = []
    for s in segs:
        if out and out[-1][1] == s.pos:
            out[-1] = (out[-1][0], s.pos + s.count)
        else:
            out.append((s.pos, s.pos + s.count))
    return out


def _describe(cov: list[tuple[int, int]]) -> str:
    n = sum(b - a for a, b in cov)
    return f"{cov[0][0]}..{cov[-1][1] - 1} ({n} tokens)" if cov else "no tokens"


def match_rows(base: list[Segment], target: list[Segment], what: str) -> list[RowRun]:
    """Pair two position-sorted segment lists row by row; their position sets must be equal."""
    cb, ct = _coverage(base), _coverage(target)
    if cb != ct:
        raise NotComparableError(
            f"{what}: positions {_describe(cb)} in the baseline but {_describe(ct)} in the target; cannot align"
        )
    runs: list[RowRun] = []
    i = j = 0
    ob = ot = 0  # rows of base[i] / target[j] already consumed
    while i < len(base) and j < len(target):
        b, t = base[i], target[j]
        n = min(b.count - ob, t.count - ot)
        runs.append(RowRun(b, b.row + ob, t, t.row + ot, b.pos + ob, n))
        ob += n
        ot += n
        if ob == b.count:
            i, ob = i + 1, 0
        if ot == t.count:
            j, ot = j + 1, 0
    return runs


def column_pieces(base: LogicalTensor, target: LogicalTensor) -> list[Piece]:
    """Intersect the two sides' column partitions (TP=2 vs TP=1 gives two pieces)."""
    bc, tc = base.columns(), target.columns()
    bw, tw = sum(w for _, _, w in bc), sum(w for _, _, w in tc)
    if bw != tw:
        raise NotComparableError(
            f"{base.describe()}: hidden size {bw} in the baseline but {tw} in the target "
            "(after joining shards); cannot align"
        )
    pieces: list[Piece] = []
    i = j = 0
    col = 0
    while col < bw:
        (br, b0, bwid), (tr, t0, twid) = bc[i], tc[j]
        end = min(b0 + bwid, t0 + twid)
        pieces.append(Piece(br, col - b0, tr, col - t0, end - col))
        col = end
        if col == b0 + bwid:
            i += 1
        if col == t0 + twid:
            j += 1
    return pieces


def fallback_pairs(
    baseline: Manifest, target: Manifest, names: set[str]
) -> tuple[list[tuple[TensorRecord, TensorRecord]], list[FallbackKey], list[FallbackKey]]:
    """Match the remaining records by (name, forward pass, rank, call)."""

    def key(r: TensorRecord) -> FallbackKey:
        return (r.name, r.forward_pass, r.rank, r.call)

    base = {key(r): r for r in baseline.tensors if r.name in names}
    targ = {key(r): r for r in target.tensors if r.name in names}
    pairs = [(base[k], targ[k]) for k in base if k in targ]
    return pairs, [k for k in base if k not in targ], [k for k in targ if k not in base]
