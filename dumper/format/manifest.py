"""The dump manifest: its schema, the tensor records, and the one encoding of row metadata.

``manifest.json`` is the index of a dump (see :mod:`dumper.format` for the layout): the model,
the capture signature that decides comparability, the environment, every data file with its
byte size, and one :class:`TensorRecord` per captured tensor with its canonical name, file,
shape, dtype, layer index, forward-pass index, rank, and the absolute token position and
sequence id of each row. Row metadata is run-length encoded (``[[start, count], ...]``) by
:func:`encode_runs` and decoded by :func:`decode_runs`, here and nowhere else. The manifest is
written last (:func:`write_manifest`), so its presence means "complete"; it is read back through
every check of :mod:`dumper.format.validate` (:func:`load_manifest`, :func:`parse_manifest`).

Example::

    from dumper.format.manifest import load_manifest
    m = load_manifest("dumps/a")
    rec = m.tensors[0]
    print(rec.name, rec.shape, rec.row_positions())
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from dumper.errors import CorruptDumpError, DumpError, IncompleteDumpError
from dumper.format.atomic import write_json_atomic
from dumper.format.dtypes import ITEMSIZES
from dumper.format.files import parse_json, read_regular_file, regular_file_in
from dumper.format.points import ROUTER
from dumper.format.sketch import NORM_SUFFIX
from dumper.format.validate import MAX_MANIFEST_BYTES, check_manifest

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PAD_SEQUENCE",
    "LOGPROB_POINT",
    "LOGITS_POINT",
    "LOGPROB_TOKEN_ID",
    "LOGPROB_VALUE",
    "LOGPROB_TOP_ID",
    "LOGPROB_TOP_VALUE",
    "LOGITS",
    "LOGPROB_NAMES",
    "ROUTER_POINT",
    "ROUTER_POINTS",
    "ROUTER_CHOICE_POINT",
    "ROUTER_LOGITS",
    "ROUTER_IDS",
    "ROUTER_WEIGHTS",
    "ROUTER_SCORES",
    "router_name",
    "TensorRecord",
    "Manifest",
    "encode_runs",
    "decode_runs",
    "encode_positions",
    "decode_positions",
    "data_file_name",
    "write_manifest",
    "parse_manifest",
    "load_manifest",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PAD_SEQUENCE = -1
"""Sequence id of padding rows: recorded so shapes stay whole, never compared."""

# Logprob tensors: one row per scored token, at the position of the token they score, with
# point LOGPROB_POINT (full logits rows: LOGITS_POINT). The comparator gives them a verdict
# of their own instead of a rel_diff.
LOGPROB_POINT = "logprobs"
LOGITS_POINT = "logits"
LOGPROB_TOKEN_ID = "logprobs.token_id"  # [n, 1] int64: the token scored at that position
LOGPROB_VALUE = "logprobs.logprob"  # [n, 1] float32: log p(token | tokens before it)
LOGPROB_TOP_ID = "logprobs.top_id"  # [n, k] int64: top-k ids of the distribution predicting it
LOGPROB_TOP_VALUE = "logprobs.top_logprob"  # [n, k] float32
LOGITS = "logits"  # [n, V]: the raw logits row that predicted the token at that position
LOGPROB_NAMES = frozenset({LOGPROB_TOKEN_ID, LOGPROB_VALUE, LOGPROB_TOP_ID, LOGPROB_TOP_VALUE, LOGITS})
"""The names of every logprob record (what the logprob verdict reads)."""

# MoE routing, per MoE decoder layer ``{P}`` (its module name, e.g. ``model.layers.3``), rows as
# every hidden-state row. The logits (point ROUTER_POINT) are compared like any tensor; the
# choice records (point ROUTER_CHOICE_POINT) get a routing verdict of their own.
ROUTER_POINT = ROUTER  # dumper.format.points: where it sits in a layer
ROUTER_CHOICE_POINT = "router_choice"
ROUTER_LOGITS = "router.logits"  # [*rows, E], the router's dtype: the gate's output over all experts
ROUTER_IDS = "router.ids"  # [*rows, k] int64: the experts chosen, in the slot order the selection returned
ROUTER_WEIGHTS = "router.weights"  # [*rows, k] float32: each slot's combine weight, as the model applies it
ROUTER_SCORES = "router.scores"  # [*rows, E] float32, optional: what top-k ran on where not monotone in the logits
ROUTER_POINTS = (ROUTER_POINT, ROUTER_CHOICE_POINT)
"""The points of every routing record (what the routing verdict reads)."""


def router_name(prefix: str, part: str) -> str:
    """The record name of routing ``part`` (:data:`ROUTER_IDS`, ...) of the MoE layer named ``prefix``."""
    return f"{prefix}.{part}"


def encode_runs(values: Iterable[int] | np.ndarray, *, step: int) -> list[list[int]]:
    """Run-length encode integers as ``[start, count]`` runs of values growing by ``step``.

    ``step=1`` suits token positions (0,1,2,... -> ``[[0, n]]``); ``step=0`` suits sequence
    ids (7,7,7 -> ``[[7, 3]]``). Vectorized: it runs inside forward passes.
    """
    a = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.int64).reshape(-1)
    if a.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(a) != step) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [a.size])))
    return [[int(v), int(c)] for v, c in zip(a[starts].tolist(), counts.tolist(), strict=True)]


def decode_runs(runs: Sequence[Sequence[int]], *, step: int) -> np.ndarray:
    """Inverse of :func:`encode_runs`: an int64 array with one value per row."""
    parts = [start + step * np.arange(count, dtype=np.int64) for start, count in runs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def encode_positions(values: Iterable[int]) -> list[list[int]]:
    """Token positions per row, encoded as consecutive runs."""
    return encode_runs(values, step=1)


def decode_positions(runs: Sequence[Sequence[int]]) -> np.ndarray:
    """Token positions per row, decoded."""
    return decode_runs(runs, step=1)


@dataclass(frozen=True)
class TensorRecord:
    """One captured tensor: where it is stored and what its rows mean.

    ``positions`` / ``sequence_ids`` are run-length encoded over the rows of the tensor
    viewed as ``[rows, shape[-1]]`` (``None`` when unknown; padding rows have sequence id
    :data:`PAD_SEQUENCE`). ``call`` numbers repeated captures of the same name within one
    forward pass. ``shard_dim`` is set when each rank holds a slice of the tensor along that
    dim (tensor parallelism); ``None`` means every rank holds the whole tensor.
    """

    name: str
    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    forward_pass: int
    rank: int = 0
    call: int = 0
    layer: int | None = None
    point: str | None = None
    positions: list[list[int]] | None = None
    sequence_ids: list[list[int]] | None = None
    shard_dim: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    sketch: dict[str, Any] | None = None
    """Set on a sketched record (:mod:`dumper.format.sketch`): ``{"hidden": width, "dtype": code}`` of the rows
    projected; the record then holds their ``F32 [*rows, K]`` projection, its norms under :attr:`norm_key`."""

    @property
    def norm_key(self) -> str:
        """The key of a sketched record's exact squared norms (``F64 [rows]``) in its data file."""
        return self.key + NORM_SUFFIX

    @property
    def rows(self) -> int:
        """Number of rows when viewed as ``[rows, hidden]`` (1 for a 0-d or 1-d tensor)."""
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def nbytes(self) -> int:
        """Bytes stored for the record (a sketch's norms included)."""
        return math.prod(self.shape) * ITEMSIZES[self.dtype] + (8 * self.rows if self.sketch is not None else 0)

    def row_positions(self) -> np.ndarray | None:
        return None if self.positions is None else decode_runs(self.positions, step=1)

    def row_sequence_ids(self) -> np.ndarray | None:
        return None if self.sequence_ids is None else decode_runs(self.sequence_ids, step=0)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        if d["sketch"] is None:  # a full record's JSON is as before sketches existed
            del d["sketch"]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorRecord:
        """The record a JSON object describes (check untrusted input first: :mod:`dumper.format.validate`).

        Raises ``TypeError`` on missing or unknown keys, as ``__init__`` would. Sets the fields
        in declaration order without the generated ``__init__`` (twice as fast, for manifests of
        100k records); the order keeps the instance dicts sharing their keys, as ``__init__`` does.
        """
        keys = d.keys()
        if not _RECORD_REQUIRED <= keys <= _RECORD_FIELDS:
            raise TypeError(
                f"tensor record: missing keys {sorted(_RECORD_REQUIRED - keys)}, "
                f"unknown keys {sorted(keys - _RECORD_FIELDS)}"
            )
        rec = object.__new__(cls)
        put, get = object.__setattr__, d.get
        for name, default in _RECORD_DEFAULTS:
            put(rec, name, get(name, default))
        put(rec, "shape", tuple(d["shape"]))
        if "meta" not in keys:
            put(rec, "meta", {})
        return rec


_RECORD_FIELDS = frozenset(f.name for f in fields(TensorRecord))
_RECORD_REQUIRED = frozenset(
    f.name for f in fields(TensorRecord) if f.default is MISSING and f.default_factory is MISSING
)
_RECORD_DEFAULTS = tuple((f.name, None if f.default is MISSING else f.default) for f in fields(TensorRecord))
"""(field, default) of every field in declaration order (required fields are always present)."""


@dataclass(frozen=True)
class Manifest:
    """Everything a dump says about itself; ``capture_signature`` decides comparability."""

    format_version: int
    created_at: str
    model: dict[str, Any]
    capture_signature: dict[str, Any]
    environment: dict[str, Any]
    files: dict[str, int]
    tensors: tuple[TensorRecord, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "created_at": self.created_at,
            "model": self.model,
            "capture_signature": self.capture_signature,
            "environment": self.environment,
            "files": self.files,
            "extra": self.extra,
            "tensors": [t.to_json() for t in self.tensors],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Manifest:
        return cls(
            format_version=int(d["format_version"]),
            created_at=str(d["created_at"]),
            model=dict(d["model"]),
            capture_signature=dict(d["capture_signature"]),
            environment=dict(d["environment"]),
            files={str(k): int(v) for k, v in d["files"].items()},
            tensors=tuple(TensorRecord.from_json(t) for t in d["tensors"]),
            extra=dict(d.get("extra", {})),
        )


def data_file_name(rank: int, forward_pass: int, shard: int) -> str:
    """Canonical data file name for one rank's shard of one forward pass."""
    return f"r{rank}-p{forward_pass:06d}-{shard:03d}.safetensors"


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write the manifest last and atomically; the dump is complete once this returns."""
    write_json_atomic(Path(directory) / MANIFEST_NAME, manifest.to_json())


def parse_manifest(raw: Any, where: str) -> Manifest:
    """The manifest that parsed JSON ``raw`` describes, once every rule of :mod:`dumper.format.validate` holds.

    Touches no disk (a run store reads its manifests remotely); :func:`load_manifest` adds the
    checks of the data files. Raises :class:`CorruptDumpError` naming ``where`` and the field.
    """
    found = raw.get("format_version") if isinstance(raw, dict) else None
    if type(found) is not int or found != FORMAT_VERSION:
        raise CorruptDumpError(f"{where}: format version {found!r} is not supported (expected {FORMAT_VERSION})")
    check_manifest(raw, where, ITEMSIZES)
    return Manifest.from_json(raw)


def load_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate a dump's manifest (see :mod:`dumper.format.validate` for every rule).

    Raises :class:`IncompleteDumpError` when the manifest is missing and
    :class:`CorruptDumpError` when it is unreadable, too large, of another format version,
    malformed in any field, or lists a data file that is missing, outside the dump, not a
    regular file, or of another size than it says (a truncated write). Data files are checked
    with ``stat`` only; their headers are validated when :class:`~dumper.format.reader.DumpReader`
    opens them.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DumpError(f"{directory}: no such dump directory")
    path = directory / MANIFEST_NAME
    if not os.path.lexists(path):
        raise IncompleteDumpError(f"{directory}: incomplete dump (no {MANIFEST_NAME}; the run did not finish)")
    regular_file_in(directory, MANIFEST_NAME, missing="manifest is a dangling symlink")
    raw = parse_json(read_regular_file(path, MAX_MANIFEST_BYTES, "manifest"), str(path), "manifest")
    manifest = parse_manifest(raw, str(path))
    for rel, size in manifest.files.items():
        actual = regular_file_in(directory, rel, missing="data file listed in the manifest is missing").st_size
        if actual != size:
            raise CorruptDumpError(
                f"{directory / rel}: truncated or modified data file ({actual} bytes, manifest says {size})"
            )
    return manifest
