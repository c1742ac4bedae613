"""Dumps at fsspec URLs (``s3://bucket/prefix``, ``gcs://...``, ``memory://...``): written manifest last, read
only as far as the manifest vouches.

**Writing** (:func:`writing`): the dump is made in a local staging directory as any dump is, then
its data files are uploaded (several at once) and ``manifest.json`` last, so a reader never takes a
half-written dump for a whole one: without the manifest a prefix is an incomplete dump. A URL that
already holds a manifest is refused (nothing stored is lost); a writer that dies on the way leaves
data files and no manifest.

**Reading** (:func:`fetched`): ``manifest.json`` is read (bounded by
:data:`~dumper.format.validate.MAX_MANIFEST_BYTES`) and validated by every rule a local manifest
meets (:func:`~dumper.format.manifest.parse_manifest`: one plain file name per entry, so no entry
can point outside the prefix). Then exactly the files it lists are streamed to a local directory,
several at once, each cut off at the size the manifest gives it (a file that is longer or shorter
is refused, naming it); the local copy is then read as a local dump is (memory-mapped, every
header checked). Nothing else under the prefix is read. Credentials come from fsspec's own
configuration (``AWS_ENDPOINT_URL``, ``~/.aws``, ...) and are never printed.

Example::

    from dumper.format.remote import fetched
    with fetched("s3://bucket/dumps/nightly") as local:
        report = compare_dumps("dumps/gold", local)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dumper.errors import CorruptDumpError, DumpError, IncompleteDumpError
from dumper.format.files import parse_json
from dumper.format.manifest import MANIFEST_NAME, Manifest, load_manifest, parse_manifest
from dumper.format.validate import MAX_MANIFEST_BYTES

__all__ = [
    "is_url",
    "fetched",
    "writing",
    "upload_dump",
    "upload_files",
    "check_free",
    "read_small",
    "write_small",
    "listed",
    "download",
    "remove_prefix",
    "url_fs",
    "remote_error",
    "read_manifest_at",
    "IN_FLIGHT",
    "CHUNK_BYTES",
]

IN_FLIGHT = 4
"""Files transferred at once."""
CHUNK_BYTES = 8 << 20
"""Bytes of one streamed read or one ranged request."""
_STREAM = {"block_size": CHUNK_BYTES, "cache_type": "none"}
"""Read a file as a stream: no read-ahead cache (fsspec's default holds up to 50 MB a file in flight)."""


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of a filesystem other than the local one (``file://`` is local)."""
    scheme, sep, _ = os.fspath(path).partition("://")
    return bool(sep) and scheme not in ("", "file") and scheme.replace("+", "").replace("-", "").isalnum()


def url_fs(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, root without a trailing ``/``) of ``url``; a one-line error where none serves it."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise DumpError(f"{url}: reading URLs needs fsspec") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise DumpError(
            f"{url}: no filesystem for this URL ({e}); install its fsspec package (s3fs for s3://, gcsfs for gcs://)"
        ) from None
    return fs, root.rstrip("/")


def remote_error(url: str, e: BaseException) -> DumpError:
    """One line for an error of the remote filesystem (its type and first line: never a credential dump)."""
    first = str(e).splitlines()[0] if str(e) else ""
    return DumpError(f"{url}: {type(e).__name__}: {first[:200]}")


def read_manifest_at(fs: Any, root: str, url: str) -> tuple[bytes, Manifest]:
    """The manifest at ``root`` (``url`` names it in errors), as its bytes and validated by every rule a local one
    meets; read bounded, and absent means an incomplete dump."""
    try:
        with fs.open(f"{root}/{MANIFEST_NAME}", "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise IncompleteDumpError(
            f"{url}: no {MANIFEST_NAME} there: not a complete dump (its writer is still running, or died)"
        ) from None
    except OSError as e:
        raise remote_error(url, e) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptDumpError(f"{url}/{MANIFEST_NAME}: over {MAX_MANIFEST_BYTES} bytes; refusing it")
    where = f"{url}/{MANIFEST_NAME}"
    return raw, parse_manifest(parse_json(raw, where, "manifest"), where)


def download(url: str, name: str, size: int, local: Path) -> None:
    """Stream ``url/name`` into the local directory ``local``, refusing it unless it is exactly ``size`` bytes."""
    fs, root = url_fs(url)
    _download(fs, root, url.rstrip("/"), name, size, local)


def _download(fs: Any, root: str, url: str, name: str, size: int, local: Path) -> None:
    """Stream one listed file to ``local``, refusing it when it is not exactly ``size`` bytes."""
    where = f"{url}/{name}"
    try:
        with fs.open(f"{root}/{name}", "rb", **_STREAM) as src, open(local / name, "xb") as dst:
            left = size
            while left > 0:
                chunk = src.read(min(CHUNK_BYTES, left))
                if not chunk:
                    raise CorruptDumpError(f"{where}: {size - left} bytes, but the manifest says {size}")
                dst.write(chunk)
                left -= len(chunk)
            if src.read(1):
                raise CorruptDumpError(f"{where}: longer than the {size} bytes the manifest says; refusing it")
    except FileNotFoundError:
        raise CorruptDumpError(f"{where}: listed in the manifest but missing") from None
    except OSError as e:
        raise remote_error(where, e) from None


@contextlib.contextmanager
def fetched(path: str | os.PathLike[str], *, in_flight: int = IN_FLIGHT) -> Iterator[Path]:
    """``path`` itself when local; for a URL, a local copy of the dump there (removed on exit), made from the
    files its validated manifest lists, manifest last, then loaded as a local dump (:func:`load_manifest`)."""
    if not is_url(path):
        yield Path(path)
        return
    url = os.fspath(path).rstrip("/")
    fs, root = url_fs(url)
    raw, manifest = read_manifest_at(fs, root, url)
    with tempfile.TemporaryDirectory(prefix="driftscope-remote-") as tmp:
        local = Path(tmp) / "dump"
        local.mkdir()
        with ThreadPoolExecutor(max_workers=max(1, in_flight)) as pool:
            for f in [
                pool.submit(_download, fs, root, url, name, size, local)
                for name, size in sorted(manifest.files.items())
            ]:
                f.result()
        (local / MANIFEST_NAME).write_bytes(raw)
        load_manifest(local)  # every check of a local dump, on the copy
        yield local


def upload_files(
    local: str | os.PathLike[str], url: str, names: Any, *, last: str | None = None, in_flight: int = IN_FLIGHT
) -> None:
    """Upload the files ``names`` of the local directory ``local`` to ``url`` (several at once), then ``last``
    alone: what makes the upload mean something (a manifest, a rank's part) is only there once the rest is."""
    url = url.rstrip("/")
    fs, root = url_fs(url)
    src = Path(local)

    def put(name: str) -> None:
        try:
            with open(src / name, "rb") as f, fs.open(f"{root}/{name}", "wb") as dst:
                shutil.copyfileobj(f, dst, CHUNK_BYTES)
        except OSError as e:
            raise remote_error(f"{url}/{name}", e) from None

    with ThreadPoolExecutor(max_workers=max(1, in_flight)) as pool:
        for f in [pool.submit(put, name) for name in sorted(names)]:
            f.result()
    if last is not None:
        put(last)


def upload_dump(local: str | os.PathLike[str], url: str, *, in_flight: int = IN_FLIGHT) -> None:
    """Upload the complete local dump ``local`` to ``url``: its data files (several at once), then its manifest."""
    upload_files(local, url, load_manifest(local).files, last=MANIFEST_NAME, in_flight=in_flight)


def read_small(url: str, limit: int = 1 << 20) -> bytes | None:
    """The bytes of the object ``url`` (None when there is none); over ``limit`` bytes is refused."""
    fs, root = url_fs(url)
    fs.invalidate_cache(root)  # polled: a listing cached before must not hide an object written since
    try:
        with fs.open(root, "rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise remote_error(url, e) from None
    if len(raw) > limit:
        raise CorruptDumpError(f"{url}: over {limit} bytes; refusing it")
    return raw


def write_small(url: str, data: bytes) -> None:
    """Write the object ``url`` in one request (an object store's PUT is atomic: readers see all of it or none)."""
    fs, root = url_fs(url)
    try:
        fs.pipe_file(root, data)
    except OSError as e:
        raise remote_error(url, e) from None


def listed(url: str, pattern: str) -> list[str]:
    """Names directly under the prefix ``url`` that match the glob ``pattern`` (sorted; none when it is empty)."""
    fs, root = url_fs(url)
    fs.invalidate_cache(root)
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.glob(f"{root}/{pattern}"))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise remote_error(url, e) from None


def remove_prefix(url: str) -> None:
    """Delete everything under the prefix ``url`` (a spool's leftovers); errors are ignored, as for a local rmtree."""
    fs, root = url_fs(url)
    with contextlib.suppress(OSError, FileNotFoundError):
        fs.rm(root, recursive=True)
    fs.invalidate_cache()


def check_free(url: str) -> None:
    """Refuse ``url`` when it already holds a complete dump (nothing stored is ever overwritten)."""
    fs, root = url_fs(url)
    try:
        taken = fs.exists(f"{root}/{MANIFEST_NAME}")
    except OSError as e:
        raise remote_error(url, e) from None
    if taken:
        raise DumpError(f"{url}: already holds a complete dump; choose another URL")


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[str]:
    """Where to write a dump meant for ``path``: ``path`` itself when local; for a URL, a local staging directory
    whose dump is uploaded to the URL (manifest last) when the block ends without an error, then removed."""
    if not is_url(path):
        yield os.fspath(path)
        return
    url = os.fspath(path).rstrip("/")
    check_free(url)
    with tempfile.TemporaryDirectory(prefix="driftscope-staging-") as tmp:
        local = Path(tmp) / "dump"
        yield str(local)
        upload_dump(local, url)
