"""Reading a dump's tensors: memory-mapped safetensors files, their headers validated, bytes never copied.

:class:`DumpReader` opens the data files of one dump lazily, each checked first (a regular file
inside the dump, opened non-blocking, its whole header validated by
:func:`~dumper.format.validate.check_header`), and hands out read-only views of the raw stored
values: bfloat16 comes back as its ``uint16`` bits, which :func:`to_float64` widens exactly.

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
    if size < 8:
        raise CorruptDumpError(f"{path}: not a safetensors file ({size} bytes)")
    n = int.from_bytes(f.read(8), "little")
    if n > MAX_HEADER_BYTES:
        raise CorruptDumpError(f"{path}: safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n > size - 8:
        raise CorruptDumpError(f"{path}: truncated safetensors header ({n} bytes declared, {size - 8} in the file)")
    return parse_json(f.read(n), str(path), "safetensors header"), n, size


def to_float64(a: np.ndarray, dtype: str) -> np.ndarray:
    """Widen raw stored values (bfloat16 given as uint16 bits) to a contiguous float64 array."""
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float64)


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
                header, n, size = read_safetensors_header(f, path)
                self.entries: dict[str, HeaderEntry] = check_header(header, str(path), size - 8 - n, ITEMSIZES)
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
    Threads may share a reader (the comparator compares a few tensors at once).
    """

    def __init__(self, directory: str | os.PathLike[str], manifest: Manifest | None = None, *,
                 max_open: int = 256) -> None:
        self.directory = Path(directory)
        self.max_open = max_open
        self._rows: dict[tuple[str, str], np.ndarray] = {}
        self.manifest = manifest if manifest is not None else load_manifest(self.directory)
        self._open: dict[str, _SafetensorsFile] = {}
        self._lock = threading.RLock()  # guards both caches

    def _file(self, name: str) -> _SafetensorsFile:
        with self._lock:
            f = self._open.get(name)
            if f is None:
                if len(self._open) >= self.max_open:
                    self._open.pop(next(iter(self._open)))
                f = self._open[name] = _SafetensorsFile(self.directory, name)
            return f

    def array(self, rec: TensorRecord) -> np.ndarray:
        """The raw stored values of ``rec`` (memory-mapped, read-only, storage dtype)."""
        return self._file(rec.file).array(rec.key, rec.dtype, rec.shape)

    def sq_norms(self, rec: TensorRecord) -> np.ndarray:
        """A sketched record's exact squared row norms, ``F64 [rows]`` (:mod:`dumper.format.sketch`)."""
        return self._file(rec.file).array(rec.norm_key, "F64", (rec.rows,))

    def rows(self, rec: TensorRecord) -> np.ndarray:
        """:meth:`array` viewed as ``[rows, last dim]`` (a 0-d or 1-d tensor is one row); cached per tensor."""
        key = (rec.file, rec.key)
        with self._lock:
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
