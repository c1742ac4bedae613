"""Generic checks on untrusted files: bounded JSON parsing, plain names, containment, no blocking opens.

Dumps, run stores, noise files and engine responses all come from outside (another machine,
another version, a hand edit, an attacker). These helpers read them so that a broken or hostile
file fails as one :class:`~dumper.errors.CorruptDumpError` line naming the file; never as a
crash, a hang, a huge allocation or a read outside the folder it belongs to. The rules:

* **Bounded parsing.** A JSON text is only parsed when :func:`json_memory_bound` says building
  its objects stays under :func:`json_memory_budget` (:data:`JSON_MEMORY_BUDGET`), so peak memory
  on any input stays under 512 MiB. Deep nesting, bad UTF-8 and over-long integers are corrupt
  files like any other JSON error. A file is refused above a size limit before it is read.
* **Containment.** A file named by untrusted metadata is one plain name (no separator, not ``.``
  or ``..``, so no absolute path), a symlink only if its real path stays inside its folder, and a
  regular file: checked with ``lstat``/``stat``, never by opening it (a FIFO would hang the
  reader); files are opened with :data:`READ_FLAGS` (non-blocking) all the same.
* **Text.** A string read from JSON is :func:`is_text` before it is printed or written back
  (a JSON escape can give a lone surrogate, which no report could print), and goes through
  :func:`printable` on its way to a terminal (an escape sequence would drive it).

Example::

    from dumper.format.files import parse_json, read_regular_file
    from dumper.format.validate import MAX_MANIFEST_BYTES  # each kind of file has its one limit
    obj = parse_json(read_regular_file(path, MAX_MANIFEST_BYTES, "manifest"), str(path), "manifest")
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from dumper.errors import CorruptDumpError
from dumper.settings import env_settings

__all__ = [
    "JSON_MEMORY_BUDGET",
    "json_memory_bound",
    "json_memory_budget",
    "check_json_memory",
    "parse_json",
    "is_text",
    "printable",
    "show",
    "bad_field",
    "READ_FLAGS",
    "is_plain_name",
    "check_plain_name",
    "file_kind",
    "regular_file_in",
    "read_regular_file",
]

JSON_MEMORY_BUDGET = 432 << 20
"""Most memory :func:`json_memory_bound` may predict for one JSON text before it is parsed.

The costliest text under it (distinct keys with short string values, building objects for
~375 MiB) peaks under 470 MiB RSS in a comparator process; a manifest the dumper writes
reaches it at about 105k tensor records (about 4.3 KB of bound each, 2.6 KB really used)."""


# -- bounded JSON ------------------------------------------------------------------------------
def json_memory_bound(data: bytes) -> int:
    """An upper bound on the memory CPython takes to hold ``data``, decode it and build its JSON objects.

    Linear in the text's length and in the counts of the characters that open containers,
    separate values or delimit strings (an overcount when they sit inside strings, which only
    makes the bound safer). The coefficients are the least that bound, with 15% to spare, the
    peak that CPython 3.11 measured for the densest shapes of every kind (empty and nested
    containers, one-key dicts, distinct keys, numbers, short, long, escaped and non-ASCII
    strings); ``tests/dumper/format/test_format_boundary.py`` checks them on such shapes. A manifest the
    dumper writes costs about half its bound.
    """
    n = len(data)
    text = (7 * n) // 2 if data.isascii() else (21 * n) // 2
    return (
        text
        + 192 * data.count(b"{")
        + 60 * data.count(b"[")
        + 52 * data.count(b",")
        + 8 * data.count(b":")
        + 27 * data.count(b'"')
    )


def json_memory_budget() -> int:
    """:data:`JSON_MEMORY_BUDGET`, or ``DRIFTSCOPE_JSON_MEMORY_MIB`` where a user raised it for a huge dump."""
    mib = env_settings().json_memory_mib
    return JSON_MEMORY_BUDGET if mib is None else mib << 20


def check_json_memory(data: bytes, where: str, what: str) -> None:
    """Raise unless building the JSON objects of ``data`` fits :func:`json_memory_budget`."""
    need, budget = json_memory_bound(data), json_memory_budget()
    if need > budget:
        raise CorruptDumpError(
            f"{where}: {what} of {len(data)} bytes holds too many JSON values to parse safely "
            f"(~{need >> 20} MiB to build, limit {budget >> 20} MiB; real input this large "
            "can raise it with DRIFTSCOPE_JSON_MEMORY_MIB)"
        )


def parse_json(data: bytes, where: str, what: str) -> Any:
    """Parse UTF-8 JSON ``data`` once :func:`json_memory_bound` is under the budget; errors name ``where``."""
    check_json_memory(data, where, what)
    try:
        text = data.decode("utf-8")
        del data  # the caller passes its only reference: parse with the text alone in memory
        return json.loads(text)
    except RecursionError:
        raise CorruptDumpError(f"{where}: unreadable {what} (JSON nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, an integer of too many digits
        raise CorruptDumpError(f"{where}: unreadable {what} ({' '.join(str(e).split())[:200]})") from None


# -- text --------------------------------------------------------------------------------------
def is_text(v: Any) -> bool:
    """A str that can be printed and written as UTF-8: JSON escapes can give lone surrogates ("\\ud800")."""
    if type(v) is not str:
        return False
    if v.isascii():
        return True
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """``text`` fit for one line of output: control characters and undecodable characters escaped."""
    return text if text.isprintable() else text.encode("unicode_escape", "backslashreplace").decode("ascii")


def show(v: Any) -> str:
    """``v`` for an error message: its JSON (its repr if it has none), cut to 60 characters."""
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# -- paths -------------------------------------------------------------------------------------
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
"""How untrusted files are opened: non-blocking, so a FIFO that slipped past a stat cannot hang the reader."""


def bad_field(where: str, field: str, expected: str, got: Any) -> CorruptDumpError:
    """The one-line error of a dump field that is not what the format says: ``where: field: expected ..., got ...``."""
    return CorruptDumpError(f"{where}: {field}: expected {expected}, got {show(got)}")


def is_plain_name(name: Any) -> bool:
    """One plain file name: text, no separator, not ``.``/``..``, no NUL (so never absolute or outside its folder)."""
    return is_text(name) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def check_plain_name(name: Any, where: str, field: str) -> str:
    """``name`` if :func:`is_plain_name`, else raise :class:`CorruptDumpError`."""
    if not is_plain_name(name):
        raise CorruptDumpError(
            f"{where}: {field}: expected a plain file name inside the dump directory, got {show(name)}"
        )
    return name


def file_kind(mode: int) -> str:
    """What an ``os.stat`` mode is, for messages: ``"a FIFO"``, ``"a directory"``, ``"a symlink"``, ..."""
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a symlink"
        if stat.S_ISLNK(mode)
        else "a regular file"
        if stat.S_ISREG(mode)
        else "a special file"
    )


def regular_file_in(root: Path, name: str, *, missing: str) -> os.stat_result:
    """The stat of the regular file ``root / name``, refusing one whose real path leaves ``root``.

    Never opens the file. ``name`` must be a plain name (see :func:`check_plain_name`), so the
    only way out of ``root`` is a symlink, resolved with :func:`os.path.realpath` and compared
    with the real path of ``root``. ``missing`` is the message when nothing is there. Paths reach
    the messages through :func:`printable`: a file name is text from outside.
    """
    path = root / check_plain_name(name, printable(str(root)), "file name")
    shown = printable(str(path))
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            real, real_root = os.path.realpath(path), os.path.realpath(root)
            if os.path.commonpath([real, real_root]) != real_root:
                raise CorruptDumpError(
                    f"{shown}: symlink to {printable(real)}, outside the dump directory; refusing to read it"
                )
            st = os.stat(real)
    except FileNotFoundError:
        raise CorruptDumpError(f"{shown}: {missing}") from None
    except OSError as e:
        raise CorruptDumpError(f"{shown}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptDumpError(f"{shown}: {file_kind(st.st_mode)}, not a regular file; refusing to open it")
    return st


def read_regular_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refusing one of more than ``limit`` bytes before reading."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        raise CorruptDumpError(f"{path}: cannot open {what} ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which raises on a directory
        os.close(fd)
        raise CorruptDumpError(f"{path}: {file_kind(st.st_mode)}, not a regular file; refusing to read it")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise CorruptDumpError(f"{path}: {what} of {st.st_size} bytes exceeds the {limit >> 20} MiB limit")
        data = f.read(st.st_size)  # read(n) allocates n bytes up front: ask only for what is there
        if f.read(1):
            raise CorruptDumpError(f"{path}: {what} grew while it was read")
    return data
