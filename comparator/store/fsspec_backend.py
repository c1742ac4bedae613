"""A run store on any fsspec filesystem (``s3://``, ``gcs://``, ``hf://``, ``memory://``, ...).

Object stores have no atomic rename (``mv`` is copy + delete, object by object), so a run is
written straight into ``runs/<run_id>/`` and its ``COMPLETE`` marker is written last; a run
folder without the marker is incomplete and never selected (:mod:`comparator.store.backend`). It
implements :class:`comparator.store.backend_base.Backend` (imported from there, never from the picker).
:func:`comparator.store.backend.open_backend` picks this backend for any URL that is not local.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

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

__all__ = ["FsspecBackend"]


class FsspecBackend(Backend):
    """A store on any fsspec filesystem; completeness rests on the ``COMPLETE`` marker written last."""

    atomic_rename = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _p(self, rel: str) -> str:
        return f"{self.root}/{check_rel(rel, self.url)}"

    def staging(self, run_id: str) -> str:
        return f"runs/{run_id}"

    def publish(self, staging: str, final: str) -> None:
        if staging != final:  # pragma: no cover - staging() never differs here
            raise StoreError(f"{self.url}: cannot rename {staging} to {final} on this filesystem")

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._p(rel)))

    def list_entries(self, rel: str) -> list[tuple[str, EntryKind]]:
        path = self._p(rel)
        self.fs.invalidate_cache(path)  # listings are cached per instance (s3fs, gcsfs)
        try:
            infos = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot list ({type(e).__name__}: {e})") from None
        itself = str(self.fs._strip_protocol(path)).rstrip("/")
        out: list[tuple[str, EntryKind]] = []
        for info in infos:
            name = str(info.get("name", "")).rstrip("/")
            if name == itself:  # some filesystems list a file as itself
                raise StoreError(f"{self.url}/{rel}: not a folder")
            kind = {"directory": "dir", "file": "file", "link": "symlink"}.get(str(info.get("type")), "other")
            if name.rsplit("/", 1)[-1]:
                out.append((name.rsplit("/", 1)[-1], kind))  # type: ignore[arg-type]
        return sorted(out)

    def read_many(self, rels: list[str], *, max_bytes: int = MAX_SMALL_FILE) -> dict[str, ReadResult]:
        if not rels:
            return {}
        got = self.fs.cat_ranges([self._p(rel) for rel in rels], 0, max_bytes + 1, on_error="return")
        out: dict[str, ReadResult] = {}
        for rel, value in zip(rels, got, strict=True):
            where = f"{self.url}/{rel}"
            if isinstance(value, FileNotFoundError) or value is None:
                out[rel] = None
            elif isinstance(value, IsADirectoryError):
                out[rel] = UnsafePathError(f"{where}: a directory where a file belongs")
            elif isinstance(value, BaseException):
                out[rel] = StoreError(f"{where}: cannot read ({type(value).__name__}: {value})")
            else:
                out[rel] = too_big(where, None, max_bytes) if len(value) > max_bytes else bytes(value)
        return out

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(rel), data)

    def upload(self, local: Path, rel: str) -> None:
        with open(local, "rb") as src, self.fs.open(self._p(rel), "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)

    def download(self, rel: str, local: Path, *, max_bytes: int | None = None) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        where = f"{self.url}/{rel}"
        try:
            with self.fs.open(self._p(rel), "rb") as src, open(local, "xb") as dst:
                copy_limited(src, dst, max_bytes, where)
        except FileNotFoundError:
            raise StoreError(f"{where}: listed in the dump's manifest but missing") from None
        except (OSError, ValueError) as e:
            raise StoreError(f"{where}: cannot download ({type(e).__name__}: {e})") from None

    def remove_tree(self, rel: str) -> None:
        # the marker goes first: a half-deleted run lists as incomplete, never as complete
        marker = self._p(f"{rel}/COMPLETE")
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        self.fs.rm(self._p(rel), recursive=True)

    def newest_mtime(self, rel: str) -> float | None:
        return None
