"""The interface every run-store backend implements, and the path checks they share.

:class:`Backend` is file operations on paths relative to the store root; :func:`check_rel` and
:func:`plain_name` refuse any path that could leave it. The backends themselves are
:class:`comparator.store.backend.LocalBackend` and :class:`comparator.store.fsspec_backend.FsspecBackend`;
:func:`comparator.store.backend.open_backend` picks one by URL. Kept apart from both, so that
each backend imports the interface and the picker imports each backend, without an import cycle.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import IO, Any, Literal

from comparator.store.errors import StoreError, UnsafePathError
from dumper.format.files import is_plain_name

__all__ = [
    "Backend",
    "check_rel",
    "plain_name",
    "too_big",
    "copy_limited",
    "EntryKind",
    "ReadResult",
    "CHUNK",
    "MAX_SMALL_FILE",
]


CHUNK = 8 << 20
"""Bytes per read/write when streaming a file to or from the store."""
MAX_SMALL_FILE = 4 << 20
"""Most bytes read by default from one small store file (``run.json``, ``COMPLETE``): a few KiB when sound."""

EntryKind = Literal["file", "dir", "symlink", "other"]
"""What a listed entry is, as the listing itself says (symlinks are not followed)."""
ReadResult = bytes | None | StoreError
"""One file of :meth:`Backend.read_many`: its bytes, ``None`` when missing, or why it cannot be read safely."""


def check_rel(rel: str, where: str) -> str:
    """``rel`` if it is a relative store path of plain ``/``-separated names, else :class:`UnsafePathError`.

    Refused: an absolute or empty path, ``.``/``..``/empty parts, backslashes and NUL bytes, any
    of which could leave the store root (or mean another file on another filesystem).
    """
    parts = rel.split("/") if isinstance(rel, str) else [""]
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"{where}: refusing path {rel!r} (absolute, empty, or leaving the store)")
    return rel


def plain_name(name: Any, where: str) -> str:
    """``name`` if it is one plain file name (the dump format's rule, :func:`dumper.format.files.is_plain_name`),
    else :class:`UnsafePathError`."""
    if not is_plain_name(name):
        raise UnsafePathError(f"{where}: refusing file name {name!r} (not one plain name inside the dump)")
    return name


def too_big(where: str, size: int | None, limit: int) -> StoreError:
    """``size`` is ``None`` when only "more than ``limit``" is known (a stream cut short)."""
    what = f"more than {limit}" if size is None else f"{size}"
    return StoreError(f"{where}: {what} bytes, over the {limit} bytes this store reads for it; refusing it")


def copy_limited(src: IO[bytes], dst: IO[bytes], limit: int | None, where: str) -> None:
    """Stream ``src`` into ``dst``; more than ``limit`` bytes is an error (the file is not what it claims)."""
    done = 0
    while chunk := src.read(CHUNK if limit is None else min(CHUNK, limit + 1 - done)):
        done += len(chunk)
        if limit is not None and done > limit:
            raise too_big(where, None, limit)
        dst.write(chunk)


class Backend(abc.ABC):
    """File operations on paths relative to the store root, with ``/`` separators."""

    url: str
    atomic_rename: bool
    """True when :meth:`publish` renames a staging folder atomically."""

    @abc.abstractmethod
    def staging(self, run_id: str) -> str:
        """Where a new run is written before :meth:`publish` (relative path)."""

    @abc.abstractmethod
    def publish(self, staging: str, final: str) -> None:
        """Make the run written at ``staging`` visible at ``final``."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def list_entries(self, rel: str) -> list[tuple[str, EntryKind]]:
        """``(name, kind)`` of each entry of a folder, sorted by name; ``[]`` when it does not exist.

        Raises :class:`StoreError` when ``rel`` is not a folder, or leaves the store.
        """

    def list_dir(self, rel: str) -> list[str]:
        """Names of the entries of a folder; ``[]`` when it does not exist."""
        return [name for name, _ in self.list_entries(rel)]

    def entry_kind(self, rel: str) -> EntryKind | None:
        """What ``rel`` is, as its folder's listing says (symlinks not followed); ``None`` when missing."""
        parent, _, name = rel.rpartition("/")
        return dict(self.list_entries(parent)).get(name) if parent else None

    @abc.abstractmethod
    def read_many(self, rels: list[str], *, max_bytes: int = MAX_SMALL_FILE) -> dict[str, ReadResult]:
        """Each file's bytes, ``None`` for a missing one, or a :class:`StoreError` saying why it is not read.

        One batched request where possible. Never raises for one bad entry (a directory, a FIFO,
        a symlink out of the store, more than ``max_bytes`` bytes), so a listing always completes.
        """

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Create or replace a small file atomically (a reader sees the old or the new bytes)."""

    @abc.abstractmethod
    def upload(self, local: Path, rel: str) -> None:
        """Stream a local file into the store."""

    @abc.abstractmethod
    def download(self, rel: str, local: Path, *, max_bytes: int | None = None) -> None:
        """Stream a file of the store into a local file; more than ``max_bytes`` bytes is a :class:`StoreError`."""

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Delete a run folder so that it never lists as complete while half deleted."""

    @abc.abstractmethod
    def newest_mtime(self, rel: str) -> float | None:
        """Latest modification time (epoch seconds) of anything in a folder, if the backend knows it."""

    def local_path(self, rel: str) -> Path | None:
        """A local path to read ``rel`` in place (checked to stay inside the store), or ``None`` when it
        must be downloaded."""
        return None

    def check_in_place(self, rel: str, within: str) -> None:
        """Refuse (:class:`UnsafePathError`) to read ``rel`` in place unless it is a regular file whose
        real path stays inside the folder ``within``; a no-op where files are downloaded, not read in place."""
        return None

    def read_bytes(self, rel: str, *, max_bytes: int = MAX_SMALL_FILE) -> bytes | None:
        """One file's bytes, ``None`` when missing; :class:`StoreError` when it cannot be read safely."""
        got = self.read_many([rel], max_bytes=max_bytes)[rel]
        if isinstance(got, StoreError):
            raise got
        return got
