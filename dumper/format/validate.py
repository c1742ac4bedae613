"""Checks on untrusted dump metadata: manifests and safetensors headers.

A dump is input from outside (another machine, another version, a hand edit, an attacker), so
:mod:`dumper.format` runs every byte of metadata through these checks before it trusts it. A broken dump fails
as one :class:`~dumper.errors.CorruptDumpError` line naming the file and the field (exit 2); never as a crash,
a hang, a huge allocation, a read outside the dump, or a comparison of the wrong bytes (which would read as a
regression). The files themselves are read with the generic checks of :mod:`dumper.format.files` (bounded JSON
parsing, plain names, containment). The rules here:

* **Bounded sizes.** ``manifest.json`` is at most :data:`MAX_MANIFEST_BYTES`, a safetensors header at most
  :data:`MAX_HEADER_BYTES` (the reference reader's cap), a tensor at most :data:`MAX_NDIM` dimensions.
* **Exact schema.** Required keys, exact types (``True`` is not an integer, ``"3"`` and ``3.5`` are not
  layers), ranges, run-length row metadata that covers exactly the tensor's rows, no two records with the same
  (name, forward pass, rank, call) or the same (file, key). The keys the format defines (the top level and
  each tensor record) admit no unknown keys, since a reader that skipped one could misread the dump: free-form
  data belongs in ``extra`` or a record's ``meta``. The descriptive objects (``model``, ``capture_signature``,
  ``environment``) keep keys this version does not know, and the fields it reads are type-checked. Every
  string and key anywhere in them, in ``extra`` and in a record's ``meta`` must be valid Unicode (a JSON
  escape can give a lone surrogate, which no report could print).
* **Sizes before allocation.** A record's bytes (``prod(shape) * itemsize``, and at least one byte per row, so
  a zero-width tensor cannot declare 2^31 rows) must fit in its data file together with the other records of
  that file, checked against the declared file size before anything decodes a run length; the declared size
  must equal the file's.
* **Containment.** Every file a manifest lists is a plain name (:func:`~dumper.format.files.is_plain_name`);
  the loader then stats it with :func:`~dumper.format.files.regular_file_in`, never opening it first.
* **safetensors headers** are validated whole when a file is opened: a JSON object of ``{dtype, shape,
  data_offsets}`` entries (plus an optional ``__metadata__`` object of strings), byte ranges consistent with
  dtype x shape, and ranges that tile the data section exactly, in order, as the reference reader requires: no
  overlap, and no stray bytes (which also catches a key given twice with other offsets, since JSON keeps only
  the last).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dumper.errors import CorruptDumpError
from dumper.format.decode import check_decode_extra, check_decode_meta
from dumper.format.files import bad_field, check_plain_name, is_text, show
from dumper.format.kv_cache import check_kv_extra, check_kv_records
from dumper.format.sketch import check_record_sketch, check_spec
from dumper.format.speculative import check_speculative_extra, check_speculative_records

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MANIFEST_KEYS",
    "RECORD_KEYS",
    "check_manifest",
    "check_header",
    "check_extra",
    "check_model",
    "first_bad_text",
    "HeaderEntry",
]

MAX_MANIFEST_BYTES = 128 << 20
"""Largest ``manifest.json`` read at all; :data:`~dumper.format.files.JSON_MEMORY_BUDGET` then decides (ASCII JSON under
it is at most ~119 MiB; the dumper writes about 400 bytes a tensor record)."""
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header read, the cap of the reference safetensors reader."""
MAX_NDIM = 32
"""Most dimensions a tensor may have (numpy's limit is 64; dumps hold 1 to 4)."""

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
MANIFEST_KEYS = (
    "format_version",
    "created_at",
    "model",
    "capture_signature",
    "environment",
    "files",
    "tensors",
    "extra",
)
"""Top-level keys of a manifest; all but ``extra`` are required."""
RECORD_KEYS = (
    "name",
    "file",
    "key",
    "shape",
    "dtype",
    "forward_pass",
    "rank",
    "call",
    "layer",
    "point",
    "positions",
    "sequence_ids",
    "shard_dim",
    "meta",
    "sketch",
)
"""Keys of a tensor record; the first six are required, the others default."""
_TOP_REQUIRED = frozenset(MANIFEST_KEYS[:-1])
_TOP_ALLOWED = frozenset(MANIFEST_KEYS)
_REC_REQUIRED = frozenset(RECORD_KEYS[:6])
_REC_ALLOWED = frozenset(RECORD_KEYS)
_SCALARS = (str, int, float, bool, type(None))

_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
HeaderEntry = tuple[str, tuple[int, ...], int, int]
"""A validated safetensors header entry: (dtype, shape, begin, end) in the data section."""


# -- text --------------------------------------------------------------------------------------
def first_bad_text(value: Any, field: str) -> str | None:
    """The path (``field.key[3]``) of the first key or string inside ``value`` that is not
    :func:`~dumper.format.files.is_text`.

    Walks parsed JSON (dicts, lists, scalars) with an explicit stack, so nesting that
    :func:`json.loads` accepted cannot overflow it; only strings cost a check, so a long list
    of token ids stays cheap. ``None`` when every string can be printed and written as UTF-8.
    """
    stack: list[tuple[Any, str]] = [(value, field)]
    while stack:
        v, path = stack.pop()
        if type(v) is dict:
            for k, x in v.items():
                if not is_text(k):
                    return f"{path} key {show(k)}"
                if type(x) is str:
                    if not x.isascii() and not is_text(x):
                        return f"{path}.{k}"
                elif type(x) is dict or type(x) is list:
                    stack.append((x, f"{path}.{k}"))
        elif type(v) is list:
            for j, x in enumerate(v):
                if type(x) is str:
                    if not x.isascii() and not is_text(x):
                        return f"{path}[{j}]"
                elif type(x) is dict or type(x) is list:
                    stack.append((x, f"{path}[{j}]"))
        elif type(v) is str and not is_text(v):
            return path
    return None


def _check_text(value: Any, where: str, field: str) -> None:
    """Raise naming the first string or key inside ``value`` that cannot be printed (see :func:`first_bad_text`)."""
    bad = first_bad_text(value, field)
    if bad is not None:
        raise CorruptDumpError(
            f"{where}: {bad}: expected text, got a string that is not valid Unicode "
            "(a lone surrogate escape such as \\ud800)"
        )


# -- manifest ----------------------------------------------------------------------------------
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
    raise bad_field(where, field, "an integer >= 0" + (" or null" if null else ""), v)


def _str(v: Any, where: str, field: str, *, null: bool = False) -> None:
    if is_text(v) or null and v is None:
        return
    raise bad_field(where, field, "a string" + (" or null" if null else ""), v)


def _object(v: Any, where: str, field: str) -> dict:
    if type(v) is not dict:
        raise bad_field(where, field, "an object", v)
    return v


def _fields(
    d: dict,
    where: str,
    field: str,
    ints: tuple[str, ...] = (),
    strs: tuple[str, ...] = (),
    int_lists: tuple[str, ...] = (),
    str_lists: tuple[str, ...] = (),
) -> None:
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
            raise bad_field(where, f"{field}.{k}", "a list or null", v)
        for j, x in enumerate(v):
            if k in int_lists and type(x) is not int or k in str_lists and not is_text(x):
                raise bad_field(where, f"{field}.{k}[{j}]", "an integer" if k in int_lists else "a string", x)


def check_extra(extra: Any, where: str) -> None:
    """Validate a manifest's ``extra``: an object of valid-Unicode text whose ``input_ids``, if any, are token id lists.

    The dumper runs it on what it is given, so that it never writes an ``extra`` the reader refuses.
    """
    _check_text(_object(extra, where, "extra"), where, "extra")
    ids = extra.get("input_ids")
    if ids is not None:
        if type(ids) is not list:
            raise bad_field(where, "extra.input_ids", "a list of token id lists", ids)
        for s, seq in enumerate(ids):
            if type(seq) is not list or not all(type(t) is int and t >= 0 for t in seq):
                raise bad_field(where, f"extra.input_ids[{s}]", "a list of integers >= 0", seq)
    check_decode_extra(extra, where)
    check_kv_extra(extra, where)
    check_speculative_extra(extra, where)


def check_model(model: Any, where: str, field: str = "model") -> dict:
    """Validate a model identity object (a manifest's ``model``, a noise file's): an object whose
    known fields have their types (null allowed) and whose every key and string is text; returned as is."""
    _fields(
        _object(model, where, field),
        where,
        field,
        ints=("num_layers", "hidden_size"),
        strs=("name", "architecture", "config_hash", "weights_hash", "weights_format"),
    )
    _check_text(model, where, field)
    return model


def _check_top(raw: dict, where: str) -> None:
    _keys(where, "top level", raw, _TOP_REQUIRED, _TOP_ALLOWED)
    _str(raw["created_at"], where, "created_at")
    check_model(raw["model"], where)
    sig = _object(raw["capture_signature"], where, "capture_signature")
    _fields(
        sig,
        where,
        "capture_signature",
        ints=("num_layers", "world_size"),
        strs=("dtype",),
        int_lists=("layers",),
        str_lists=("modules", "points"),
    )
    for k, v in _object(raw["environment"], where, "environment").items():
        if not isinstance(v, _SCALARS) or type(v) is str and not is_text(v):
            raise bad_field(where, f"environment.{k}", "a string, number, boolean or null", v)
    for field in ("capture_signature", "environment"):
        _check_text(raw[field], where, field)
    check_extra(raw.get("extra", {}), where)
    files = _object(raw["files"], where, "files")
    for name, size in files.items():
        check_plain_name(name, where, f"files[{show(name)}]")
        _int(size, where, f"files[{show(name)}]")


def _runs_total(runs: Any) -> int:
    """Rows covered by ``[start, count]`` runs (values within int64, counts >= 0); -1 if malformed."""
    total = 0
    for run in runs:
        if type(run) is not list or len(run) != 2:
            return -1
        start, count = run
        if (
            type(start) is not int
            or type(count) is not int
            or count < 0
            or start < _I64_MIN
            or start > _I64_MAX - count
        ):
            return -1
        total += count
    return total


def _runs_error(where: str, field: str, runs: Any, rows: int) -> CorruptDumpError:
    """The error for row metadata ``runs`` that :func:`_runs_total` did not accept for ``rows`` rows."""
    if type(runs) is not list:
        return bad_field(where, field, "null or a list of [start, count] runs", runs)
    for j, run in enumerate(runs):
        if _runs_total([run]) < 0:
            return bad_field(where, f"{field}[{j}]", "a [start, count] pair of integers with count >= 0 (int64)", run)
    return CorruptDumpError(f"{where}: {field}: runs cover {_runs_total(runs)} rows but the tensor has {rows}")


def _check_record(d: Any, i: int, where: str, files: Mapping[str, int], itemsize: Mapping[str, int]) -> int:
    """Validate record ``tensors[i]``; return the bytes it needs in its file (one at least per row).

    One chain of inline tests, as it runs for every record of a 100k-record manifest; the
    field name is formatted only on failure.
    """
    if type(d) is not dict:
        raise bad_field(where, f"tensors[{i}]", "a tensor record object", d)
    if not _REC_REQUIRED <= d.keys() <= _REC_ALLOWED:
        _keys(where, f"tensors[{i}]", d, _REC_REQUIRED, _REC_ALLOWED)
    get = d.get
    name = d["name"]
    key = d["key"]
    file = d["file"]
    dtype = d["dtype"]
    shape = d["shape"]
    fp = d["forward_pass"]
    rank = get("rank", 0)
    call = get("call", 0)
    layer = get("layer")
    point = get("point")
    sd = get("shard_dim")
    meta = get("meta", {})
    # names are printed in terminals: no control characters (an ESC sequence would drive the terminal)
    if type(name) is not str or not name or not name.isprintable() or not name.isascii() and not is_text(name):
        raise bad_field(where, f"tensors[{i}].name", "a non-empty string of printable characters", name)
    if type(key) is not str or not key or not key.isprintable() or not key.isascii() and not is_text(key):
        raise bad_field(where, f"tensors[{i}].key", "a non-empty string of printable characters", key)
    if type(file) is not str or file not in files:
        raise bad_field(where, f"tensors[{i}].file", "a file listed in files", file)
    if type(dtype) is not str or dtype not in itemsize:
        raise bad_field(where, f"tensors[{i}].dtype", f"one of {sorted(itemsize)}", dtype)
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise bad_field(where, f"tensors[{i}].shape", f"a list of at most {MAX_NDIM} integers >= 0", shape)
    for n in shape:
        if type(n) is not int or n < 0 or n > _I64_MAX:
            raise bad_field(where, f"tensors[{i}].shape", "a list of integers >= 0", shape)
    if type(fp) is not int or fp < 0 or fp > _I64_MAX:
        raise bad_field(where, f"tensors[{i}].forward_pass", "an integer >= 0", fp)
    if type(rank) is not int or rank < 0 or rank > _I64_MAX:
        raise bad_field(where, f"tensors[{i}].rank", "an integer >= 0", rank)
    if type(call) is not int or call < 0 or call > _I64_MAX:
        raise bad_field(where, f"tensors[{i}].call", "an integer >= 0", call)
    if layer is not None and (type(layer) is not int or layer < _I64_MIN or layer > _I64_MAX):
        raise bad_field(where, f"tensors[{i}].layer", "an integer or null", layer)
    if point is not None and not is_text(point):
        raise bad_field(where, f"tensors[{i}].point", "a string or null", point)
    if sd is not None and (type(sd) is not int or not 0 <= sd < len(shape)):
        raise bad_field(where, f"tensors[{i}].shard_dim", f"null or a dim index below {len(shape)}", sd)
    if type(meta) is not dict or meta and not all(isinstance(v, _SCALARS) for v in meta.values()):
        raise bad_field(where, f"tensors[{i}].meta", "an object of strings, numbers, booleans or nulls", meta)
    if meta:
        _check_text(meta, where, f"tensors[{i}].meta")
        check_decode_meta(meta, where, f"tensors[{i}].meta")
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
        raise bad_field(where, "tensors", "a list of tensor records", tensors)
    raw_spec = raw["capture_signature"].get("sketch")
    spec = check_spec(raw_spec, where) if raw_spec is not None else None
    used: dict[str, int] = {}
    idents: set[tuple[Any, ...]] = set()
    locations: set[tuple[str, str]] = set()
    for i, d in enumerate(tensors):
        need = _check_record(d, i, where, files, itemsize)
        file = d["file"]
        # a sketch's F64 norms beside it; a full hidden state under a sketch spec refused
        need += check_record_sketch(d, spec, i, where, locations, raw["model"].get("hidden_size"))
        if need > files[file]:
            raise CorruptDumpError(
                f"{where}: tensors[{i}].shape: {d['dtype']}{d['shape']} needs {need} bytes but "
                f"its file {file} holds {files[file]}"
            )
        used[file] = used.get(file, 0) + need
        ident, location = (d["name"], d["forward_pass"], d.get("rank", 0), d.get("call", 0)), (file, d["key"])
        if ident in idents or location in locations:
            _duplicate(tensors, i, where)
            raise CorruptDumpError(f"{where}: tensors[{i}]: (file, key) {list(location)} is a sketch's norms")
        idents.add(ident)
        locations.add(location)
    check_kv_records(raw, where)
    check_speculative_records(raw, where)
    for name, need in used.items():
        if need > files[name]:
            raise CorruptDumpError(
                f"{where}: files[{show(name)}]: its tensors need {need} bytes together but the file holds {files[name]}"
            )


def _duplicate(tensors: list[dict], i: int, where: str) -> None:
    """Raise naming the record before ``tensors[i]`` that shares its identity or its (file, key)."""
    d = tensors[i]

    def ident(r: dict) -> tuple[Any, ...]:
        return r["name"], r["forward_pass"], r.get("rank", 0), r.get("call", 0)

    for j, r in enumerate(tensors[:i]):
        if ident(r) == ident(d):
            raise CorruptDumpError(
                f"{where}: tensors[{i}]: same (name, forward_pass, rank, call) {list(ident(d))} as tensors[{j}]"
            )
        if (r["file"], r["key"]) == (d["file"], d["key"]):
            raise CorruptDumpError(f"{where}: tensors[{i}]: same (file, key) {[d['file'], d['key']]} as tensors[{j}]")


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
        raise bad_field(where, "header __metadata__", "an object of strings", meta)
    out: dict[str, HeaderEntry] = {}
    for key, info in header.items():
        if key != "__metadata__":
            out[key] = _header_entry(key, info, where, data_size, itemsize)
    _check_tiling(out, where, data_size)
    return out


def _header_entry(key: str, info: Any, where: str, data_size: int, itemsize: Mapping[str, int]) -> HeaderEntry:
    """One validated header entry (the field name is formatted only on failure: a file may hold 100k)."""
    if type(info) is not dict or info.keys() != _ENTRY_KEYS:
        raise bad_field(where, f"header[{show(key)}]", "an object of dtype, shape and data_offsets", info)
    dtype = info["dtype"]
    shape = info["shape"]
    offsets = info["data_offsets"]
    if type(dtype) is not str or dtype not in itemsize:
        raise bad_field(where, f"header[{show(key)}].dtype", f"one of {sorted(itemsize)}", dtype)
    if (
        type(shape) is not list
        or len(shape) > MAX_NDIM
        or not all(type(s) is int and 0 <= s <= _I64_MAX for s in shape)
    ):
        raise bad_field(where, f"header[{show(key)}].shape", "a list of integers >= 0", shape)
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise bad_field(
            where, f"header[{show(key)}].data_offsets", f"[begin, end] with 0 <= begin <= end <= {data_size}", offsets
        )
    begin, end = offsets
    need = math.prod(shape) * itemsize[dtype]
    if end - begin != need:
        raise CorruptDumpError(
            f"{where}: header[{show(key)}]: data_offsets span {end - begin} bytes but {dtype}{shape} needs {need}"
        )
    return dtype, tuple(shape), begin, end


def _check_tiling(entries: Mapping[str, HeaderEntry], where: str, data_size: int) -> None:
    """Sorted byte ranges must follow each other without overlap or gap and end at ``data_size``."""
    cursor, prev = 0, None
    for key, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin < cursor:
            raise CorruptDumpError(
                f"{where}: tensors {prev!r} and {key!r} overlap (bytes {begin}..{cursor} of the data section)"
            )
        if begin > cursor:
            raise CorruptDumpError(f"{where}: bytes {cursor}..{begin} of the data section belong to no tensor")
        cursor, prev = end, key
    if cursor != data_size:
        raise CorruptDumpError(f"{where}: bytes {cursor}..{data_size} of the data section belong to no tensor")
