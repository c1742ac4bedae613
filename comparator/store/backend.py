"""Where a run store keeps its bytes: a local directory, or any fsspec filesystem.

Two ways to publish a run whole, chosen by what the filesystem can do:

* **local directories** (a plain path or a ``file://`` URL): the run is written into
  ``runs/.tmp-<run_id>-<random>/`` and renamed to ``runs/<run_id>`` with ``os.rename``, which
  is atomic, so a reader never sees a half-written run folder;
* **fsspec backends** (``s3://``, ``gcs://``, ``hf://``, ``memory://``, ...): object stores have
  no atomic rename (``mv`` is copy + delete, object by object), so the run is written straight
  into ``runs/<run_id>/`` and its ``COMPLETE`` marker is written last
  (:class:`comparator.store.fsspec_backend.FsspecBackend`).

Both write the marker last, so one rule decides completeness everywhere: a run folder without
``COMPLETE`` is incomplete and never selected.

Containment: every relative path is checked by :func:`check_rel` (no absolute path, no ``..``),
and a local store also resolves symlinks and refuses any path whose real path leaves the store
root. Local files are ``stat``-ed before they are opened and opened non-blocking, so a FIFO, a
device or a directory where a file belongs is reported, never opened (a FIFO would block).

The interface (:class:`Backend`) and the path checks live in :mod:`comparator.store.backend_base`
(re-exported here), so both backends import it and :func:`open_backend` imports both, with no cycle.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO

from comparator.store.backend_base import (
    CHUNK,
    MAX_SMALL_FILE,
    Backend,
    EntryKind,
    ReadResult,
    check_rel,
    copy_limited,
    too_big,
)
from comparator.store.errors import StoreError, UnsafePathError
from comparator.store.fsspec_backend import FsspecBackend
from dumper.format import atomic_path, fsync_dir
from dumper.format.files import file_kind

__all__ = ["LocalBackend", "open_backend"]

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class LocalBackend(Backend):
    """A store on a local (or mounted) directory: files fsynced, runs published by ``os.rename``."""

    atomic_rename = True

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url

    def _p(self, rel: str) -> Path:
        return self.root / check_rel(rel, self.url)

    def _resolve(self, rel: str) -> tuple[Path, str]:
        """``root/rel`` and its real path, refusing (:class:`UnsafePathError`) one that leaves the root."""
        path = self._p(rel)
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafePathError(f"{path}: resolves to {real}, outside the store {root}; refusing to follow it")
        return path, real

    def _open_regular(self, rel: str, what: str = "a file") -> IO[bytes]:
        """Open ``rel`` for reading after checking (``stat``, not ``open``) that it is a regular file in the store."""
        path, real = self._resolve(rel)
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path}: {file_kind(st.st_mode)} where {what} belongs; not opened")
        f = os.fdopen(os.open(real, _OPEN_FLAGS), "rb")
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):  # swapped since the stat: still never read
            f.close()
            raise UnsafePathError(f"{path}: {file_kind(mode)} where {what} belongs; not read")
        return f

    def _read(self, rel: str, max_bytes: int) -> ReadResult:
        path = self.root / rel
        try:
            with self._open_regular(rel) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(max_bytes + 1) if size <= max_bytes else b""
        except StoreError as e:
            return e
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            return StoreError(f"{path}: cannot read ({e.strerror or e})")
        if size > max_bytes or len(data) > max_bytes:  # (a file that grew while read)
            return too_big(str(path), size if size > max_bytes else None, max_bytes)
        return data

    def staging(self, run_id: str) -> str:
        return f"runs/.tmp-{run_id}-{secrets.token_hex(4)}"

    def publish(self, staging: str, final: str) -> None:
        src, dst = self._p(staging), self._p(final)
        for folder, _, _ in os.walk(src):
            fsync_dir(folder)
        if dst.exists():
            raise StoreError(f"{dst}: a run with this id already exists; not overwriting it")
        os.rename(src, dst)
        fsync_dir(dst.parent)

    def exists(self, rel: str) -> bool:
        return self._p(rel).exists()

    def entry_kind(self, rel: str) -> EntryKind | None:
        path = self._p(rel)
        if "/" in rel:
            self._resolve(rel.rsplit("/", 1)[0])
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreError(f"{path}: cannot stat ({e.strerror or e})") from None
        return (
            "symlink"
            if stat.S_ISLNK(mode)
            else "dir"
            if stat.S_ISDIR(mode)
            else "file"
            if stat.S_ISREG(mode)
            else "other"
        )

    def list_entries(self, rel: str) -> list[tuple[str, EntryKind]]:
        path, real = self._resolve(rel)
        try:
            with os.scandir(real) as it:
                return sorted((e.name, _entry_kind(e)) for e in it)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise StoreError(f"{path}: not a folder") from None
        except OSError as e:
            raise StoreError(f"{path}: cannot list ({e.strerror or e})") from None

    def read_many(self, rels: list[str], *, max_bytes: int = MAX_SMALL_FILE) -> dict[str, ReadResult]:
        return {rel: self._read(rel, max_bytes) for rel in rels}

    def write_bytes(self, rel: str, data: bytes) -> None:
        path, _ = self._resolve(rel)  # before mkdir: a symlinked folder must not make it create outside
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # replaces a symlink at ``path`` itself, never writes through it
            tmp.write_bytes(data)

    def upload(self, local: Path, rel: str) -> None:
        path, _ = self._resolve(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _open_source(local) as src, open(path, "xb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
            dst.flush()
            os.fsync(dst.fileno())

    def download(self, rel: str, local: Path, *, max_bytes: int | None = None) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._open_regular(rel) as src, open(local, "wb") as dst:
                copy_limited(src, dst, max_bytes, str(self.root / rel))
        except FileNotFoundError:
            raise StoreError(f"{self.root / rel}: missing") from None

    def remove_tree(self, rel: str) -> None:
        # rename out of the listing first (atomic), then delete at leisure; never through a symlink
        path = self._p(rel)
        if "/" in rel:
            self._resolve(rel.rsplit("/", 1)[0])  # the folder holding it stays inside the store
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode):
            raise UnsafePathError(f"{path}: {file_kind(mode)}, not a run folder; not deleting it")
        trash = path.with_name(f".trash-{path.name}-{secrets.token_hex(4)}")
        os.rename(path, trash)
        shutil.rmtree(trash)  # unlinks symlinks inside, never follows them

    def newest_mtime(self, rel: str) -> float | None:
        newest = None
        for folder, _, files in os.walk(self._resolve(rel)[1]):
            for p in (folder, *(os.path.join(folder, f) for f in files)):
                try:
                    t = os.lstat(p).st_mtime
                except FileNotFoundError:
                    continue
                newest = t if newest is None else max(newest, t)
        return newest

    def local_path(self, rel: str) -> Path | None:
        return self._resolve(rel)[0]

    def check_in_place(self, rel: str, within: str) -> None:
        path, real = self._resolve(rel)
        _, top = self._resolve(within)
        if not real.startswith(top.rstrip(os.sep) + os.sep):
            raise UnsafePathError(f"{path}: resolves to {real}, outside {self.root / within}; refusing to read it")
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            raise StoreError(f"{path}: listed in the dump's manifest but missing") from None
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"{path}: {file_kind(mode)} where a dump file belongs; not opened")


def _entry_kind(e: os.DirEntry[str]) -> EntryKind:
    if e.is_symlink():
        return "symlink"
    if e.is_dir(follow_symlinks=False):
        return "dir"
    return "file" if e.is_file(follow_symlinks=False) else "other"


def _open_source(local: Path) -> IO[bytes]:
    """Open a file of the dump being stored; a FIFO or a directory is refused, never opened."""
    mode = os.stat(local).st_mode
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{local}: {file_kind(mode)}, not a regular dump file; not storing it")
    return open(local, "rb")


def open_backend(url: str | os.PathLike[str]) -> Backend:
    """A plain path or a ``file://`` URL gives a local store; any other URL goes through fsspec."""
    s = os.fspath(url)
    if "://" not in s and "::" not in s:
        return LocalBackend(Path(s), s)
    import fsspec  # an optional dependency, loaded only for a URL
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, root = fsspec.core.url_to_fs(s)
    except ImportError as e:
        raise StoreError(f"{s}: the filesystem for this URL is not installed ({e})") from None
    except ValueError as e:
        raise StoreError(f"{s}: not a usable store URL ({e})") from None
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(Path(root), s)
    return FsspecBackend(fs, root, s)
