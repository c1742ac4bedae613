"""The on-disk dump format: the one module the dumper writes with and the comparator reads with.

A dump is a directory::

    dump/
      manifest.json                  # written last, atomically: its presence means "complete"
      r0-p000000-000.safetensors     # rank 0, forward pass 0, shard 0
      r0-p000001-000.safetensors
      ...

Tensors live in safetensors files (no pickle). Each data file is written under a temporary
name, fsynced and renamed before the manifest that lists it is written, so a crash never
leaves a manifest pointing at missing bytes. The manifest indexes every tensor with its
canonical name, file, shape, dtype, layer index, forward-pass index, rank, and the absolute
token position and sequence id of each row. Row metadata is run-length encoded
(``[[start, count], ...]``) and decoded only here.

A dump is untrusted input when it is read: :func:`load_manifest` and :class:`DumpReader` run
every manifest, safetensors header and file they name through :mod:`dumper.format.validate` first,
so a broken or hostile dump is a one-line :class:`~dumper.errors.CorruptDumpError`. Files are
created with the user's umask (``0o666 & ~umask``), so a dump is as readable as any file the
user writes.

Example::

    from dumper.format import load_manifest, open_tensor
    m = load_manifest("dumps/a")
    for rec in m.tensors:
        arr = open_tensor("dumps/a", rec)   # memory-mapped, raw storage dtype
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from dumper.errors import CorruptDumpError, DumpError, IncompleteDumpError
from dumper.format.validate import (
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    READ_FLAGS,
    HeaderEntry,
    check_header,
    check_manifest,
    parse_json,
    read_regular_file,
    regular_file_in,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TensorRecord",
    "Manifest",
    "encode_runs",
    "decode_runs",
    "encode_positions",
    "decode_positions",
    "data_file_name",
    "atomic_path",
    "write_json_atomic",
    "fsync_dir",
    "file_mode",
    "dir_mode",
    "load_manifest",
    "write_manifest",
    "open_tensor",
    "STORAGE_DTYPES",
    "PAD_SEQUENCE",
    "LOGPROB_POINT",
    "LOGITS_POINT",
    "LOGPROB_TOKEN_ID",
    "LOGPROB_VALUE",
    "LOGPROB_TOP_ID",
    "LOGPROB_TOP_VALUE",
    "LOGITS",
    "to_float64",
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

# safetensors dtype string -> numpy storage dtype (bfloat16 is stored as its raw uint16 bits)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_ITEMSIZE = {k: v.itemsize for k, v in STORAGE_DTYPES.items()}


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

    @property
    def rows(self) -> int:
        """Number of rows when viewed as ``[rows, hidden]`` (1 for a 0-d or 1-d tensor)."""
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * STORAGE_DTYPES[self.dtype].itemsize

    def row_positions(self) -> np.ndarray | None:
        return None if self.positions is None else decode_runs(self.positions, step=1)

    def row_sequence_ids(self) -> np.ndarray | None:
        return None if self.sequence_ids is None else decode_runs(self.sequence_ids, step=0)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
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
            raise TypeError(f"tensor record: missing keys {sorted(_RECORD_REQUIRED - keys)}, "
                            f"unknown keys {sorted(keys - _RECORD_FIELDS)}")
        rec = object.__new__(cls)
        put, get = object.__setattr__, d.get
        for name, default in _RECORD_DEFAULTS:
            put(rec, name, get(name, default))
        put(rec, "shape", tuple(d["shape"]))
        if "meta" not in keys:
            put(rec, "meta", {})
        return rec


_RECORD_FIELDS = frozenset(f.name for f in fields(TensorRecord))
_RECORD_REQUIRED = frozenset(f.name for f in fields(TensorRecord) if f.default is MISSING
                             and f.default_factory is MISSING)
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


def to_float64(a: np.ndarray, dtype: str) -> np.ndarray:
    """Widen raw stored values (bfloat16 given as uint16 bits) to a contiguous float64 array."""
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float64)


def data_file_name(rank: int, forward_pass: int, shard: int) -> str:
    """Canonical data file name for one rank's shard of one forward pass."""
    return f"r{rank}-p{forward_pass:06d}-{shard:03d}.safetensors"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry (a rename) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read from ``/proc/self/status`` where Linux provides it.

    ``os.umask`` can only be read by setting it, which would race with other threads creating files.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from the user's umask (``0o666 & ~umask``), e.g. 0o644 under umask 022."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode a new directory gets from the user's umask (``0o777 & ~umask``), e.g. 0o755 under umask 022."""
    return 0o777 & ~_umask()


def _create_temp(path: Path) -> str:
    """Create an empty, uniquely named temp file beside ``path`` with mode ``0o666 & ~umask``.

    Unlike :func:`tempfile.mkstemp` (always 0600), the user's umask decides who may read the
    file, so a shared baseline store or a CI artifact is readable as the user intends.
    """
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: cannot create a unique temporary file")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``.

    On an exception the temp file is removed and ``path`` is left as it was. The file gets the
    user's umask (``0o666 & ~umask``), as a plain ``open`` would give it. A symlink is written
    through; a directory, device or FIFO at ``path`` is refused (a rename would replace it).
    """
    path = Path(path)
    if path.is_symlink():  # write through the link, as a plain open would, instead of replacing it
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        raise DumpError(f"{path}: exists and is not a regular file; refusing to replace it")
    tmp = _create_temp(path)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON to ``path`` via a fsynced temp file and an atomic rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, allow_nan=False), encoding="utf-8")


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write the manifest last and atomically; the dump is complete once this returns."""
    write_json_atomic(Path(directory) / MANIFEST_NAME, manifest.to_json())


def load_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate a dump's manifest (see :mod:`dumper.format.validate` for every rule).

    Raises :class:`IncompleteDumpError` when the manifest is missing and
    :class:`CorruptDumpError` when it is unreadable, too large, of another format version,
    malformed in any field, or lists a data file that is missing, outside the dump, not a
    regular file, or of another size than it says (a truncated write). Data files are checked
    with ``stat`` only; their headers are validated when :class:`DumpReader` opens them.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DumpError(f"{directory}: no such dump directory")
    path = directory / MANIFEST_NAME
    if not os.path.lexists(path):
        raise IncompleteDumpError(
            f"{directory}: incomplete dump (no {MANIFEST_NAME}; the run did not finish)"
        )
    regular_file_in(directory, MANIFEST_NAME, missing="manifest is a dangling symlink")
    raw = parse_json(read_regular_file(path, MAX_MANIFEST_BYTES, "manifest"), str(path), "manifest")
    found = raw.get("format_version") if isinstance(raw, dict) else None
    if type(found) is not int or found != FORMAT_VERSION:
        raise CorruptDumpError(
            f"{path}: format version {found!r} is not supported (expected {FORMAT_VERSION})"
        )
    check_manifest(raw, str(path), _ITEMSIZE)
    for rel, size in raw["files"].items():
        actual = regular_file_in(directory, rel, missing="data file listed in the manifest is missing").st_size
        if actual != size:
            raise CorruptDumpError(
                f"{directory / rel}: truncated or modified data file ({actual} bytes, manifest says {size})"
            )
    return Manifest.from_json(raw)


class _SafetensorsFile:
    """A memory-mapped safetensors file inside a dump, its whole header validated on opening.

    The file must be a regular file whose real path is inside ``root`` (checked before it is
    opened, and opened non-blocking, so a FIFO can never hang the reader). The header length
    is bounded by :data:`~dumper.format.validate.MAX_HEADER_BYTES` before anything is read.
    """

    def __init__(self, root: Path, name: str) -> None:
        self.path = path = root / name
        regular_file_in(root, name, missing="data file listed in the manifest is missing")
        try:
            fd = os.open(path, READ_FLAGS)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptDumpError(f"{path}: not a regular file; refusing to read it")
                size = st.st_size
                if size < 8:
                    raise CorruptDumpError(f"{path}: not a safetensors file ({size} bytes)")
                n = int.from_bytes(f.read(8), "little")
                if n > MAX_HEADER_BYTES:
                    raise CorruptDumpError(f"{path}: safetensors header of {n} bytes exceeds the "
                                           f"{MAX_HEADER_BYTES}-byte limit")
                if n > size - 8:
                    raise CorruptDumpError(f"{path}: truncated safetensors header ({n} bytes declared, "
                                           f"{size - 8} in the file)")
                data = f.read(n)
                header = parse_json(data, str(path), "safetensors header")
                self.entries: dict[str, HeaderEntry] = check_header(header, str(path), size - 8 - n, _ITEMSIZE)
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CorruptDumpError(f"{path}: unreadable safetensors file ({e.strerror or e})") from None
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        self._mm = mm
        self._data_start = 8 + n

    def array(self, key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        entry = self.entries.get(key)
        if entry is None:
            raise CorruptDumpError(f"{self.path}: tensor {key!r} missing from the file")
        file_dtype, file_shape, begin, _ = entry
        if file_dtype != dtype or file_shape != tuple(shape):
            raise CorruptDumpError(
                f"{self.path}: tensor {key!r} is {file_dtype}{list(file_shape)} in the file "
                f"but {dtype}{list(shape)} in the manifest"
            )
        np_dtype = STORAGE_DTYPES[dtype]
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype=np_dtype)
        return np.frombuffer(self._mm, dtype=np_dtype, count=count, offset=self._data_start + begin).reshape(shape)


class DumpReader:
    """Opens the tensors of one dump lazily, keeping up to ``max_open`` files mapped.

    A mapping costs address space, not memory (its pages are the page cache's), so many stay
    mapped: a chunked layout reads each file many times, and re-mapping costs page faults.
    """

    def __init__(self, directory: str | os.PathLike[str], manifest: Manifest | None = None, *,
                 max_open: int = 256) -> None:
        self.directory = Path(directory)
        self.max_open = max_open
        self._rows: dict[tuple[str, str], np.ndarray] = {}
        self.manifest = manifest if manifest is not None else load_manifest(self.directory)
        self._open: dict[str, _SafetensorsFile] = {}

    def array(self, rec: TensorRecord) -> np.ndarray:
        """The raw stored values of ``rec`` (memory-mapped, read-only, storage dtype)."""
        f = self._open.get(rec.file)
        if f is None:
            if len(self._open) >= self.max_open:
                self._open.pop(next(iter(self._open)))
            f = self._open[rec.file] = _SafetensorsFile(self.directory, rec.file)
        return f.array(rec.key, rec.dtype, rec.shape)

    def rows(self, rec: TensorRecord) -> np.ndarray:
        """:meth:`array` viewed as ``[rows, last dim]`` (a 0-d or 1-d tensor is one row); cached per tensor."""
        key = (rec.file, rec.key)
        a = self._rows.get(key)
        if a is None or rec.file not in self._open:
            a = self.array(rec)
            # [rows, last dim]; rows spelled out, as -1 cannot be inferred when the last dim is 0
            a = a.reshape(math.prod(a.shape[:-1]), a.shape[-1]) if a.ndim >= 2 else a.reshape(1, -1)
            if len(self._rows) >= 4 * self.max_open:
                self._rows.clear()
            self._rows[key] = a
        return a


def open_tensor(directory: str | os.PathLike[str], rec: TensorRecord) -> np.ndarray:
    """Memory-map one tensor of a dump in its raw storage dtype (bfloat16 as uint16 bits)."""
    return _SafetensorsFile(Path(directory), rec.file).array(rec.key, rec.dtype, rec.shape)
