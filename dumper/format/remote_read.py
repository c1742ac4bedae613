"""Reading a dump at an fsspec URL in place: its manifest, then byte ranges of the files it lists, no local copy.

:class:`~dumper.format.reader.DumpReader` reads a URL (:func:`~dumper.format.remote.is_url`) through
:class:`RemoteDump`. The manifest is read as :func:`~dumper.format.remote.fetched` reads it (bounded by
:data:`~dumper.format.validate.MAX_MANIFEST_BYTES`, then every rule of
:func:`~dumper.format.manifest.parse_manifest`: one plain name per entry, so none leaves the prefix). A
data file is touched only when a tensor of it is first wanted: its object's size is checked once against
the manifest (longer or shorter is refused, naming it), then its safetensors header and each tensor are
fetched by ranged reads (:meth:`RemoteDump.read`: no read-ahead cache; a range over 8 MiB comes as parts,
:data:`~dumper.format.remote.IN_FLIGHT` at a time). Only the names the manifest lists are ever asked of
the filesystem. What is read is real memory, not a page-cache mapping, so the reader keeps it in a
:class:`LoadCache` bounded by bytes (:data:`CACHE_BYTES`) besides what is in use: a dump larger than
memory streams.

Example::

    from dumper.format import DumpReader
    reader = DumpReader("s3://bucket/dumps/nightly")
    rec = reader.manifest.tensors[0]
    print(reader.directory / rec.file, reader.rows(rec).shape)   # s3://bucket/dumps/nightly/r0-...
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from dumper.errors import CorruptDumpError, DriftscopeError
from dumper.format.manifest import Manifest, load_manifest
from dumper.format.remote import CHUNK_BYTES, IN_FLIGHT, is_url, read_manifest_at, remote_error, url_fs

__all__ = ["CACHE_BYTES", "DumpURL", "RemoteDump", "LoadCache", "dump_manifest"]

CACHE_BYTES = 32 << 20
"""Most bytes of tensors read from a URL that one reader keeps for reuse besides those in use (least recently used
dropped first): a comparison's two readers keep at most 64 MiB."""
_PART = CHUNK_BYTES
"""A ranged read longer than this is fetched as parts of this size, several at once."""

V = TypeVar("V")


class DumpURL(str):
    """A dump's URL that joins a name as a :class:`~pathlib.Path` does (``url / name``) and prints as the URL
    (``Path("s3://b/a")`` would collapse the ``//``)."""

    __slots__ = ()

    def __truediv__(self, name: str) -> DumpURL:
        return DumpURL(f"{self}/{name}")


def dump_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the dump at ``path``: a local directory (:func:`load_manifest`) or a URL."""
    return RemoteDump(path).manifest() if is_url(path) else load_manifest(path)


class RemoteDump:
    """The objects of one dump at a URL, read only by the names its manifest lists, each failure one line."""

    def __init__(self, url: str | os.PathLike[str]) -> None:
        self.url = DumpURL(os.fspath(url).rstrip("/"))
        self._fs, self._root = url_fs(self.url)

    def manifest(self) -> Manifest:
        """``manifest.json``, read bounded and validated by every rule a local manifest meets."""
        return read_manifest_at(self._fs, self._root, self.url)[1]

    def _call(self, name: str, fn: Callable[..., V], *args: Any, **kwargs: Any) -> V:
        """``fn(*args, **kwargs)`` on the filesystem; any failure of it is one line naming the file."""
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise CorruptDumpError(f"{self.url / name}: listed in the manifest but missing") from None
        except DriftscopeError:
            raise
        except Exception as e:  # s3fs, gcsfs, aiohttp...: their own types; a type and a first line, never a trace
            raise remote_error(self.url / name, e) from None

    def check_size(self, name: str, size: int) -> None:
        """Refuse the object ``name`` unless it is a file of exactly ``size`` bytes (the manifest's entry)."""
        info = self._call(name, self._fs.info, f"{self._root}/{name}")
        if info.get("type") != "file":
            raise CorruptDumpError(f"{self.url / name}: not a file ({info.get('type')}); refusing to read it")
        actual = info.get("size")
        if type(actual) is not int:
            raise CorruptDumpError(f"{self.url / name}: the filesystem gives no size ({actual!r}); refusing it")
        if actual > size:
            raise CorruptDumpError(f"{self.url / name}: longer than the {size} bytes the manifest says; refusing it")
        if actual < size:
            raise CorruptDumpError(f"{self.url / name}: {actual} bytes, but the manifest says {size}")

    def read(self, name: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of the object ``name``, exactly: a ranged read, or parts read several at once."""
        path = f"{self._root}/{name}"
        if end - start <= _PART:
            return self._exact(name, self._call(name, self._fs.cat_file, path, start=start, end=end), start, end)
        out = bytearray(end - start)
        bounds = [(s, min(s + _PART, end)) for s in range(start, end, _PART)]
        for i in range(0, len(bounds), IN_FLIGHT):
            group = bounds[i : i + IN_FLIGHT]
            parts = self._call(
                name,
                self._fs.cat_ranges,
                [path] * len(group),
                [s for s, _ in group],
                [e for _, e in group],
                on_error="raise",
            )
            for (s, e), part in zip(group, parts, strict=True):
                out[s - start : e - start] = self._exact(name, part, s, e)
            del parts
        return out

    def _exact(self, name: str, data: Any, start: int, end: int) -> bytes:
        if not isinstance(data, bytes) or len(data) != end - start:
            got = len(data) if isinstance(data, bytes) else type(data).__name__
            raise CorruptDumpError(
                f"{self.url / name}: {got} bytes at offset {start}, {end - start} expected "
                "(the object changed while it was read)"
            )
        return data


class LoadCache(Generic[V]):
    """Values by key, each loaded once however many threads ask for it at a time.

    Up to ``limit`` of them by ``weight`` are kept, the least recently used dropped first (a value
    heavier than ``limit`` is not kept); a value still in use anywhere (held by a caller, or by a view
    of it) is handed out again without a load, whatever it weighs, as it costs no more memory. A load
    runs outside the lock, so loads of different keys overlap (several reads in flight); a thread
    asking for a key being loaded waits for that load, and gets its error when it fails.
    """

    def __init__(self, limit: int, weight: Callable[[V], int]) -> None:
        self.limit, self._weight = limit, weight
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._alive: weakref.WeakValueDictionary[Hashable, Any] = weakref.WeakValueDictionary()
        self._held = 0
        self._loading: dict[Hashable, Future[V]] = {}
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """The weight of the values kept now (at most ``limit``)."""
        return self._held

    def get(self, key: Hashable, load: Callable[[], V]) -> V:
        """The value of ``key``: kept, being loaded by another thread (waited for), or ``load()`` now."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            alive = self._alive.get(key)
            if alive is not None:
                return alive  # in use elsewhere: no memory to save by reading it again
            pending = self._loading.get(key)
            if pending is None:
                mine = self._loading[key] = Future()
        if pending is not None:
            return pending.result()
        try:
            value = load()
        except BaseException as e:
            with self._lock:
                del self._loading[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._loading[key]
            self._keep(key, value)
        mine.set_result(value)
        return value

    def _keep(self, key: Hashable, value: V) -> None:
        self._alive[key] = value
        w = self._weight(value)
        if w > self.limit:
            return
        self._items[key] = value
        self._held += w
        while self._held > self.limit:
            _, old = self._items.popitem(last=False)
            self._held -= self._weight(old)
