"""One dump's routing records, one MoE layer at a time, as rows keyed by (sequence, position).

The records are those of the ``router`` capture point (:data:`dumper.format.ROUTER_POINT`,
:data:`~dumper.format.ROUTER_CHOICE_POINT`). A layer is read only when it is compared, and only its
routing rows (``[tokens, experts]`` floats at most), so two whole dumps are never held in memory.
Padding rows are dropped; a (sequence, position) recorded twice (a replicated TP rank, a
recomputed token) keeps its first row in (pass, rank, call) order. The router is replicated under
tensor parallelism, so each rank's rows of a pass must equal the lowest rank's bit for bit:
:func:`read_layer` also says which ranks' rows differ (:class:`RankDifference`), the way
:mod:`comparator.hidden.replicas` does for hidden states.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dumper.errors import CorruptDumpError, NotComparableError
from dumper.format.manifest import (
    PAD_SEQUENCE,
    ROUTER_IDS,
    ROUTER_LOGITS,
    ROUTER_POINTS,
    ROUTER_SCORES,
    ROUTER_WEIGHTS,
    TensorRecord,
)
from dumper.format.reader import DumpReader, to_float64

__all__ = [
    "PARTS",
    "LayerRecords",
    "LayerRows",
    "RankDifference",
    "row_key",
    "key_parts",
    "router_records",
    "read_layer",
]

PARTS = (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS, ROUTER_SCORES)
"""The routing parts of a layer, in the order they are described in :mod:`dumper.format.manifest`."""
_REQUIRED = (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS)


@dataclass
class LayerRecords:
    """Every record of one MoE layer's routing, by part."""

    layer: int
    prefix: str
    parts: dict[str, list[TensorRecord]]

    def dtype(self) -> str:
        """The storage dtype of the router logits (what the router computed in)."""
        return self.parts[ROUTER_LOGITS][0].dtype

    @property
    def experts(self) -> int:
        """The layer's expert count (every logits record's last dim: :func:`router_records` checked them)."""
        return self.parts[ROUTER_LOGITS][0].shape[-1]

    @property
    def top_k(self) -> int:
        """The experts each row chooses (every ids and weights record's last dim)."""
        return self.parts[ROUTER_IDS][0].shape[-1]


@dataclass
class LayerRows:
    """One side's routing rows of one layer: keys sorted, one row per key."""

    keys: np.ndarray
    """:func:`row_key` of each row (int64), sorted, unique."""
    ids: np.ndarray
    weights: np.ndarray
    logits: np.ndarray
    scores: np.ndarray | None
    groups: tuple[int, int] | None = None
    """(groups, groups kept) of a grouped top-k on the scores (DeepSeek-V3), from the scores' meta; None: plain
    top-k."""
    rank_differences: tuple[RankDifference, ...] = ()
    """Ranks whose rows of a pass differ from the lowest rank's rows of the same tokens (rank order)."""


@dataclass(frozen=True)
class RankDifference:
    """A rank whose routing rows differ from those of the lowest rank that recorded the same tokens in the
    same pass: a replicated router that chose differently on one rank (its rows are not the ones compared)."""

    rank: int
    reference_rank: int
    key: int
    """:func:`row_key` of the first differing row in (sequence, position) order."""
    ids: tuple[int, ...]
    """This rank's experts at that row."""
    reference_ids: tuple[int, ...]
    rows: int
    """How many of this rank's rows differ."""
    parts: tuple[str, ...]
    """Which parts differ anywhere on this rank (of :data:`PARTS`, in that order)."""
    weight_max_diff: float
    """Largest |Δw| slot by slot over the differing rows (NaN where a weight is NaN on one side only)."""


def _part_of(rec: TensorRecord) -> tuple[str, str] | None:
    """(prefix, part) of a routing record, None for any other record."""
    if rec.point not in ROUTER_POINTS or rec.layer is None:
        return None
    for part in PARTS:
        if rec.name.endswith("." + part):
            return rec.name[: -len(part) - 1], part
    return None


def router_records(reader: DumpReader) -> dict[int, LayerRecords]:
    """The routing records of a dump by layer; a layer missing logits, ids or weights is refused."""
    out: dict[int, LayerRecords] = {}
    for rec in reader.manifest.tensors:
        found = _part_of(rec)
        if found is None:
            continue
        prefix, part = found
        entry = out.setdefault(rec.layer, LayerRecords(rec.layer, prefix, {}))  # type: ignore[arg-type]
        entry.parts.setdefault(part, []).append(rec)
    for layer, entry in out.items():
        missing = [p for p in _REQUIRED if p not in entry.parts]
        if missing:
            raise NotComparableError(
                f"{reader.directory}: layer {layer} records routing without {missing[0]} "
                f"({entry.prefix}.{missing[0]}); a router capture records logits, ids and weights"
            )
        for recs in entry.parts.values():
            recs.sort(key=lambda r: (r.forward_pass, r.rank, r.call))
        _check_widths(entry, f"{reader.directory}: layer {layer} routing")
    return dict(sorted(out.items()))


def _check_widths(entry: LayerRecords, where: str) -> None:
    """Every record of a part has the same last dim: logits and scores the expert count E, ids and weights
    the top-k k, with 1 <= k <= E; refused in one line before any data is read."""
    widths: dict[str, int] = {}
    for part, recs in entry.parts.items():
        first = recs[0]
        for rec in recs:
            if not rec.shape:
                raise NotComparableError(f"{where}: {rec.name} (pass {rec.forward_pass}) is a scalar, not rows")
            if rec.shape[-1] != first.shape[-1]:
                raise NotComparableError(
                    f"{where}: {part} has {first.shape[-1]} columns in pass {first.forward_pass} (rank {first.rank}) "
                    f"but {rec.shape[-1]} in pass {rec.forward_pass} (rank {rec.rank}); a layer's expert count "
                    "and top-k are the same in every record"
                )
        widths[part] = first.shape[-1]
    experts, k = widths[ROUTER_LOGITS], widths[ROUTER_IDS]
    for part, want in ((ROUTER_SCORES, experts), (ROUTER_WEIGHTS, k)):
        if part in widths and widths[part] != want:
            base = ROUTER_LOGITS if part == ROUTER_SCORES else ROUTER_IDS
            raise NotComparableError(f"{where}: {part} has {widths[part]} columns but {base} {want}")
    if not 1 <= k <= experts:
        raise NotComparableError(f"{where}: rows choose {k} experts out of {experts}; a top-k picks 1 to E of them")


def row_key(sequence: Any, position: Any) -> Any:
    """The key a routing row is matched by: ``sequence << 32 | position`` (ints or int64 arrays)."""
    return (np.asarray(sequence, dtype=np.int64) << 32) | np.asarray(position, dtype=np.int64)


def key_parts(key: Any) -> tuple[int, int]:
    """(sequence, position) of one :func:`row_key`."""
    return int(key) >> 32, int(key) & 0xFFFFFFFF


def _keys(rec: TensorRecord, where: str) -> np.ndarray:
    pos, seq = rec.row_positions(), rec.row_sequence_ids()
    if pos is None or seq is None:
        raise NotComparableError(
            f"{where}: {rec.name} (pass {rec.forward_pass}) records no positions or sequence "
            "ids; routing is compared token by token"
        )
    return np.where(seq == PAD_SEQUENCE, -1, row_key(seq, pos))


def _stack(reader: DumpReader, recs: Iterable[TensorRecord], floats: bool) -> tuple[np.ndarray, ...]:
    """Keys, rows, ranks and forward passes of one part's rows over its records (float64 for values, int64 ids)."""
    keys = []
    rows = []
    ranks = []
    passes = []
    for rec in recs:
        keys.append(_keys(rec, str(reader.directory)))
        a = reader.rows(rec)
        rows.append(to_float64(a, rec.dtype) if floats else np.asarray(a, dtype=np.int64))
        ranks.append(np.full(keys[-1].size, rec.rank, dtype=np.int64))
        passes.append(np.full(keys[-1].size, rec.forward_pass, dtype=np.int64))
    return tuple(np.concatenate(x) for x in (keys, rows, ranks, passes))


def _same_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: every value equal (NaN equal to NaN: the same bits of a replicated computation)."""
    return ((a == b) | (np.isnan(a) & np.isnan(b))).all(axis=1) if a.dtype.kind == "f" else (a == b).all(axis=1)


def _rank_differences(
    keys: np.ndarray, ranks: np.ndarray, passes: np.ndarray, parts: dict[str, np.ndarray]
) -> tuple[RankDifference, ...]:
    """Each rank's rows against the lowest rank's rows of the same (pass, sequence, position)."""
    real = np.flatnonzero(keys >= 0)
    order = real[np.lexsort((ranks[real], keys[real], passes[real]))]
    if order.size < 2:
        return ()
    k, p = keys[order], passes[order]
    start = np.r_[True, (k[1:] != k[:-1]) | (p[1:] != p[:-1])]
    ref = order[np.flatnonzero(start)][np.cumsum(start) - 1]  # each row's group's lowest-rank row
    other = ranks[order] != ranks[ref]
    rows, refs = order[other], ref[other]
    differs = {part: ~_same_rows(v[rows], v[refs]) for part, v in parts.items()}
    bad = np.logical_or.reduce(list(differs.values()))
    out = []
    for rank in np.unique(ranks[rows[bad]]):
        mine = bad & (ranks[rows] == rank)
        first = np.flatnonzero(mine)[np.argmin(keys[rows[mine]])]
        w = parts[ROUTER_WEIGHTS]
        out.append(
            RankDifference(
                rank=int(rank),
                reference_rank=int(ranks[refs[first]]),
                key=int(keys[rows[first]]),
                ids=tuple(int(i) for i in parts[ROUTER_IDS][rows[first]]),
                reference_ids=tuple(int(i) for i in parts[ROUTER_IDS][refs[first]]),
                rows=int(np.count_nonzero(mine)),
                parts=tuple(part for part in PARTS if part in differs and differs[part][mine].any()),
                weight_max_diff=float(np.max(np.abs(w[rows[mine]] - w[refs[mine]]))),
            )
        )
    return tuple(out)


def read_layer(reader: DumpReader, entry: LayerRecords) -> LayerRows:
    """The layer's rows, keyed, padding dropped, the first row of each key kept."""
    where = f"{reader.directory}: layer {entry.layer} routing"
    keys, ids, ranks, passes = _stack(reader, entry.parts[ROUTER_IDS], floats=False)
    parts = {
        p: _stack(reader, entry.parts[p], floats=True)[:2]
        for p in (ROUTER_WEIGHTS, ROUTER_LOGITS, ROUTER_SCORES)
        if p in entry.parts
    }
    for p, (k, _rows) in parts.items():
        if not np.array_equal(k, keys):
            raise NotComparableError(f"{where}: {p} covers other rows than {ROUTER_IDS}")
    if parts[ROUTER_WEIGHTS][1].shape != ids.shape:
        raise NotComparableError(
            f"{where}: weights {parts[ROUTER_WEIGHTS][1].shape} and ids {ids.shape} differ in shape"
        )
    experts = parts[ROUTER_LOGITS][1].shape[1]
    if ids.size and (ids.min() < 0 or ids.max() >= experts):
        raise NotComparableError(f"{where}: an expert id outside 0..{experts - 1}")
    real = keys >= 0
    _check_distinct(keys, ids, real, where)
    uniq, first = np.unique(keys[real], return_index=True)
    index = np.flatnonzero(real)[first]
    scores = parts.get(ROUTER_SCORES)
    return LayerRows(
        keys=uniq,
        ids=ids[index],
        weights=parts[ROUTER_WEIGHTS][1][index],
        logits=parts[ROUTER_LOGITS][1][index],
        scores=scores[1][index] if scores else None,
        groups=_groups(entry, experts, where) if scores else None,
        rank_differences=_rank_differences(
            keys, ranks, passes, {ROUTER_IDS: ids, **{p: v for p, (_, v) in parts.items()}}
        ),
    )


def _check_distinct(keys: np.ndarray, ids: np.ndarray, real: np.ndarray, where: str) -> None:
    """Refuse a (non-padding) row that chooses one expert twice, naming it: a top-k picks distinct experts, and
    forcing or comparing such a row would count one expert's weight twice."""
    if ids.shape[1] < 2:
        return
    rows = np.flatnonzero(real)
    s = np.sort(ids[rows], axis=1)
    dup = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
    if dup.size:
        r = rows[dup[0]]
        seq, pos = key_parts(keys[r])
        twice = int(s[dup[0], 1:][s[dup[0], 1:] == s[dup[0], :-1]][0])
        raise CorruptDumpError(
            f"{where}: the row of sequence {seq}, position {pos} chooses expert {twice} twice "
            f"({ids[r].tolist()}; {dup.size} such row{'s' if dup.size > 1 else ''}); "
            "a top-k picks distinct experts"
        )


def _groups(entry: LayerRecords, experts: int, where: str) -> tuple[int, int] | None:
    """The grouped top-k the scores' meta describes (``n_group``, ``topk_group``), checked against the experts."""
    meta = entry.parts[ROUTER_SCORES][0].meta
    if "n_group" not in meta and "topk_group" not in meta:
        return None
    groups, keep = meta.get("n_group"), meta.get("topk_group")
    if (
        type(groups) is not int
        or type(keep) is not int
        or not 0 < keep <= groups
        or experts % groups
        or experts // groups < 2
    ):
        raise NotComparableError(
            f"{where}: scores meta n_group={groups!r}, topk_group={keep!r} is not a grouped "
            f"top-k over {experts} experts"
        )
    return groups, keep
