"""Row metadata of a forward pass: the token position and sequence id of every row a capture records.

A family adapter (:mod:`dumper.hooks.families`) reads them from a model's call as a
:class:`PassRows` (:class:`HFRows` for a transformers ``[batch, seq]`` call); every hidden tensor
of that pass shaped by its rows inherits them, run-length encoded once (:class:`Runs`). Rows a
sequence reused from another's prefix cache (:class:`SharedRows`) are written at the end as an
extra pass of the hit sequence's own (:func:`write_shared_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from dumper.errors import UsageError
from dumper.format import PAD_SEQUENCE, TensorRecord, decode_runs, encode_runs
from dumper.hooks.writer import ShardWriter

__all__ = ["Runs", "PassRows", "SharedRows", "HFRows", "as_runs", "shared_row_tensors", "write_shared_rows"]


@dataclass(frozen=True)
class Runs:
    """Row metadata already run-length encoded (shared by every layer of one pass)."""

    runs: list[list[int]]


def as_runs(values: Any, rows: int, what: str) -> list[list[int]] | None:
    """Row metadata given per row (tensor, array, sequence) or as :class:`Runs`, run-length encoded."""
    if values is None:
        return None
    if isinstance(values, Runs):
        return values.runs
    arr = (
        values.detach().reshape(-1).cpu().numpy()
        if isinstance(values, torch.Tensor)
        else np.asarray(values).reshape(-1)
    )
    if arr.size != rows:
        raise UsageError(f"{what} has {arr.size} entries but the tensor has {rows} rows")
    return encode_runs(arr, step=1 if what == "positions" else 0)


@dataclass
class PassRows:
    """Positions and sequence ids of the rows of one forward pass.

    A hidden tensor whose leading dims equal ``shape`` (``[batch, seq]`` for HF, ``[tokens]``
    for vLLM's flattened batch) inherits them. ``keep`` (flat row indices) selects the rows
    to record when some are not worth it (vLLM's decode tokens and padding); ``None`` keeps all.
    """

    shape: tuple[int, ...]
    positions: Runs
    sequence_ids: Runs
    keep: torch.Tensor | None = None

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [*shape, hidden] as the recorded rows [kept, hidden] (``x`` itself when all are kept)."""
        if self.keep is None:
            return x
        return x.reshape(-1, x.shape[-1]).index_select(0, self.keep.to(x.device, non_blocking=True))

    @property
    def empty(self) -> bool:
        return self.keep is not None and self.keep.numel() == 0


@dataclass(frozen=True)
class SharedRows:
    """Positions ``0 .. count-1`` of ``sequence`` reuse rows computed for ``source`` (a prefix-cache hit).

    The engine read those tokens' keys and values from ``source``'s cache blocks instead of
    computing them, so ``source``'s recorded rows are the states this sequence attended to.
    """

    sequence: int
    source: int
    count: int


@dataclass
class HFRows(PassRows):
    """Rows of a ``[batch, seq]`` pass. Padding rows keep their column index as position (one run in
    the encoding) and get sequence id :data:`PAD_SEQUENCE`, which keeps them out of every comparison."""

    pad: np.ndarray | None = None  # [batch, seq] bool, True for padding rows
    pos: np.ndarray | None = None  # [batch, seq] positions as last set
    row_ids: np.ndarray | None = None  # [batch] sequence id of each batch row
    position_ids: Any = None  # the tensor the positions were last read from (one device sync per tensor)
    end: int | None = None
    """Rows of real tokens at positions ``>= end`` are not recorded (``keep`` leaves them out; None: all are)."""

    def set_positions(self, pos: np.ndarray) -> None:
        if self.pad is not None:
            pos = np.where(self.pad, np.arange(self.shape[1])[None, :], pos)
        self.pos = np.asarray(pos)
        self._label(sequences=self.end is not None)  # which rows are kept may change with their positions

    def set_sequences(self, ids: np.ndarray) -> None:
        self.row_ids = ids
        self._label(sequences=True)

    def _label(self, *, sequences: bool) -> None:
        """Encode the labels of the recorded rows: every row, or those :attr:`end` keeps (flat indices in ``keep``)."""
        assert self.pos is not None
        kept = None
        if self.end is not None:
            past = self.pos >= self.end if self.pad is None else ~self.pad & (self.pos >= self.end)
            kept = np.flatnonzero(~past.reshape(-1)) if past.any() else None
        self.keep = None if kept is None else torch.from_numpy(kept)
        self.positions = Runs(encode_runs(self.pos if kept is None else self.pos.reshape(-1)[kept], step=1))
        if not sequences or self.row_ids is None:
            return
        row_seq = np.repeat(self.row_ids, self.shape[1]).reshape(self.shape)
        if self.pad is not None:
            row_seq = np.where(self.pad, PAD_SEQUENCE, row_seq)
        self.sequence_ids = Runs(encode_runs(row_seq if kept is None else row_seq.reshape(-1)[kept], step=0))

    def with_position_ids(self, value: Any) -> HFRows:
        """Positions from a ``position_ids`` kwarg seen by a hooked module (read once per tensor object)."""
        batch, seq = self.shape
        if value is None or value is self.position_ids or not isinstance(value, torch.Tensor) or value.shape[-1] != seq:
            return self
        self.set_positions(value.detach().reshape(-1, seq).expand(batch, seq).cpu().numpy())
        self.position_ids = value
        return self

    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per batch row: (first real position, last real position, whether the row has a real token)."""
        assert self.pos is not None
        real = np.ones(self.shape, bool) if self.pad is None else ~self.pad
        has = real.any(axis=1)
        cols = np.arange(self.shape[1])
        first = np.where(real, cols, self.shape[1]).min(axis=1).clip(max=self.shape[1] - 1)
        last = np.where(real, cols, -1).max(axis=1).clip(min=0)
        rows = np.arange(self.shape[0])
        return self.pos[rows, first], self.pos[rows, last], has


def shared_row_tensors(
    out_dir: Path, records: Sequence[TensorRecord], shared: Sequence[SharedRows]
) -> list[tuple[TensorRecord, torch.Tensor, np.ndarray, np.ndarray]]:
    """The rows each hit reused, read back from its source's records and labelled as the hit's own.

    Returns one entry per recorded (name, call): (a source record of it, rows [n, hidden],
    positions [n], sequence ids [n]). A hit whose source rows are incomplete gets none.
    """
    groups: dict[tuple[str, int], tuple[TensorRecord, list[torch.Tensor], list[np.ndarray], list[np.ndarray]]] = {}
    for hit in shared:
        found: dict[tuple[str, int], list[tuple[np.ndarray, TensorRecord, np.ndarray]]] = {}
        for rec in records:
            if rec.positions is None or rec.sequence_ids is None:
                continue
            pos, seq = decode_runs(rec.positions, step=1), decode_runs(rec.sequence_ids, step=0)
            rows = np.flatnonzero((seq == hit.source) & (pos < hit.count))
            if rows.size:
                found.setdefault((rec.name, rec.call), []).append((pos[rows], rec, rows))
        for key, parts in found.items():
            pos = np.concatenate([p for p, _, _ in parts])
            if not np.array_equal(np.sort(pos), np.arange(hit.count)):
                continue
            order = torch.from_numpy(np.argsort(pos, kind="stable"))
            rows = torch.cat([_read_rows(out_dir, rec, r) for _, rec, r in parts]).index_select(0, order)
            group = groups.setdefault(key, (parts[0][1], [], [], []))
            group[1].append(rows)
            group[2].append(np.arange(hit.count, dtype=np.int64))
            group[3].append(np.full(hit.count, hit.sequence, dtype=np.int64))
    return [(rec, torch.cat(t), np.concatenate(p), np.concatenate(q)) for rec, t, p, q in groups.values()]


def _read_rows(out_dir: Path, rec: TensorRecord, rows: np.ndarray) -> torch.Tensor:
    with safe_open(str(out_dir / rec.file), framework="pt") as f:
        t = f.get_tensor(rec.key)
    return t.reshape(-1, t.shape[-1]).index_select(0, torch.from_numpy(rows))


def write_shared_rows(
    out_dir: Path,
    records: Sequence[TensorRecord],
    shared: Sequence[SharedRows],
    *,
    rank: int,
    forward_pass: int,
    shard_bytes: int,
) -> tuple[tuple[TensorRecord, ...], dict[str, int]]:
    """Write the rows prefix-cache hits reused as the hit sequences' own, in one extra pass ``forward_pass``.

    Returns the new records (``meta`` says ``shared_prefix``) and the data files they are in;
    both empty when no hit's source rows are complete, so that a hit's positions are complete.
    """
    found = shared_row_tensors(out_dir, records, shared)
    if not found:
        return (), {}
    writer = ShardWriter(out_dir, rank, shard_bytes=shard_bytes)
    out = []
    for rec, rows, pos, seq in found:
        key = rec.name if rec.call == 0 else f"{rec.name}#{rec.call}"
        writer.put(forward_pass, key, rows)
        out.append(
            replace(
                rec,
                key=key,
                shape=tuple(int(s) for s in rows.shape),
                forward_pass=forward_pass,
                positions=as_runs(pos, len(pos), "positions"),
                sequence_ids=as_runs(seq, len(seq), "sequence_ids"),
                meta={**rec.meta, "shared_prefix": True},
            )
        )
    writer.close()
    return tuple(replace(r, file=writer.locations[(forward_pass, r.key)]) for r in out), dict(writer.files)
