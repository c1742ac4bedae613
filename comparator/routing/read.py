"""One dump's routing records, one MoE layer at a time, as rows keyed by (sequence, position).

The records are those of the ``router`` capture point (:data:`dumper.format.ROUTER_POINT`,
:data:`~dumper.format.ROUTER_CHOICE_POINT`). A layer is read only when it is compared, and only its
routing rows (``[tokens, experts]`` floats at most), so two whole dumps are never held in memory.
Padding rows are dropped; a (sequence, position) recorded twice (a replicated TP rank, a
recomputed token) keeps its first row in (pass, rank, call) order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dumper.errors import CorruptDumpError, NotComparableError
from dumper.format import (PAD_SEQUENCE, ROUTER_IDS, ROUTER_LOGITS, ROUTER_POINTS, ROUTER_SCORES, ROUTER_WEIGHTS,
                           DumpReader, TensorRecord, to_float64)

__all__ = ["PARTS", "LayerRecords", "LayerRows", "row_key", "key_parts", "router_records", "read_layer"]

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
    """(groups, groups kept) of a grouped top-k on the scores (DeepSeek-V3), from the scores' meta; None: plain top-k."""


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
            raise NotComparableError(f"{reader.directory}: layer {layer} records routing without {missing[0]} "
                                     f"({entry.prefix}.{missing[0]}); a router capture records logits, ids and weights")
        for part, recs in entry.parts.items():
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
                    "and top-k are the same in every record")
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
        raise NotComparableError(f"{where}: {rec.name} (pass {rec.forward_pass}) records no positions or sequence "
                                 "ids; routing is compared token by token")
    return np.where(seq == PAD_SEQUENCE, -1, row_key(seq, pos))


def _stack(reader: DumpReader, recs: Iterable[TensorRecord], floats: bool) -> tuple[np.ndarray, np.ndarray]:
    """Keys and rows of one part over its records (float64 for values, int64 for ids)."""
    keys, rows = [], []
    for rec in recs:
        keys.append(_keys(rec, str(reader.directory)))
        a = reader.rows(rec)
        rows.append(to_float64(a, rec.dtype) if floats else np.asarray(a, dtype=np.int64))
    return np.concatenate(keys), np.concatenate(rows)


def read_layer(reader: DumpReader, entry: LayerRecords) -> LayerRows:
    """The layer's rows, keyed, padding dropped, the first row of each key kept."""
    where = f"{reader.directory}: layer {entry.layer} routing"
    keys, ids = _stack(reader, entry.parts[ROUTER_IDS], floats=False)
    parts = {p: _stack(reader, entry.parts[p], floats=True) for p in (ROUTER_WEIGHTS, ROUTER_LOGITS, ROUTER_SCORES)
             if p in entry.parts}
    for p, (k, _rows) in parts.items():
        if not np.array_equal(k, keys):
            raise NotComparableError(f"{where}: {p} covers other rows than {ROUTER_IDS}")
    if parts[ROUTER_WEIGHTS][1].shape != ids.shape:
        raise NotComparableError(f"{where}: weights {parts[ROUTER_WEIGHTS][1].shape} and ids {ids.shape} differ in shape")
    experts = parts[ROUTER_LOGITS][1].shape[1]
    if ids.size and (ids.min() < 0 or ids.max() >= experts):
        raise NotComparableError(f"{where}: an expert id outside 0..{experts - 1}")
    real = keys >= 0
    _check_distinct(keys, ids, real, where)
    uniq, first = np.unique(keys[real], return_index=True)
    index = np.flatnonzero(real)[first]
    scores = parts.get(ROUTER_SCORES)
    return LayerRows(keys=uniq, ids=ids[index], weights=parts[ROUTER_WEIGHTS][1][index],
                     logits=parts[ROUTER_LOGITS][1][index], scores=scores[1][index] if scores else None,
                     groups=_groups(entry, experts, where) if scores else None)


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
        raise CorruptDumpError(f"{where}: the row of sequence {seq}, position {pos} chooses expert {twice} twice "
                               f"({ids[r].tolist()}; {dup.size} such row{'s' if dup.size > 1 else ''}); "
                               "a top-k picks distinct experts")


def _groups(entry: LayerRecords, experts: int, where: str) -> tuple[int, int] | None:
    """The grouped top-k the scores' meta describes (``n_group``, ``topk_group``), checked against the experts."""
    meta = entry.parts[ROUTER_SCORES][0].meta
    if "n_group" not in meta and "topk_group" not in meta:
        return None
    groups, keep = meta.get("n_group"), meta.get("topk_group")
    if (type(groups) is not int or type(keep) is not int or not 0 < keep <= groups or experts % groups
            or experts // groups < 2):
        raise NotComparableError(f"{where}: scores meta n_group={groups!r}, topk_group={keep!r} is not a grouped "
                                 f"top-k over {experts} experts")
    return groups, keep
