"""Atomic, durable file writes with the user's umask: how every dump, report and store file is written.

A file is written under a unique temporary name beside its final path, fsynced, renamed over
the final path and its directory fsynced, so a reader sees either the old file or the whole new
one, and a crash leaves at most a hidden ``.NAME.XXXX.tmp`` behind, never a truncated file under
the real name. Files get ``0o666 & ~umask`` (unlike :func:`tempfile.mkstemp`'s 0600), so a
shared baseline store or a CI artifact is as readable as any file the user writes.

Example::

    from dumper.format.atomic import atomic_path, write_json_atomic
    write_json_atomic("out/report.json", {"passed": True})
    with atomic_path("out/table.csv") as tmp:   # write tmp any way you like
        tmp.write_text("a,b\\n1,2\\n")
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dumper.errors import DumpError, UsageError

__all__ = ["atomic_path", "atomic_dir", "check_new_dir", "write_json_atomic", "fsync_dir", "file_mode", "dir_mode"]


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
        tmp = str(path.parent / f".{path.name}.{os.urandom(6).hex()}.tmp")
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


def check_new_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a directory to create: refused (naming ``flag``) when it exists and is not an empty directory, so
    that nothing already stored there is lost."""
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UsageError(f"{flag} {root}: exists and is not an empty directory; name a new one")
    return root


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], flag: str) -> Iterator[Path]:
    """Yield a temporary directory beside ``path`` (:func:`check_new_dir` first); on success give it the user's umask
    and rename it to ``path``, so an interrupted writer leaves nothing under the real name. On an exception it is
    removed."""
    root = check_new_dir(path, flag)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
    try:
        yield tmp
        os.chmod(tmp, dir_mode())  # mkdtemp makes it 0700
        if root.exists():  # an empty directory the user made for it
            root.rmdir()
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root.parent)
