"""Reading a dump's tensors: memory-mapped safetensors files, their headers validated, bytes never copied.

:class:`DumpReader` opens the data files of one dump lazily, each checked first (a regular file
inside the dump, opened non-blocking, its whole header validated by
:func:`~dumper.format.validate.check_header`), and hands out read-only views of the raw stored
values: bfloat16 comes back as its ``uint16`` bits, which :func:`to_float64` widens exactly. A dump
at an fsspec URL is read in place by ranged reads, each file held to the same checks
(:mod:`dumper.format.remote_read`); its ``directory`` is then the URL.

Example::

    from dumper.format import DumpReader, to_float64
    reader = DumpReader("dumps/a")
    rec = reader.manifest.tensors[0]
    rows = to_float64(reader.rows(rec), rec.dtype)   # [rows, hidden] float64
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dumper.errors import CorruptDumpError
from dumper.format.dtypes import ITEMSIZES, STORAGE_DTYPES
from dumper.format.files import READ_FLAGS, parse_json, regular_file_in
from dumper.format.manifest import Manifest, TensorRecord, load_manifest
from dumper.format.remote import is_url
from dumper.format.remote_read import CACHE_BYTES, DumpURL, LoadCache, RemoteDump
from dumper.format.validate import MAX_HEADER_BYTES, HeaderEntry, check_header

__all__ = ["DumpReader", "open_tensor", "to_float64", "read_safetensors_header"]


def read_safetensors_header(f: BinaryIO, path: Path) -> tuple[Any, int, int]:
    """``(header JSON, header length, file size)`` of the safetensors file open as ``f`` (at offset 0).

    The file must be regular; the declared header length is bounded by :data:`MAX_HEADER_BYTES`
    and by the file's size before it is read, then parsed with the bounded JSON reader. Any
    problem is a one-line :class:`CorruptDumpError` naming ``path``; the entries are not checked.
    """
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise CorruptDumpError(f"{path}: not a regular file; refusing to read it")
    size = st.st_size
    n = _header_length(f.read(8) if size >= 8 else b"", size, path)
    return parse_json(f.read(n), str(path), "safetensors header"), n, size


def _header_length(first: bytes, size: int, path: object) -> int:
    """The header length a safetensors file of ``size`` bytes declares in its ``first`` 8 bytes, once it is
    bounded by :data:`MAX_HEADER_BYTES` and by the file."""
    if size < 8:
        raise CorruptDumpError(f"{path}: not a safetensors file ({size} bytes)")
    n = int.from_bytes(first, "little")
    if n > MAX_HEADER_BYTES:
        raise CorruptDumpError(f"{path}: safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n > size - 8:
        raise CorruptDumpError(f"{path}: truncated safetensors header ({n} bytes declared, {size - 8} in the file)")
    return n


def to_float64(a: np.ndarray, dtype: str) -> np.ndarray:
    """Widen raw stored values (bfloat16 given as uint16 bits) to a contiguous float64 array."""
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float64)


class _TensorFile:
    """A safetensors file whose header is validated: its tensors by key, checked against the manifest's record."""

    path: Path | DumpURL
    entries: dict[str, HeaderEntry]
    _data_start: int

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
        return self._values(np.dtype(np_dtype), count, self._data_start + begin).reshape(shape)

    def _values(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        raise NotImplementedError


class _SafetensorsFile(_TensorFile):
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
                header, n, size = read_safetensors_header(f, path)
                self.entries = check_header(header, str(path), size - 8 - n, ITEMSIZES)
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CorruptDumpError(f"{path}: unreadable safetensors file ({e.strerror or e})") from None
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        self._mm = mm
        self._data_start = 8 + n

    def _values(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)


class _RemoteFile(_TensorFile):
    """A safetensors file of a dump at a URL: its size checked against the manifest's, its header read by two
    ranged reads (bounded as a local one is) and validated, each tensor then read by the range it occupies."""

    def __init__(self, dump: RemoteDump, name: str, size: int) -> None:
        self.path = dump.url / name
        dump.check_size(name, size)
        n = _header_length(dump.read(name, 0, 8) if size >= 8 else b"", size, self.path)
        self.entries = check_header(
            parse_json(dump.read(name, 8, 8 + n), str(self.path), "safetensors header"),
            str(self.path),
            size - 8 - n,
            ITEMSIZES,
        )
        self._dump, self._name, self._data_start = dump, name, 8 + n

    def _values(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        a = np.frombuffer(self._dump.read(self._name, offset, offset + count * dtype.itemsize), dtype=dtype)
        a.flags.writeable = False  # parts arrive in a bytearray: read-only as a mapping's views are
        return a


def _as_rows(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as ``[rows, last dim]`` (a 0-d or 1-d tensor is one row)."""
    # rows spelled out, as -1 cannot be inferred when the last dim is 0
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1]) if a.ndim >= 2 else a.reshape(1, -1)


class DumpReader:
    """Opens the tensors of one dump lazily, keeping up to ``max_open`` files mapped.

    A mapping costs address space, not memory (its pages are the page cache's), so many stay
    mapped: a chunked layout reads each file many times, and re-mapping costs page faults.
    A dump at a URL (:func:`~dumper.format.remote.is_url`) is read by ranges instead, and what it
    reads is memory: up to ``cache_bytes`` of it is kept for reuse (:mod:`dumper.format.remote_read`).
    Threads may share a reader (the comparator compares a few tensors at once; at a URL, their reads
    are in flight together).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        manifest: Manifest | None = None,
        *,
        max_open: int = 256,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.max_open = max_open
        self._rows: dict[tuple[str, str], np.ndarray] = {}
        self._open: dict[str, _SafetensorsFile] = {}
        self._lock = threading.RLock()  # guards both caches
        self._remote = RemoteDump(directory) if is_url(directory) else None
        self.directory: Path | DumpURL = Path(directory) if self._remote is None else self._remote.url
        if manifest is None:
            manifest = load_manifest(self.directory) if self._remote is None else self._remote.manifest()
        self.manifest = manifest
        self._files: LoadCache[_RemoteFile] = LoadCache(max_open, lambda f: 1)
        self._arrays: LoadCache[np.ndarray] = LoadCache(cache_bytes, lambda a: a.nbytes)

    def _file(self, name: str) -> _SafetensorsFile:
        with self._lock:
            f = self._open.get(name)
            if f is None:
                if len(self._open) >= self.max_open:
                    self._open.pop(next(iter(self._open)))
                f = self._open[name] = _SafetensorsFile(self.directory, name)
            return f

    def _remote_file(self, remote: RemoteDump, name: str) -> _RemoteFile:
        size = self.manifest.files.get(name)
        if size is None:  # a caller's manifest: only listed objects are ever read
            raise CorruptDumpError(f"{self.directory / name}: not listed in the manifest; refusing to read it")
        return self._files.get(name, lambda: _RemoteFile(remote, name, size))

    def _stored(self, name: str, key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        remote = self._remote
        if remote is None:
            return self._file(name).array(key, dtype, shape)
        return self._arrays.get(
            (name, key, dtype, shape), lambda: self._remote_file(remote, name).array(key, dtype, shape)
        )

    def array(self, rec: TensorRecord) -> np.ndarray:
        """The raw stored values of ``rec`` (read-only, storage dtype; memory-mapped for a local dump)."""
        return self._stored(rec.file, rec.key, rec.dtype, rec.shape)

    def sq_norms(self, rec: TensorRecord) -> np.ndarray:
        """A sketched record's exact squared row norms, ``F64 [rows]`` (:mod:`dumper.format.sketch`)."""
        return self._stored(rec.file, rec.norm_key, "F64", (rec.rows,))

    def rows(self, rec: TensorRecord) -> np.ndarray:
        """:meth:`array` viewed as ``[rows, last dim]`` (a 0-d or 1-d tensor is one row); cached per tensor."""
        if self._remote is not None:  # cached by bytes in _arrays
            return _as_rows(self.array(rec))
        key = (rec.file, rec.key)
        with self._lock:
            a = self._rows.get(key)
            if a is None or rec.file not in self._open:
                a = _as_rows(self.array(rec))
                if len(self._rows) >= 4 * self.max_open:
                    self._rows.clear()
                self._rows[key] = a
            return a


def open_tensor(directory: str | os.PathLike[str], rec: TensorRecord) -> np.ndarray:
    """Memory-map one tensor of a dump in its raw storage dtype (bfloat16 as uint16 bits); read it, at a URL."""
    if is_url(directory):  # its size is the manifest's to give
        return DumpReader(directory).array(rec)
    return _SafetensorsFile(Path(directory), rec.file).array(rec.key, rec.dtype, rec.shape)
