"""Per-row noise: the benign per-token rel_diff of every calibrated (sequence, position) row of each tensor.

On a trained model a few rows (the first tokens, delimiters: the massive-activation rows) carry
far more benign noise than the rest, so one number per tensor (the pooled per-token max) lets a
single-token bug through on every other row. A calibration re-runs the baseline's own prompts, so
each row's noise is known: ``python -m comparator calibrate`` keeps it (the largest value over the
variants) in a side file next to NOISE.json, ``NOISE.rows.safetensors``, and a row it covered is
judged against ``factor x max(its own noise, the tensor's floor)``.

The floor is the median of the tensor's row noise (:data:`FLOOR_QUANTILE`). A row's maximum over
a few variants is an estimate from a few draws: a row that happened to round the same way in every
variant has noise 0, and another benign variant rounds it differently. The median is what a typical
row of that tensor measured, so a row is never held tighter than that; the outlier rows above it
keep their own, larger noise. (The ninetieth percentile was measured too: docs/calibration.md.)

Rows are bound to the calibration's prompts: row ``(s, p)`` is covered only when the calibration's
token ids of sequence ``s`` up to ``p`` equal the baseline's and the target's (a causal row depends
on exactly those); any other row, and every decode row, is judged by the tensor's pooled noise.

The side file is untrusted input, like NOISE.json: NOISE.json names it (a plain file name beside
it) with its SHA-256, and :func:`rows_from_file` reads it bounded, checks the hash, and refuses
any key, dtype, shape or value outside the format, naming the file.

Layout (safetensors): ``ids.{s}`` int64 ``[n]``: the calibration's token ids of sequence ``s``;
``rows.{k}`` int64 ``[n, 2]``: a row table of (sequence, position) pairs, strictly increasing;
``noise.{name}`` float32 ``[n]``: one tensor's noise of each row of its table (NOISE.json's
``rows.tensors`` says which table).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from comparator.judging.fields import REL_DIFF_MAX, bad, integer, items, record, text
from dumper.errors import UsageError
from dumper.format.files import is_plain_name, show

__all__ = [
    "ROWS_SUFFIX",
    "FLOOR_QUANTILE",
    "Holdout",
    "holdout",
    "RowNoise",
    "RowNoiseSet",
    "RowKeys",
    "row_keys",
    "packed",
    "covered",
    "rows_to_bytes",
    "rows_from_bytes",
    "RowsRef",
    "covered_prefix",
]

ROWS_SUFFIX: Final = ".rows.safetensors"
"""The side file of ``NOISE.json`` is ``NOISE.rows.safetensors``."""
FLOOR_QUANTILE: Final = 0.5
"""A covered row's noise is at least this quantile (the median) of its tensor's row noise (the module doc)."""
_REF_KEYS = ("file", "sha256", "tensors")
_HOLDOUT_KEYS = ("ratio", "tensor", "sequence", "position", "variant")


@dataclass(frozen=True)
class Holdout:
    """The calibration's own test of its row noise: each variant held out against the row noise of the others.

    ``ratio`` is the largest held-out row's per-token rel_diff over ``max(the others' noise of that row, the
    tensor's row floor)``, at ``tensor``, ``sequence``, ``position``, of the variant with index ``variant``. Over
    the noise factor, a layout outside the calibration can fail by row noise (docs/calibration.md, "Row noise").
    Only variants that differ from the baseline are held out, and only with another such variant."""

    ratio: float
    tensor: str
    sequence: int
    position: int
    variant: int

    def to_json(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "tensor": self.tensor,
            "sequence": self.sequence,
            "position": self.position,
            "variant": self.variant,
        }

    @classmethod
    def from_json(cls, v: Any, where: str, names: set[str], variants: int) -> Holdout:
        d = record(v, where, "rows.holdout", _HOLDOUT_KEYS)
        tensor = text(d["tensor"], where, "rows.holdout.tensor", name=True)
        if tensor not in names:
            raise bad(where, "rows.holdout.tensor", "a tensor of the file's tensors", tensor)
        variant = integer(d["variant"], where, "rows.holdout.variant")
        if variant >= variants:
            raise bad(where, "rows.holdout.variant", f"a variant index below {variants}", variant)
        from comparator.judging.fields import number

        return cls(
            number(d["ratio"], where, "rows.holdout.ratio"),
            tensor,
            integer(d["sequence"], where, "rows.holdout.sequence"),
            integer(d["position"], where, "rows.holdout.position"),
            variant,
        )


def holdout(parts: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray, int]]]) -> Holdout | None:
    """:class:`Holdout` from each tensor's (packed keys, values, variant index) parts; None without two variants
    that differ from the baseline."""
    best: Holdout | None = None
    for name, chunks in parts.items():
        differ = [(k, v, i) for k, v, i in chunks if v.any()]  # a bit-identical variant measures nothing
        variants = sorted({i for _, _, i in differ})
        if len(variants) < 2:
            continue
        keys = np.unique(np.concatenate([k for k, _, _ in differ]))
        table = np.zeros((len(variants), keys.size))  # each variant's value of each row (0: not there)
        for k, v, i in differ:
            np.maximum.at(table[variants.index(i)], np.searchsorted(keys, k), v)
        for j, held in enumerate(variants):
            others = np.delete(table, j, axis=0).max(axis=0)
            ref = np.maximum(others, float(np.quantile(others, FLOOR_QUANTILE)))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(ref > 0, table[j] / ref, np.where(table[j] == 0, 0.0, np.inf))
            r = int(np.argmax(ratio))
            if best is None or ratio[r] > best.ratio:
                key = int(keys[r])
                best = Holdout(float(min(ratio[r], 1e300)), name, key >> 32, key & 0xFFFFFFFF, held)
    return best


RowKeys = tuple[np.ndarray, np.ndarray]
"""Each row's (sequence ids, positions), int64."""


def row_keys(positions: np.ndarray | None, sequences: np.ndarray | None, sequence: int | None) -> RowKeys | None:
    """The (sequence, position) of each row of one comparison, or None when its rows carry no position."""
    if positions is None:
        return None
    pos = np.asarray(positions, dtype=np.int64)
    if sequences is not None:
        return np.asarray(sequences, dtype=np.int64), pos
    if sequence is None:
        return None
    return np.full(pos.shape, sequence, dtype=np.int64), pos


def packed(seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """One sortable int64 per (sequence, position); both are below 2^31 where it is used."""
    return (seq.astype(np.int64) << 32) | pos.astype(np.int64)


def covered(keys: RowKeys, cover: Sequence[int]) -> np.ndarray:
    """Which rows ``cover`` (per sequence, the leading positions whose token ids agree) covers."""
    seq, pos = keys
    limit = np.asarray(cover, dtype=np.int64)
    ok = (seq >= 0) & (seq < limit.size) & (pos >= 0)
    ok[ok] &= pos[ok] < limit[seq[ok]]
    return ok


@dataclass(frozen=True, eq=False)
class RowNoise:
    """One tensor's row noise: the rows (packed and sorted) and each row's largest benign per-token rel_diff."""

    keys: np.ndarray
    values: np.ndarray
    floor: float
    """:data:`FLOOR_QUANTILE` of ``values``: no covered row is judged tighter than this."""

    @classmethod
    def of(cls, keys: np.ndarray, values: np.ndarray) -> RowNoise:
        return cls(keys, values, float(np.quantile(values, FLOOR_QUANTILE)) if values.size else 0.0)

    def own(self, keys: RowKeys, cover: Sequence[int]) -> np.ndarray:
        """Each row's noise (float64), NaN where the calibration does not cover it (see the module doc)."""
        seq, pos = keys
        ok = covered(keys, cover)
        out = np.full(seq.shape, np.nan)
        if not ok.any() or not self.keys.size:
            return out
        wanted = packed(seq[ok], pos[ok])
        at = np.minimum(np.searchsorted(self.keys, wanted), self.keys.size - 1)
        hit = self.keys[at] == wanted
        sub = np.full(wanted.shape, np.nan)
        sub[hit] = self.values[at[hit]]
        out[ok] = sub
        return out


def covered_prefix(prompts: Sequence[Sequence[int]], *others: Sequence[Sequence[int]]) -> list[int]:
    """Per sequence of ``prompts``, how many leading token ids every one of ``others`` shares with it."""
    out = []
    for s, ids in enumerate(prompts):
        n = len(ids)
        for other in others:
            theirs = other[s] if s < len(other) else []
            m = min(n, len(theirs))
            a, b = np.asarray(ids[:m], dtype=np.int64), np.asarray(theirs[:m], dtype=np.int64)
            diff = np.flatnonzero(a != b)
            n = int(diff[0]) if diff.size else m
        out.append(n)
    return out


@dataclass(frozen=True)
class RowsRef:
    """What NOISE.json says of its side file: its plain name, SHA-256, and each tensor's row table."""

    file: str
    sha256: str
    tensors: Mapping[str, int]
    holdout: Holdout | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "sha256": self.sha256,
            "tensors": [[n, k] for n, k in self.tensors.items()],
            **({"holdout": self.holdout.to_json()} if self.holdout is not None else {}),
        }

    @classmethod
    def from_json(cls, v: Any, where: str, names: set[str], variants: int) -> RowsRef:
        """NOISE.json's ``rows`` entry, exact types; every tensor it lists is one of the file's ``names``."""
        d = record(v, where, "rows", _REF_KEYS, ("holdout",))
        name = text(d["file"], where, "rows.file")
        if not is_plain_name(name) or not name.endswith(ROWS_SUFFIX):
            raise bad(where, "rows.file", f"a plain file name ending in {ROWS_SUFFIX} (beside the noise file)", name)
        digest = text(d["sha256"], where, "rows.sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise bad(where, "rows.sha256", "64 lowercase hex digits", digest)
        tensors: dict[str, int] = {}
        for i, e in enumerate(items(d["tensors"], where, "rows.tensors")):
            pair = items(e, where, f"rows.tensors[{i}]", length=None)
            if len(pair) != 2:
                raise bad(where, f"rows.tensors[{i}]", "[tensor name, row table]", e)
            n = text(pair[0], where, f"rows.tensors[{i}][0]", name=True)
            if n not in names or n in tensors:
                raise bad(where, f"rows.tensors[{i}][0]", "a tensor of the file's tensors, listed once", n)
            tensors[n] = integer(pair[1], where, f"rows.tensors[{i}][1]")
        held = None if "holdout" not in d else Holdout.from_json(d["holdout"], where, names, variants)
        return cls(name, digest, tensors, held)


@dataclass(frozen=True, eq=False)
class RowNoiseSet:
    """Every tensor's row noise, and the token ids of the prompts the calibration ran."""

    prompts: tuple[tuple[int, ...], ...]
    tensors: Mapping[str, RowNoise]
    tables: Mapping[str, int] = field(default_factory=dict)
    """Which row table of the side file each tensor's rows are (tensors with the same rows share one)."""
    holdout: Holdout | None = None
    """The calibration's held-out test of its own row noise (kept in NOISE.json)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowNoiseSet):
            return NotImplemented
        return (
            self.prompts == other.prompts
            and self.tensors.keys() == other.tensors.keys()
            and all(
                np.array_equal(a.keys, other.tensors[n].keys) and np.array_equal(a.values, other.tensors[n].values)
                for n, a in self.tensors.items()
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def bytes_per_row(self) -> float:
        """Side-file bytes per (row, tensor): the noise value and the tensor's share of its row table."""
        rows = sum(t.values.size for t in self.tensors.values())
        return (4 * rows + 16 * sum(self._table_sizes().values())) / rows if rows else 0.0

    def _table_sizes(self) -> dict[int, int]:
        return {k: self.tensors[n].keys.size for n, k in self.tables.items()}

    @classmethod
    def build(
        cls,
        prompts: Sequence[Sequence[int]],
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
        held: Holdout | None = None,
    ) -> RowNoiseSet:
        """From each tensor's packed row keys and values (any order, duplicates: the largest value kept)."""
        tensors: dict[str, RowNoise] = {}
        tables: dict[str, int] = {}
        seen: dict[bytes, int] = {}
        for name, (keys, values) in rows.items():
            order = np.lexsort((-values.astype(np.float64), keys))
            k, v = keys[order], values[order].astype(np.float32)
            first = np.ones(k.size, dtype=bool)
            first[1:] = k[1:] != k[:-1]  # sorted by key, then largest value first: keep the first of each key
            k, v = k[first], v[first]
            tables[name] = seen.setdefault(k.tobytes(), len(seen))
            tensors[name] = RowNoise.of(k, v)
        return cls(tuple(tuple(int(t) for t in p) for p in prompts), tensors, tables, held)


def rows_to_bytes(rows: RowNoiseSet) -> bytes:
    """The side file's bytes (safetensors, the layout of the module doc)."""
    from safetensors.numpy import save

    arrays: dict[str, np.ndarray] = {f"ids.{s}": np.asarray(p, dtype=np.int64) for s, p in enumerate(rows.prompts)}
    for name, k in rows.tables.items():
        keys = rows.tensors[name].keys
        arrays.setdefault(f"rows.{k}", np.stack([keys >> 32, keys & 0xFFFFFFFF], axis=1).astype(np.int64))
        arrays[f"noise.{name}"] = rows.tensors[name].values.astype(np.float32)
    return save(arrays)


def _header_keys(data: bytes, where: str) -> list[str]:
    """The tensor keys of safetensors bytes, read from its JSON header (bounded by the bytes themselves)."""
    if len(data) < 8:
        raise UsageError(f"{where}: truncated: {len(data)} bytes, not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise UsageError(f"{where}: truncated: its header claims {n} bytes, {len(data) - 8} follow")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"{where}: not a safetensors file (its header is not JSON)") from None
    if type(header) is not dict:
        raise UsageError(f"{where}: not a safetensors file (its header is not an object)")
    return [k for k in header if k != "__metadata__"]


def rows_from_bytes(data: bytes, ref: RowsRef, where: str) -> RowNoiseSet:
    """The side file's bytes checked against ``ref`` (hash, keys, dtypes, shapes, values); one-line UsageError."""
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise UsageError(
            f"{where}: its SHA-256 is not the one the noise file records: another calibration's or "
            "a changed file; recalibrate (python -m comparator calibrate)"
        )
    keys = _header_keys(data, where)
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        arrays = load(data)
    except (SafetensorError, ValueError, TypeError) as e:
        raise UsageError(f"{where}: not a valid safetensors file ({str(e).splitlines()[0][:200]})") from None
    tables = sorted(set(ref.tensors.values()))
    expected = {f"rows.{k}" for k in tables} | {f"noise.{n}" for n in ref.tensors}
    ids = sorted(k for k in keys if k.startswith("ids."))
    prompts = []
    for s in range(len(ids)):
        a = arrays.get(f"ids.{s}")
        if a is None or a.dtype != np.int64 or a.ndim != 1 or (a.size and a.min() < 0):
            raise UsageError(
                f"{where}: ids.{s}: expected int64 token ids >= 0, one list per sequence 0..{len(ids) - 1}"
            )
        prompts.append(tuple(int(t) for t in a))
    unknown = [k for k in keys if k not in expected and not k.startswith("ids.")]
    missing = sorted(expected - set(keys))
    if unknown or missing:
        raise UsageError(
            f"{where}: keys {'unknown: ' + show(unknown[:3]) if unknown else ''}"
            f"{'; ' if unknown and missing else ''}{'missing: ' + show(missing[:3]) if missing else ''}"
            " (not the rows of this noise file)"
        )
    table_keys: dict[int, np.ndarray] = {}
    for k in tables:
        t = arrays[f"rows.{k}"]
        if t.dtype != np.int64 or t.ndim != 2 or t.shape[1] != 2:
            raise UsageError(f"{where}: rows.{k}: expected int64 of shape [rows, 2], got {t.dtype} {list(t.shape)}")
        if t.size and (t.min() < 0 or t.max() >= 1 << 31):
            raise UsageError(f"{where}: rows.{k}: sequence ids and positions must be in [0, 2^31)")
        p = packed(t[:, 0], t[:, 1])
        if p.size > 1 and not np.all(p[1:] > p[:-1]):
            raise UsageError(f"{where}: rows.{k}: rows must be strictly increasing (sequence, position) pairs")
        if p.size and int(t[:, 0].max()) >= len(prompts):
            raise UsageError(
                f"{where}: rows.{k}: a row of sequence {int(t[:, 0].max())}, but the file holds the "
                f"token ids of {len(prompts)} sequences"
            )
        if p.size and np.any(t[:, 1] >= np.asarray([len(prompts[s]) for s in t[:, 0]])):
            raise UsageError(f"{where}: rows.{k}: a row past its sequence's token ids")
        table_keys[k] = p
    tensors = {}
    for name, k in ref.tensors.items():
        v = arrays[f"noise.{name}"]
        if v.dtype != np.float32 or v.shape != (table_keys[k].size,):
            raise UsageError(
                f"{where}: noise.{name}: expected float32 of shape [{table_keys[k].size}] (its row table), "
                f"got {v.dtype} {list(v.shape)}"
            )
        if not np.all((v >= 0) & (v <= REL_DIFF_MAX)):  # NaN fails this too
            raise UsageError(
                f"{where}: noise.{name}: every value must be a rel_diff in [0, {REL_DIFF_MAX:g}] "
                "(NaN, Inf and negative values are not noise)"
            )
        tensors[name] = RowNoise.of(table_keys[k], v)
    return RowNoiseSet(tuple(prompts), tensors, dict(ref.tensors), ref.holdout)
