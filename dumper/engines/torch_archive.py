"""``torch.save`` archives checked byte by byte before ``torch.load(mmap=True)`` maps them.

``torch.load(mmap=True)`` maps each storage at the offset of its zip record (``data/KEY``) for
the length the pickle declares, and trusts the zip for the rest: a compressed or encrypted
record, a local header that disagrees with the central directory, or a declared length other
than the record's would be read as tensor bytes (a deflated tensor compares as garbage, a long
one runs into the next header). :func:`check_archive` reads the zip itself and refuses all of
that, naming the file and the record:

* the end record sits at the very end (no comment, no trailing bytes), the central directory
  right before it (zip64 too), at most :data:`MAX_RECORDS` records in at most
  :data:`MAX_CENTRAL_BYTES`, checked before the directory is read;
* every record is stored (``ZIP_STORED``), not encrypted, named once (case-insensitively, as
  torch's reader looks names up) under one ``ARCHIVE/`` folder; its local header repeats the
  central directory's name, flags, method and sizes, or its data descriptor (which torch.save
  writes) follows its bytes and repeats its CRC-32 and size; records do not overlap and end
  before the central directory; a record's bytes match its CRC-32 (all but a described record
  with none: ``torch.save`` with ``compute_crc32=False``);
* the pickle (``data.pkl``, at most :data:`MAX_PICKLE_BYTES`) is run once with inert stand-ins
  for every global, only to list the storages it references: each is one record whose size is
  exactly ``numel * itemsize`` of its storage type. Nothing it names is imported or called.

Example::

    where = printable(str(path))
    check_archive(path, where)
    obj = torch.load(path, weights_only=True, mmap=True)
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import pickle
import stat
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dumper.errors import CorruptDumpError
from dumper.format.files import READ_FLAGS, file_kind, printable, show

__all__ = [
    "MAX_RECORDS",
    "MAX_CENTRAL_BYTES",
    "MAX_PICKLE_BYTES",
    "Record",
    "check_archive",
    "read_records",
    "pickled_storages",
]

MAX_RECORDS = 1 << 14
"""Most zip records a file may hold (a tensor is one; torch.save adds six)."""
MAX_CENTRAL_BYTES = 8 << 20
"""Largest central directory read (about 200 bytes a record in a torch.save file)."""
MAX_PICKLE_BYTES = 256 << 10
"""Largest ``data.pkl`` unpickled (a tensor takes ~120 bytes of it): one opcode byte can build a ~230-byte
object (an empty set), so this also bounds each pass over it to ~60 MiB."""
_END = struct.Struct("<4s4H2LH")
_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
_U32 = 0xFFFFFFFF
_ENCRYPTED = 0x0001 | 0x0040 | 0x2000
_DESCRIPTOR = 0x0008
_NOT_ZIP = "not a file torch.load(weights_only=True) accepts"


@dataclass(frozen=True)
class Record:
    """One stored zip record: its name, and where its bytes lie in the file."""

    name: str  # printable, for messages
    offset: int
    size: int
    crc: int
    described: bool  # a data descriptor follows the bytes


def _text(name: bytes) -> str:
    """A zip record's name for a message."""
    return printable(name.decode("utf-8", "backslashreplace"))


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = os.pread(fd, n, offset)
    while len(out) < n and (more := os.pread(fd, n - len(out), offset + len(out))):
        out += more
    return out


def _directory(fd: int, size: int, where: str) -> tuple[int, int, int]:
    """(records, central directory offset, its size) from the end record, which must end the file."""
    end = _pread(fd, _END.size, size - _END.size) if size >= _END.size else b""
    if len(end) < _END.size or end[:4] != b"PK\x05\x06":
        pickled = _pread(fd, 1, 0) == b"\x80"
        what = "a plain pickle or legacy torch.save file" if pickled else "truncated, or not a torch.save zip archive"
        raise CorruptDumpError(f"{where}: {_NOT_ZIP} ({what})")
    _, disk, cd_disk, here, count, cd_size, cd_offset, comment = _END.unpack(end)
    stop = size - _END.size
    loc = _pread(fd, _LOCATOR.size, stop - _LOCATOR.size) if stop >= _LOCATOR.size else b""
    if loc[:4] == b"PK\x06\x07":  # zip64: its end record, just before the locator, has the real fields
        stop = _LOCATOR.unpack(loc)[2]
        rec = _pread(fd, _END64.size, stop) if stop + _END64.size + _LOCATOR.size == size - _END.size else b""
        if len(rec) < _END64.size or rec[:4] != b"PK\x06\x06" or _END64.unpack(rec)[1] != _END64.size - 12:
            raise CorruptDumpError(f"{where}: {_NOT_ZIP} (its zip64 end record is missing or misplaced)")
        _, _, _, _, disk, cd_disk, here, count, cd_size, cd_offset = _END64.unpack(rec)
    if comment or disk or cd_disk or here != count or cd_offset + cd_size != stop:
        raise CorruptDumpError(
            f"{where}: {_NOT_ZIP} (its zip end record does not describe one central directory right before it)"
        )
    if count > MAX_RECORDS or cd_size > MAX_CENTRAL_BYTES:
        raise CorruptDumpError(
            f"{where}: a zip of {count} records in a {cd_size}-byte directory (at most "
            f"{MAX_RECORDS} records in {MAX_CENTRAL_BYTES >> 20} MiB); not a torch.save file"
        )
    return count, cd_offset, cd_size


def _zip64(extra: bytes, fields: list[int], wide: list[bool]) -> list[int] | None:
    """``fields`` with each one ``wide`` (0xFFFFFFFF) replaced from the zip64 extra field; None if it is short."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<2H", extra, pos)
        if tag == 1:
            data = extra[pos + 4 : pos + 4 + n]
            out = list(fields)
            at = 0
            for i, w in enumerate(wide):
                if w:
                    if at + 8 > len(data):
                        return None
                    out[i], at = struct.unpack_from("<Q", data, at)[0], at + 8
            return out
        pos += 4 + n
    return None if any(wide) else fields


def read_records(fd: int, size: int, where: str) -> dict[bytes, Record]:
    """Every record of the zip open on ``fd`` (``size`` bytes), by lower-cased name; refuses any misframed one."""
    count, cd_offset, cd_size = _directory(fd, size, where)
    central = _pread(fd, cd_size, cd_offset)
    pos = 0
    out = dict[bytes, Record]()
    spans = []
    prefix = None
    for _ in range(count):
        head = central[pos : pos + _CENTRAL.size]
        if len(head) < _CENTRAL.size or head[:4] != b"PK\x01\x02":
            raise CorruptDumpError(f"{where}: its zip central directory is cut or garbled at byte {cd_offset + pos}")
        (_, _, _, flags, method, _, _, crc, csize, usize, nlen, elen, clen, disk, _, _, offset) = _CENTRAL.unpack(head)
        name = central[pos + 46 : pos + 46 + nlen]
        extra = central[pos + 46 + nlen : pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        folder = name.partition(b"/")[0].lower()
        prefix = folder if prefix is None else prefix
        inside = b"/" in name and folder == prefix
        shown = f"{where}: zip record {_text(name.partition(b'/')[2] if inside else name)}"
        sizes = _zip64(extra, [usize, csize, offset], [usize == _U32, csize == _U32, offset == _U32])
        if pos > len(central) or sizes is None or disk:
            raise CorruptDumpError(f"{shown}: its central directory entry is cut or garbled")
        usize, csize, offset = sizes
        if flags & _ENCRYPTED or method != 0 or csize != usize:
            what = (
                "encrypted"
                if flags & _ENCRYPTED
                else f"compressed (method {method})"
                if method
                else f"stored with {csize} bytes for {usize}"
            )
            raise CorruptDumpError(f"{shown}: {what}; torch.save writes plain stored records, refusing to map it")
        if not inside or name.lower() in out:
            raise CorruptDumpError(
                f"{shown}: {'named twice' if name.lower() in out else 'outside the archive folder'}"
                " (torch.save writes each record once, under one folder)"
            )
        data, end = _local(fd, offset, name, flags, (crc, usize), shown)
        if end > cd_offset:
            raise CorruptDumpError(f"{shown}: its {usize} bytes at {data} run past the records into the directory")
        spans.append((offset, end, shown))
        out[name.lower()] = Record(_text(name), data, usize, crc, bool(flags & _DESCRIPTOR))
    if pos != len(central):
        raise CorruptDumpError(f"{where}: its zip central directory holds {len(central) - pos} stray bytes")
    spans.sort()
    for (_, end, _), (start, _, shown) in itertools.pairwise(spans):
        if start < end:
            raise CorruptDumpError(f"{shown}: overlaps the record before it; refusing to map it")
    return out


def _local(fd: int, offset: int, name: bytes, flags: int, crc_size: tuple[int, int], shown: str) -> tuple[int, int]:
    """Where a record's bytes start, and where the record ends (after its data descriptor, if it has one).

    The local header must repeat the central entry's name, flags, method and (unless a data
    descriptor follows the bytes, which then must repeat the CRC and sizes) CRC and sizes.
    """
    head = _pread(fd, _LOCAL.size, offset)
    if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
        raise CorruptDumpError(f"{shown}: no local header at byte {offset}")
    _, _, lflags, lmethod, _, _, lcrc, lcsize, lusize, nlen, elen = _LOCAL.unpack(head)
    lname, lextra = _pread(fd, nlen, offset + 30), _pread(fd, elen, offset + 30 + nlen)
    wide = [lusize == _U32, lcsize == _U32]
    lsizes = _zip64(lextra, [lusize, lcsize], wide) if len(lextra) == elen else None
    crc, size = crc_size
    declared, want = [lcrc, *(lsizes or [])], [crc, size, size]
    agree = declared == want or (flags & _DESCRIPTOR and all(v in (0, w) for v, w in zip(declared, want)))
    if lname != name or lflags != flags or lmethod != 0 or lsizes is None or not agree:
        raise CorruptDumpError(
            f"{shown}: its local header disagrees with the zip central directory (name, flags, method or sizes)"
        )
    data = end = offset + 30 + nlen + elen
    end += size
    if flags & _DESCRIPTOR:  # signature, CRC-32, then both sizes in 4 bytes each, or 8 in zip64
        tail = _pread(fd, 24, end)
        forms = [struct.pack("<4s3L", b"PK\x07\x08", crc, size, size)] if size < _U32 else []
        forms.append(struct.pack("<4sL2Q", b"PK\x07\x08", crc, size, size))
        n = next((len(f) for f in forms if tail[: len(f)] == f), 0)
        if not n:
            raise CorruptDumpError(
                f"{shown}: its data descriptor does not follow its {size} bytes (misframed record); refusing to map it"
            )
        end += n
    return data, end


def _check_crc(fd: int, rec: Record, where: str) -> None:
    if rec.crc == 0 and rec.described:  # torch.save with compute_crc32=False: none written, the descriptor framed it
        return
    crc = 0
    pos = rec.offset
    end = rec.offset + rec.size
    while pos < end:
        chunk = os.pread(fd, min(1 << 20, end - pos), pos)
        if not chunk:
            break
        crc, pos = zlib.crc32(chunk, crc), pos + len(chunk)
    if crc != rec.crc or pos != end:
        raise CorruptDumpError(
            f"{where}: zip record {rec.name}: its bytes do not match their CRC-32 (damaged on disk or in transfer)"
        )


@functools.cache
def _storage_itemsizes() -> dict[str, int]:
    """``module.name`` of each storage type torch's weights-only unpickler accepts -> its element size."""
    out = {"torch.storage.UntypedStorage": 1}
    with warnings.catch_warnings():  # a legacy storage class's dtype warns that TypedStorage is deprecated
        warnings.simplefilter("ignore")
        for mod, prefix in ((torch, "torch"), (torch.cuda, "torch.cuda")):
            for n in dir(mod):
                dtype = getattr(getattr(mod, n), "dtype", None) if n.endswith("Storage") else None
                if isinstance(dtype, torch.dtype):
                    out[f"{prefix}.{n}"] = dtype.itemsize
    return out


class _Inert:
    """What every global of the listing pass is: accepts any call, state or item, and does nothing."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def __setstate__(self, _: Any) -> None:
        pass

    def __setitem__(self, _: Any, __: Any) -> None:
        pass

    def append(self, _: Any) -> None:
        pass

    def extend(self, _: Any) -> None:
        pass


@dataclass(frozen=True)
class _StorageType:
    itemsize: int


class _Lister(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.storages: dict[str, tuple[int, int, str]] = {}  # key -> (numel, itemsize, storage type)

    def find_class(self, module: str, name: str) -> Any:
        size = _storage_itemsizes().get(f"{module}.{name}")
        return _Inert if size is None else _StorageType(size)

    def persistent_load(self, pid: Any) -> Any:
        kind = (
            pid[0].decode("ascii", "replace")
            if type(pid) is tuple and pid and type(pid[0]) is bytes
            else pid[0]
            if type(pid) is tuple and pid
            else None
        )
        if (
            kind != "storage"
            or len(pid) != 5
            or not isinstance(pid[1], _StorageType)
            or type(pid[2]) is not str
            or type(pid[4]) is not int
            or pid[4] < 0
        ):
            raise pickle.UnpicklingError(f"a persistent id that is not a storage: {show(pid)[:60]}")
        seen = self.storages.setdefault(pid[2], (pid[4], pid[1].itemsize, repr(pid[1])))
        if seen[:2] != (pid[4], pid[1].itemsize):
            raise pickle.UnpicklingError(f"storage {show(pid[2])} declared twice with different sizes")
        return _Inert()


def pickled_storages(data: bytes, where: str) -> dict[str, int]:
    """key -> byte size of every storage a ``torch.save`` pickle references, listed without running it."""
    lister = _Lister(data)
    try:
        lister.load()
    except Exception as e:  # noqa: BLE001 - any failure of the inert pass is a refused file
        raise CorruptDumpError(
            f"{where}: {_NOT_ZIP} (its pickle: {printable(' '.join(str(e).split())[:120])})"
        ) from None
    return {k: n * size for k, (n, size, _) in lister.storages.items()}


def check_archive(path: Path, where: str) -> os.stat_result:
    """Refuse ``path`` unless every byte torch.load would map is framed as described above; return its stat."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        raise CorruptDumpError(f"{where}: cannot open ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptDumpError(f"{where}: {file_kind(st.st_mode)}, not a regular file; refusing to read it")
        records = read_records(fd, st.st_size, where)
        folder = next(iter(records)).partition(b"/")[0] if records else b""
        pkl = records.get(folder + b"/data.pkl")
        if pkl is None or pkl.size > MAX_PICKLE_BYTES:
            what = "no data.pkl record" if pkl is None else f"a {pkl.size}-byte pickle (at most {MAX_PICKLE_BYTES})"
            raise CorruptDumpError(f"{where}: {_NOT_ZIP} ({what})")
        for rec in records.values():
            _check_crc(fd, rec, where)
        for key, nbytes in pickled_storages(_pread(fd, pkl.size, pkl.offset), where).items():
            rec = records.get(folder + b"/data/" + key.encode("utf-8", "surrogatepass").lower())
            if rec is None or rec.size != nbytes:
                have = "no such record" if rec is None else f"its record holds {rec.size}"
                raise CorruptDumpError(
                    f"{where}: storage {show(key)} needs {nbytes} bytes but {have}; refusing to map it"
                )
        return st
    finally:
        os.close(fd)
