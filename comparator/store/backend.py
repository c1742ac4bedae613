"""Where a run store keeps its bytes: a local directory, or any fsspec filesystem.

Two ways to publish a run whole, chosen by what the filesystem can do:

* **local directories** (a plain path or a ``file://`` URL): the run is written into
  ``runs/.tmp-<run_id>-<random>/`` and renamed to ``runs/<run_id>`` with ``os.rename``, which
  is atomic, so a reader never sees a half-written run folder;
* **fsspec backends** (``s3://``, ``gcs://``, ``hf://``, ``memory://``, ...): object stores have
  no atomic rename (``mv`` is copy + delete, object by object), so the run is written straight
  into ``runs/<run_id>/`` and its ``COMPLETE`` marker is written last.

Both write the marker last, so one rule decides completeness everywhere: a run folder without
``COMPLETE`` is incomplete and never selected.
"""

from __future__ import annotations

import abc
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from dumper.format import atomic_path, fsync_dir

from .errors import StoreError

__all__ = ["Backend", "LocalBackend", "FsspecBackend", "open_backend"]

CHUNK = 8 << 20
"""Bytes per read/write when streaming a file to or from the store."""


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
    def list_dir(self, rel: str) -> list[str]:
        """Names of the entries of a folder; ``[]`` when it does not exist."""

    @abc.abstractmethod
    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        """The bytes of each file, ``None`` for a missing one (one batched request where possible)."""

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Create or replace a small file atomically (a reader sees the old or the new bytes)."""

    @abc.abstractmethod
    def upload(self, local: Path, rel: str) -> None:
        """Stream a local file into the store."""

    @abc.abstractmethod
    def download(self, rel: str, local: Path) -> None:
        """Stream a file of the store into a local file."""

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Delete a run folder so that it never lists as complete while half deleted."""

    @abc.abstractmethod
    def newest_mtime(self, rel: str) -> float | None:
        """Latest modification time (epoch seconds) of anything in a folder, if the backend knows it."""

    def local_path(self, rel: str) -> Path | None:
        """A local path to read ``rel`` in place, or ``None`` when it must be downloaded."""
        return None

    def read_bytes(self, rel: str) -> bytes | None:
        return self.read_many([rel])[rel]


class LocalBackend(Backend):
    """A store on a local (or mounted) directory: files fsynced, runs published by ``os.rename``."""

    atomic_rename = True

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url

    def _p(self, rel: str) -> Path:
        return self.root / rel

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

    def list_dir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(rel)))
        except FileNotFoundError:
            return []

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        for rel in rels:
            try:
                out[rel] = self._p(rel).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                out[rel] = None
        return out

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._p(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)

    def upload(self, local: Path, rel: str) -> None:
        path = self._p(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
            dst.flush()
            os.fsync(dst.fileno())

    def download(self, rel: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._p(rel), local)

    def remove_tree(self, rel: str) -> None:
        # rename out of the listing first (atomic), then delete at leisure
        path = self._p(rel)
        trash = path.with_name(f".trash-{path.name}-{secrets.token_hex(4)}")
        os.rename(path, trash)
        shutil.rmtree(trash)

    def newest_mtime(self, rel: str) -> float | None:
        newest = None
        for folder, _, files in os.walk(self._p(rel)):
            for p in (folder, *(os.path.join(folder, f) for f in files)):
                try:
                    t = os.stat(p).st_mtime
                except FileNotFoundError:
                    continue
                newest = t if newest is None else max(newest, t)
        return newest

    def local_path(self, rel: str) -> Path | None:
        return self._p(rel)


class FsspecBackend(Backend):
    """A store on any fsspec filesystem; completeness rests on the ``COMPLETE`` marker written last."""

    atomic_rename = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def staging(self, run_id: str) -> str:
        return f"runs/{run_id}"

    def publish(self, staging: str, final: str) -> None:
        if staging != final:  # pragma: no cover - staging() never differs here
            raise StoreError(f"{self.url}: cannot rename {staging} to {final} on this filesystem")

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._p(rel)))

    def list_dir(self, rel: str) -> list[str]:
        path = self._p(rel)
        self.fs.invalidate_cache(path)  # listings are cached per instance (s3fs, gcsfs)
        try:
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in names)

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        if not rels:
            return {}
        paths = {self._p(rel): rel for rel in rels}
        got = self.fs.cat(list(paths), on_error="return")
        out: dict[str, bytes | None] = {}
        for path, rel in paths.items():
            value = got.get(path, got.get(self.fs._strip_protocol(path)))
            if isinstance(value, FileNotFoundError) or value is None:
                out[rel] = None
            elif isinstance(value, BaseException):
                raise StoreError(f"{self.url}/{rel}: cannot read ({type(value).__name__}: {value})")
            else:
                out[rel] = bytes(value)
        return out

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(rel), data)

    def upload(self, local: Path, rel: str) -> None:
        with open(local, "rb") as src, self.fs.open(self._p(rel), "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)

    def download(self, rel: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open(self._p(rel), "rb") as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)

    def remove_tree(self, rel: str) -> None:
        # the marker goes first: a half-deleted run lists as incomplete, never as complete
        marker = self._p(f"{rel}/COMPLETE")
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        self.fs.rm(self._p(rel), recursive=True)

    def newest_mtime(self, rel: str) -> float | None:
        return None


def open_backend(url: str | os.PathLike[str]) -> Backend:
    """A plain path or a ``file://`` URL gives a local store; any other URL goes through fsspec."""
    s = os.fspath(url)
    if "://" not in s and "::" not in s:
        return LocalBackend(Path(s), s)
    import fsspec
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
