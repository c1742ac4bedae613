"""Checks on untrusted dump input: manifests, safetensors headers and the files they name.

A dump is input from outside (another machine, another version, a hand edit, an attacker), so
:mod:`dumper.format` runs every byte of metadata through these checks before it trusts it. A
broken dump fails as one :class:`~dumper.errors.CorruptDumpError` line naming the file and the
field (exit 2); never as a crash, a hang, a huge allocation, a read outside the dump, or a
comparison of the wrong bytes (which would read as a regression). The rules:

* **Bounded parsing.** ``manifest.json`` is at most :data:`MAX_MANIFEST_BYTES`, a safetensors
  header at most :data:`MAX_HEADER_BYTES` (the reference reader's cap), and a JSON text is only
  parsed when :func:`json_memory_bound` says building its objects stays under
  :data:`JSON_MEMORY_BUDGET`; so peak memory on any input stays under 512 MiB. Deep nesting,
  bad UTF-8 and over-long integers are corrupt files like any other JSON error.
* **Exact schema.** Required keys, exact types (``True`` is not an integer, ``"3"`` and ``3.5``
  are not layers), ranges, run-length row metadata that covers exactly the tensor's rows, no two
  records with the same (name, forward pass, rank, call) or the same (file, key). The keys the
  format defines (the top level and each tensor record) admit no unknown keys, since a reader
  that skipped one could misread the dump: free-form data belongs in ``extra`` or a record's
  ``meta``. The descriptive objects (``model``, ``capture_signature``, ``environment``) keep
  keys this version does not know, and the fields it reads are type-checked. Every string and
  key anywhere in them, in ``extra`` and in a record's ``meta`` must be valid Unicode (a JSON
  escape can give a lone surrogate, which no report could print).
* **Sizes before allocation.** A record's bytes (``prod(shape) * itemsize``, and at least one byte
  per row, so a zero-width tensor cannot declare 2^31 rows) must fit in its data file together
  with the other records of that file, checked against the declared file size before anything
  decodes a run length; the declared size must equal the file's.
* **Containment.** Every file a manifest names is one plain name (no separator, not ``.`` or
  ``..``, so no absolute path), a symlink only if its real path stays inside the dump
  directory, and a regular file: checked with ``lstat``/``stat``, never by opening it (a FIFO
  would hang the reader).
* **safetensors headers** are validated whole when a file is opened: a JSON object of
  ``{dtype, shape, data_offsets}`` entries (plus an optional ``__metadata__`` object of
  strings), byte ranges consistent with dtype x shape, and ranges that tile the data section
  exactly, in order, as the reference reader requires: no overlap, and no stray bytes (which
  also catches a key given twice with other offsets, since JSON keeps only the last).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dumper.errors import CorruptDumpError
from dumper.settings import env_settings

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_HEADER_BYTES",
    "JSON_MEMORY_BUDGET",
    "MAX_NDIM",
    "MANIFEST_KEYS",
    "RECORD_KEYS",
    "json_memory_bound",
    "json_memory_budget",
    "check_json_memory",
    "parse_json",
    "read_regular_file",
    "check_plain_name",
    "is_plain_name",
    "file_kind",
    "READ_FLAGS",
    "regular_file_in",
    "check_manifest",
    "check_header",
    "check_extra",
    "first_bad_text",
    "HeaderEntry",
]

MAX_MANIFEST_BYTES = 128 << 20
"""Largest ``manifest.json`` read at all; :data:`JSON_MEMORY_BUDGET` then decides (ASCII JSON under
it is at most ~119 MiB; the dumper writes about 400 bytes a tensor record)."""
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header read, the cap of the reference safetensors reader."""
JSON_MEMORY_BUDGET = 432 << 20
"""Most memory :func:`json_memory_bound` may predict for one JSON text before it is parsed.

The costliest text under it (distinct keys with short string values, building objects for
~375 MiB) peaks under 470 MiB RSS in a comparator process; a manifest the dumper writes
reaches it at about 105k tensor records (about 4.3 KB of bound each, 2.6 KB really used)."""
MAX_NDIM = 32
"""Most dimensions a tensor may have (numpy's limit is 64; dumps hold 1 to 4)."""

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
MANIFEST_KEYS = ("format_version", "created_at", "model", "capture_signature", "environment", "files", "tensors",
                 "extra")
"""Top-level keys of a manifest; all but ``extra`` are required."""
RECORD_KEYS = ("name", "file", "key", "shape", "dtype", "forward_pass", "rank", "call", "layer", "point",
               "positions", "sequence_ids", "shard_dim", "meta")
"""Keys of a tensor record; the first six are required, the others default."""
_TOP_REQUIRED = frozenset(MANIFEST_KEYS[:-1])
_TOP_ALLOWED = frozenset(MANIFEST_KEYS)
_REC_REQUIRED = frozenset(RECORD_KEYS[:6])
_REC_ALLOWED = frozenset(RECORD_KEYS)
_SCALARS = (str, int, float, bool, type(None))
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
HeaderEntry = tuple[str, tuple[int, ...], int, int]
"""A validated safetensors header entry: (dtype, shape, begin, end) in the data section."""


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
    return (text + 192 * data.count(b"{") + 60 * data.count(b"[") + 52 * data.count(b",")
            + 8 * data.count(b":") + 27 * data.count(b'"'))


def json_memory_budget() -> int:
    """:data:`JSON_MEMORY_BUDGET`, or ``DRIFTSCOPE_JSON_MEMORY_MIB`` where a user raised it for a huge dump."""
    mib = env_settings().json_memory_mib
    return JSON_MEMORY_BUDGET if mib is None else mib << 20


def check_json_memory(data: bytes, where: str, what: str) -> None:
    """Raise unless building the JSON objects of ``data`` fits :func:`json_memory_budget`."""
    need, budget = json_memory_bound(data), json_memory_budget()
    if need > budget:
        raise CorruptDumpError(f"{where}: {what} of {len(data)} bytes holds too many JSON values to parse safely "
                               f"(~{need >> 20} MiB to build, limit {budget >> 20} MiB; real input this large "
                               "can raise it with DRIFTSCOPE_JSON_MEMORY_MIB)")


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


def _is_text(v: Any) -> bool:
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


def first_bad_text(value: Any, field: str) -> str | None:
    """The path (``field.key[3]``) of the first key or string inside ``value`` that is not :func:`_is_text`.

    Walks parsed JSON (dicts, lists, scalars) with an explicit stack, so nesting that
    :func:`json.loads` accepted cannot overflow it; only strings cost a check, so a long list
    of token ids stays cheap. ``None`` when every string can be printed and written as UTF-8.
    """
    stack: list[tuple[Any, str]] = [(value, field)]
    while stack:
        v, path = stack.pop()
        if type(v) is dict:
            for k, x in v.items():
                if not _is_text(k):
                    return f"{path} key {_show(k)}"
                if type(x) is str:
                    if not x.isascii() and not _is_text(x):
                        return f"{path}.{k}"
                elif type(x) is dict or type(x) is list:
                    stack.append((x, f"{path}.{k}"))
        elif type(v) is list:
            for j, x in enumerate(v):
                if type(x) is str:
                    if not x.isascii() and not _is_text(x):
                        return f"{path}[{j}]"
                elif type(x) is dict or type(x) is list:
                    stack.append((x, f"{path}[{j}]"))
        elif type(v) is str and not _is_text(v):
            return path
    return None


def _check_text(value: Any, where: str, field: str) -> None:
    """Raise naming the first string or key inside ``value`` that cannot be printed (see :func:`first_bad_text`)."""
    bad = first_bad_text(value, field)
    if bad is not None:
        raise CorruptDumpError(f"{where}: {bad}: expected text, got a string that is not valid Unicode "
                               "(a lone surrogate escape such as \\ud800)")


# -- paths -------------------------------------------------------------------------------------
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
"""How untrusted files are opened: non-blocking, so a FIFO that slipped past a stat cannot hang the reader."""


def is_plain_name(name: Any) -> bool:
    """One plain file name: text, no separator, not ``.``/``..``, no NUL (so never absolute or outside its folder)."""
    return _is_text(name) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def check_plain_name(name: Any, where: str, field: str) -> str:
    """``name`` if :func:`is_plain_name`, else raise :class:`CorruptDumpError`."""
    if not is_plain_name(name):
        raise CorruptDumpError(f"{where}: {field}: expected a plain file name inside the dump directory, "
                               f"got {_show(name)}")
    return name


def file_kind(mode: int) -> str:
    """What an ``os.stat`` mode is, for messages: ``"a FIFO"``, ``"a directory"``, ``"a symlink"``, ..."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a symlink" if stat.S_ISLNK(mode) else "a regular file" if stat.S_ISREG(mode)
            else "a special file")


def regular_file_in(root: Path, name: str, *, missing: str) -> os.stat_result:
    """The stat of the regular file ``root / name``, refusing one whose real path leaves ``root``.

    Never opens the file. ``name`` must be a plain name (see :func:`check_plain_name`), so the
    only way out of ``root`` is a symlink, resolved with :func:`os.path.realpath` and compared
    with the real path of ``root``. ``missing`` is the message when nothing is there.
    """
    path = root / check_plain_name(name, str(root), "file name")
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            real, real_root = os.path.realpath(path), os.path.realpath(root)
            if os.path.commonpath([real, real_root]) != real_root:
                raise CorruptDumpError(f"{path}: symlink to {real}, outside the dump directory; refusing to read it")
            st = os.stat(real)
    except FileNotFoundError:
        raise CorruptDumpError(f"{path}: {missing}") from None
    except OSError as e:
        raise CorruptDumpError(f"{path}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptDumpError(f"{path}: {file_kind(st.st_mode)}, not a regular file; refusing to open it")
    return st


def read_regular_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refusing one of more than ``limit`` bytes before reading."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        raise CorruptDumpError(f"{path}: cannot open {what} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CorruptDumpError(f"{path}: {file_kind(st.st_mode)}, not a regular file; refusing to read it")
        if st.st_size > limit:
            raise CorruptDumpError(f"{path}: {what} of {st.st_size} bytes exceeds the {limit >> 20} MiB limit")
        data = f.read(st.st_size)  # read(n) allocates n bytes up front: ask only for what is there
        if f.read(1):
            raise CorruptDumpError(f"{path}: {what} grew while it was read")
    return data


# -- manifest ----------------------------------------------------------------------------------
def _show(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _bad(where: str, field: str, expected: str, got: Any) -> CorruptDumpError:
    return CorruptDumpError(f"{where}: {field}: expected {expected}, got {_show(got)}")


def _keys(where: str, field: str, d: dict, required: frozenset[str], allowed: frozenset[str]) -> None:
    keys = d.keys()
    if required <= keys and keys <= allowed:
        return
    missing, unknown = sorted(required - keys), sorted(keys - allowed)
    parts = ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])
    raise CorruptDumpError(f"{where}: malformed manifest: {field}: {'; '.join(parts)}")


def _int(v: Any, where: str, field: str, *, null: bool = False) -> None:
    if type(v) is int and 0 <= v <= _I64_MAX or null and v is None:
        return
    raise _bad(where, field, "an integer >= 0" + (" or null" if null else ""), v)


def _str(v: Any, where: str, field: str, *, null: bool = False) -> None:
    if _is_text(v) or null and v is None:
        return
    raise _bad(where, field, "a string" + (" or null" if null else ""), v)


def _object(v: Any, where: str, field: str) -> dict:
    if type(v) is not dict:
        raise _bad(where, field, "an object", v)
    return v


def _fields(d: dict, where: str, field: str, ints: tuple[str, ...] = (), strs: tuple[str, ...] = (),
            int_lists: tuple[str, ...] = (), str_lists: tuple[str, ...] = ()) -> None:
    """Type-check the named optional fields of a descriptive object (ints >= 0, strings, lists; null allowed)."""
    for k in ints:
        _int(d.get(k), where, f"{field}.{k}", null=True)
    for k in strs:
        _str(d.get(k), where, f"{field}.{k}", null=True)
    for k in int_lists + str_lists:
        v = d.get(k)
        if v is None:
            continue
        if type(v) is not list:
            raise _bad(where, f"{field}.{k}", "a list or null", v)
        for j, x in enumerate(v):
            if k in int_lists and type(x) is not int or k in str_lists and not _is_text(x):
                raise _bad(where, f"{field}.{k}[{j}]", "an integer" if k in int_lists else "a string", x)


def check_extra(extra: Any, where: str) -> None:
    """Validate a manifest's ``extra``: an object of valid-Unicode text whose ``input_ids``, if any, are token id lists.

    The dumper runs it on what it is given, so that it never writes an ``extra`` the reader refuses.
    """
    _check_text(_object(extra, where, "extra"), where, "extra")
    ids = extra.get("input_ids")
    if ids is not None:
        if type(ids) is not list:
            raise _bad(where, "extra.input_ids", "a list of token id lists", ids)
        for s, seq in enumerate(ids):
            if type(seq) is not list or not all(type(t) is int and t >= 0 for t in seq):
                raise _bad(where, f"extra.input_ids[{s}]", "a list of integers >= 0", seq)


def _check_top(raw: dict, where: str) -> None:
    _keys(where, "top level", raw, _TOP_REQUIRED, _TOP_ALLOWED)
    _str(raw["created_at"], where, "created_at")
    model = _object(raw["model"], where, "model")
    _fields(model, where, "model", ints=("num_layers", "hidden_size"),
            strs=("name", "architecture", "config_hash", "weights_hash", "weights_format"))
    sig = _object(raw["capture_signature"], where, "capture_signature")
    _fields(sig, where, "capture_signature", ints=("num_layers", "world_size"), strs=("dtype",),
            int_lists=("layers",), str_lists=("modules", "points"))
    for k, v in _object(raw["environment"], where, "environment").items():
        if not isinstance(v, _SCALARS) or type(v) is str and not _is_text(v):
            raise _bad(where, f"environment.{k}", "a string, number, boolean or null", v)
    for field in ("model", "capture_signature", "environment"):
        _check_text(raw[field], where, field)
    check_extra(raw.get("extra", {}), where)
    files = _object(raw["files"], where, "files")
    for name, size in files.items():
        check_plain_name(name, where, f"files[{_show(name)}]")
        _int(size, where, f"files[{_show(name)}]")


def _runs_total(runs: Any) -> int:
    """Rows covered by ``[start, count]`` runs (values within int64, counts >= 0); -1 if malformed."""
    total = 0
    for run in runs:
        if type(run) is not list or len(run) != 2:
            return -1
        start, count = run
        if type(start) is not int or type(count) is not int or count < 0 or start < _I64_MIN \
                or start > _I64_MAX - count:
            return -1
        total += count
    return total


def _runs_error(where: str, field: str, runs: Any, rows: int) -> CorruptDumpError:
    """The error for row metadata ``runs`` that :func:`_runs_total` did not accept for ``rows`` rows."""
    if type(runs) is not list:
        return _bad(where, field, "null or a list of [start, count] runs", runs)
    for j, run in enumerate(runs):
        if _runs_total([run]) < 0:
            return _bad(where, f"{field}[{j}]", "a [start, count] pair of integers with count >= 0 (int64)", run)
    return CorruptDumpError(f"{where}: {field}: runs cover {_runs_total(runs)} rows but the tensor has {rows}")


def _check_record(d: Any, i: int, where: str, files: Mapping[str, int], itemsize: Mapping[str, int]) -> int:
    """Validate record ``tensors[i]``; return the bytes it needs in its file (one at least per row).

    One chain of inline tests, as it runs for every record of a 100k-record manifest; the
    field name is formatted only on failure.
    """
    if type(d) is not dict:
        raise _bad(where, f"tensors[{i}]", "a tensor record object", d)
    if not _REC_REQUIRED <= d.keys() <= _REC_ALLOWED:
        _keys(where, f"tensors[{i}]", d, _REC_REQUIRED, _REC_ALLOWED)
    get = d.get
    name, key, file, dtype, shape, fp = d["name"], d["key"], d["file"], d["dtype"], d["shape"], d["forward_pass"]
    rank, call, layer, point, sd, meta = get("rank", 0), get("call", 0), get("layer"), get("point"), \
        get("shard_dim"), get("meta", {})
    # names are printed in terminals: no control characters (an ESC sequence would drive the terminal)
    if type(name) is not str or not name or not name.isprintable() or not name.isascii() and not _is_text(name):
        raise _bad(where, f"tensors[{i}].name", "a non-empty string of printable characters", name)
    if type(key) is not str or not key or not key.isprintable() or not key.isascii() and not _is_text(key):
        raise _bad(where, f"tensors[{i}].key", "a non-empty string of printable characters", key)
    if type(file) is not str or file not in files:
        raise _bad(where, f"tensors[{i}].file", "a file listed in files", file)
    if type(dtype) is not str or dtype not in itemsize:
        raise _bad(where, f"tensors[{i}].dtype", f"one of {sorted(itemsize)}", dtype)
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise _bad(where, f"tensors[{i}].shape", f"a list of at most {MAX_NDIM} integers >= 0", shape)
    for n in shape:
        if type(n) is not int or n < 0 or n > _I64_MAX:
            raise _bad(where, f"tensors[{i}].shape", "a list of integers >= 0", shape)
    if type(fp) is not int or fp < 0 or fp > _I64_MAX:
        raise _bad(where, f"tensors[{i}].forward_pass", "an integer >= 0", fp)
    if type(rank) is not int or rank < 0 or rank > _I64_MAX:
        raise _bad(where, f"tensors[{i}].rank", "an integer >= 0", rank)
    if type(call) is not int or call < 0 or call > _I64_MAX:
        raise _bad(where, f"tensors[{i}].call", "an integer >= 0", call)
    if layer is not None and (type(layer) is not int or layer < _I64_MIN or layer > _I64_MAX):
        raise _bad(where, f"tensors[{i}].layer", "an integer or null", layer)
    if point is not None and not _is_text(point):
        raise _bad(where, f"tensors[{i}].point", "a string or null", point)
    if sd is not None and (type(sd) is not int or not 0 <= sd < len(shape)):
        raise _bad(where, f"tensors[{i}].shard_dim", f"null or a dim index below {len(shape)}", sd)
    if type(meta) is not dict or meta and not all(isinstance(v, _SCALARS) for v in meta.values()):
        raise _bad(where, f"tensors[{i}].meta", "an object of strings, numbers, booleans or nulls", meta)
    if meta:
        _check_text(meta, where, f"tensors[{i}].meta")
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    for k in ("positions", "sequence_ids"):
        runs = get(k)
        if runs is not None and (type(runs) is not list or _runs_total(runs) != rows):
            raise _runs_error(where, f"tensors[{i}].{k}", runs, rows)
    return max(math.prod(shape) * itemsize[dtype], rows)


def check_manifest(raw: dict, where: str, itemsize: Mapping[str, int]) -> None:
    """Validate a parsed manifest (its ``format_version`` already checked) without touching the disk.

    ``itemsize`` maps the storable dtypes to their sizes in bytes. Raises
    :class:`CorruptDumpError` naming ``where`` and the field.
    """
    _check_top(raw, where)
    files, tensors = raw["files"], raw["tensors"]
    if type(tensors) is not list:
        raise _bad(where, "tensors", "a list of tensor records", tensors)
    used: dict[str, int] = {}
    idents: set[tuple[Any, ...]] = set()
    locations: set[tuple[str, str]] = set()
    for i, d in enumerate(tensors):
        need = _check_record(d, i, where, files, itemsize)
        file = d["file"]
        if need > files[file]:
            raise CorruptDumpError(f"{where}: tensors[{i}].shape: {d['dtype']}{d['shape']} needs {need} bytes but "
                                   f"its file {file} holds {files[file]}")
        used[file] = used.get(file, 0) + need
        n = len(idents)
        idents.add((d["name"], d["forward_pass"], d.get("rank", 0), d.get("call", 0)))
        locations.add((file, d["key"]))
        if len(idents) == n or len(locations) == n:
            _duplicate(tensors, i, where)
    for name, need in used.items():
        if need > files[name]:
            raise CorruptDumpError(f"{where}: files[{_show(name)}]: its tensors need {need} bytes together but "
                                   f"the file holds {files[name]}")


def _duplicate(tensors: list[dict], i: int, where: str) -> None:
    """Raise naming the record before ``tensors[i]`` that shares its identity or its (file, key)."""
    d = tensors[i]

    def ident(r: dict) -> tuple[Any, ...]:
        return r["name"], r["forward_pass"], r.get("rank", 0), r.get("call", 0)

    for j, r in enumerate(tensors[:i]):
        if ident(r) == ident(d):
            raise CorruptDumpError(f"{where}: tensors[{i}]: same (name, forward_pass, rank, call) "
                                   f"{list(ident(d))} as tensors[{j}]")
        if (r["file"], r["key"]) == (d["file"], d["key"]):
            raise CorruptDumpError(f"{where}: tensors[{i}]: same (file, key) {[d['file'], d['key']]} "
                                   f"as tensors[{j}]")


# -- safetensors headers -----------------------------------------------------------------------
def check_header(header: Any, where: str, data_size: int, itemsize: Mapping[str, int]) -> dict[str, HeaderEntry]:
    """Validate a parsed safetensors header against a data section of ``data_size`` bytes.

    Returns ``key -> (dtype, shape, begin, end)``. The byte ranges must match dtype x shape
    and tile ``[0, data_size)`` exactly when sorted (as the reference reader requires).
    """
    if type(header) is not dict:
        raise CorruptDumpError(f"{where}: safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    if "__metadata__" in header and (type(meta) is not dict or not all(type(v) is str for v in meta.values())):
        raise _bad(where, "header __metadata__", "an object of strings", meta)
    out: dict[str, HeaderEntry] = {}
    for key, info in header.items():
        if key != "__metadata__":
            out[key] = _header_entry(key, info, where, data_size, itemsize)
    _check_tiling(out, where, data_size)
    return out


def _header_entry(key: str, info: Any, where: str, data_size: int, itemsize: Mapping[str, int]) -> HeaderEntry:
    """One validated header entry (the field name is formatted only on failure: a file may hold 100k)."""
    if type(info) is not dict or info.keys() != _ENTRY_KEYS:
        raise _bad(where, f"header[{_show(key)}]", "an object of dtype, shape and data_offsets", info)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if type(dtype) is not str or dtype not in itemsize:
        raise _bad(where, f"header[{_show(key)}].dtype", f"one of {sorted(itemsize)}", dtype)
    if type(shape) is not list or len(shape) > MAX_NDIM or \
            not all(type(s) is int and 0 <= s <= _I64_MAX for s in shape):
        raise _bad(where, f"header[{_show(key)}].shape", "a list of integers >= 0", shape)
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1] <= data_size:
        raise _bad(where, f"header[{_show(key)}].data_offsets",
                   f"[begin, end] with 0 <= begin <= end <= {data_size}", offsets)
    begin, end = offsets
    need = math.prod(shape) * itemsize[dtype]
    if end - begin != need:
        raise CorruptDumpError(f"{where}: header[{_show(key)}]: data_offsets span {end - begin} bytes but "
                               f"{dtype}{shape} needs {need}")
    return dtype, tuple(shape), begin, end


def _check_tiling(entries: Mapping[str, HeaderEntry], where: str, data_size: int) -> None:
    """Sorted byte ranges must follow each other without overlap or gap and end at ``data_size``."""
    cursor, prev = 0, None
    for key, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin < cursor:
            raise CorruptDumpError(f"{where}: tensors {prev!r} and {key!r} overlap (bytes {begin}..{cursor} "
                                   "of the data section)")
        if begin > cursor:
            raise CorruptDumpError(f"{where}: bytes {cursor}..{begin} of the data section belong to no tensor")
        cursor, prev = end, key
    if cursor != data_size:
        raise CorruptDumpError(f"{where}: bytes {cursor}..{data_size} of the data section belong to no tensor")
