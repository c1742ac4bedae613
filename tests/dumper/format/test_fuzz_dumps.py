"""Fuzzing the dump reader: mutated manifests and safetensors headers of a real dump.

Each case copies a real dump, damages it one way, and runs both CLIs in-process on it
(``python -m comparator BASE MUTATED --require-all``, so that a tensor the damage leaves
unmatched is not silently skipped, and ``python -m dumper ls MUTATED``). Properties:

* the exit code is 0, 1 or 2, never 3, and no traceback is printed; an exit 2 prints one line;
* nothing under ``outside/`` (a sentinel beside the dumps, holding valid copies that mutated
  paths point at, so following one would *pass*) is opened: an audit hook records every open;
* traced memory (numpy's buffers included) peaks under 512 MiB;
* where the damage decides the answer, the exit code is that answer: a wrong type for a field
  the format defines, a hostile path or a broken header exits 2; a change to what a record reads
  (file, key, shape, dtype, rows) never exits 0; bytes of a header that still parses to the same
  JSON exit 0.

A last test runs the comparator in subprocesses on the largest hostile inputs and measures
each child's peak RSS.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.cli.main import main as compare_main
from dumper.cli.main import main as dumper_main
from dumper.format import MANIFEST_NAME
from dumper.format.files import JSON_MEMORY_BUDGET, json_memory_bound
from tests.dumper.format.test_format_boundary import header_of, write_small_dump
from tests.fuzzing import FUZZ, LIMIT, get_path, json_paths, run_child, set_path, watch


class Sandbox:
    """A real base dump, a sentinel ``outside/`` beside it, and fresh copies to damage."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = write_small_dump(root / "dumps" / "base")
        self.outside = root / "outside"
        self.outside.mkdir()
        for p in self.base.iterdir():  # valid copies: a reader that followed a hostile path would pass
            shutil.copy(p, self.outside / p.name)
        self.manifest = json.loads((self.base / MANIFEST_NAME).read_text())
        self.files = sorted(self.manifest["files"])
        self._n = itertools.count()

    def copy(self) -> Path:
        dst = self.root / "dumps" / f"m{next(self._n)}"
        shutil.copytree(self.base, dst)
        return dst

    def run(self, mutated: Path) -> tuple[int, int]:
        """Exit codes of the comparator and of ``dumper ls`` on ``mutated``, with the properties checked."""
        codes = []
        runs = (
            ([str(self.base), str(mutated), "--quiet", "--require-all"], compare_main),
            (["ls", str(mutated)], dumper_main),
        )
        for argv, main in runs:
            out, err = io.StringIO(), io.StringIO()
            with watch() as w, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(argv)
            text = err.getvalue()
            assert rc in (0, 1, 2), (argv, rc, text)
            assert "Traceback" not in text and "internal error" not in text, text
            assert rc != 2 or len(text.strip().splitlines()) == 1, text
            leaked = w.opened_under(self.outside)
            assert not leaked, leaked
            assert w.peak < LIMIT, w.peak
            codes.append(rc)
        shutil.rmtree(mutated)
        return codes[0], codes[1]


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("fuzz"))


def test_audit_hook_sees_reads_outside(box):
    """The containment property can fail: an open under outside/ is recorded."""
    with watch() as w:
        (box.outside / MANIFEST_NAME).read_bytes()
    assert str(box.outside / MANIFEST_NAME) in w.opened


# -- manifests -----------------------------------------------------------------------------------
TOP_TYPES = {
    "format_version": (int,),
    "created_at": (str,),
    "model": (dict,),
    "capture_signature": (dict,),
    "environment": (dict,),
    "files": (dict,),
    "tensors": (list,),
    "extra": (dict,),
}
REC_TYPES = {
    "name": (str,),
    "file": (str,),
    "key": (str,),
    "shape": (list,),
    "dtype": (str,),
    "forward_pass": (int,),
    "rank": (int,),
    "call": (int,),
    "layer": (int, type(None)),
    "point": (str, type(None)),
    "positions": (list, type(None)),
    "sequence_ids": (list, type(None)),
    "shard_dim": (int, type(None)),
    "meta": (dict,),
}
REQUIRED = {"top": set(TOP_TYPES) - {"extra"}, "record": {"name", "file", "key", "shape", "dtype", "forward_pass"}}
READS = {"file", "key", "shape", "dtype", "positions", "sequence_ids"}
"""Record fields that decide which bytes are compared with which: changing one must never pass."""
ODD_VALUES = [
    "3",
    3.5,
    True,
    False,
    None,
    [],
    {},
    "",
    -1,
    2**31,
    2**63,
    2**64,
    [[0, 2**40]],
    {"a": [1]},
    "F32",
    "\ud800",
    float("nan"),
]
BIG_INTS = [-1, -(2**63), 0, 1, 2**31, 2**40, 2**62, 2**63 - 1, 2**64]


def _field(path: tuple) -> tuple[str, str] | None:
    """("top", key) or ("record", key) when ``path`` names a field the format types exactly."""
    if len(path) == 1:
        return "top", path[0]
    if len(path) == 3 and path[0] == "tensors":
        return "record", path[2]
    return None


def _typed(path: tuple, value: Any) -> bool | None:
    """Whether ``value`` has a type the format allows at ``path`` (None: the format does not say)."""
    f = _field(path)
    if f is not None:
        return type(value) in (TOP_TYPES if f[0] == "top" else REC_TYPES)[f[1]]
    if (
        path[0] == "files"
        and len(path) == 2
        or path[0] == "tensors"
        and len(path) >= 5
        and path[2] in READS
        or path[0] == "tensors"
        and len(path) == 4
        and path[2] == "shape"
    ):
        return type(value) is int  # a file size, a shape dim, or a run's start / count
    return None


def _reads(path: tuple) -> bool:
    return len(path) >= 3 and path[0] == "tensors" and path[2] in READS


def _write(dump: Path, m: dict) -> None:
    (dump / MANIFEST_NAME).write_text(json.dumps(m))


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=400)
def test_mutated_manifests(box, data):
    """Keys dropped, values retyped, numbers made huge or negative, values swapped, unknown keys added."""
    m = copy.deepcopy(box.manifest)
    paths = json_paths(m)
    op = data.draw(st.sampled_from(["drop", "retype", "number", "swap", "unknown"]))
    expect: set[int] = {0, 1, 2}
    if op == "drop":
        path = data.draw(st.sampled_from([p for p in paths if isinstance(get_path(m, p[:-1]), dict)]))
        del get_path(m, path[:-1])[path[-1]]
        f = _field(path)
        if f is not None and path[-1] in REQUIRED[f[0]] or path[0] == "files" and len(path) == 2:
            expect = {2}
    elif op == "retype":
        path = data.draw(st.sampled_from(paths))
        value = data.draw(st.sampled_from(ODD_VALUES))
        changed = value != get_path(m, path) or type(value) is not type(get_path(m, path))
        set_path(m, path, value)
        if _typed(path, value) is False:
            expect = {2}
        elif changed and _reads(path) and not (value is None and path[-1] in ("positions", "sequence_ids")):
            expect = {1, 2}  # (rows without positions are matched by forward pass instead: may still pass)
    elif op == "number":
        path = data.draw(st.sampled_from([p for p in paths if type(get_path(m, p)) is int]))
        old = get_path(m, path)
        absolute = data.draw(st.booleans())
        value = data.draw(st.sampled_from(BIG_INTS)) if absolute else old + data.draw(st.integers(-3, 3))
        set_path(m, path, value)
        if value != old and (_reads(path) or path[0] in ("files", "format_version")):
            expect = {1, 2}
    elif op == "swap":
        leaves = [p for p in paths if not isinstance(get_path(m, p), (dict, list))]
        a, b = data.draw(st.sampled_from(leaves)), data.draw(st.sampled_from(leaves))
        va, vb = get_path(m, a), get_path(m, b)
        set_path(m, a, vb)
        set_path(m, b, va)
        if (va != vb or type(va) is not type(vb)) and (_reads(a) or _reads(b)):
            expect = {1, 2}
    else:
        where = data.draw(st.sampled_from([(), ("tensors", 0), ("model",)]))
        get_path(m, where)["zz_unknown"] = 1
        if where != ("model",):
            expect = {2}
    dump = box.copy()
    _write(dump, m)
    rc, ls = box.run(dump)
    assert rc in expect, (op, rc, expect)
    assert ls in (0, 2) and (ls == 2 or expect != {2}), (op, ls)


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=100)
def test_hostile_paths(box, data):
    """Paths from the manifest that leave the dump, or symlinks that do, are refused and never read."""
    m = copy.deepcopy(box.manifest)
    victim = data.draw(st.sampled_from(box.files))
    dump = box.copy()
    how = data.draw(st.sampled_from(["name", "record", "files", "symlink", "inner-symlink"]))
    hostile = data.draw(
        st.sampled_from(
            [
                f"../../outside/{victim}",
                f"../outside/{victim}",
                str(box.outside / victim),
                f"sub/{victim}",
                "..",
                ".",
                "",
                "/dev/zero",
                f"./{victim}",
                f"{victim}/",
                "\ud800",
                f"{victim}\0",
            ]
        )
    )
    expect = {2}
    if how in ("name", "files"):
        m["files"][hostile] = m["files"].pop(victim)
    if how in ("name", "record"):
        for t in m["tensors"]:
            t["file"] = hostile if t["file"] == victim else t["file"]
    if how == "symlink":
        (dump / victim).unlink()
        (dump / victim).symlink_to(box.outside / victim if data.draw(st.booleans()) else f"../../outside/{victim}")
    if how == "inner-symlink":  # a symlink that stays inside the dump is fine
        (dump / victim).rename(dump / "moved.bin")
        (dump / victim).symlink_to("moved.bin")
        expect = {0}
    _write(dump, m)
    rc, ls = box.run(dump)
    assert rc in expect and ls in expect, (how, hostile, rc, ls)


# -- safetensors headers -------------------------------------------------------------------------
def _rewrite(dump: Path, name: str, header: Any, data: bytes) -> None:
    blob = json.dumps(header, separators=(",", ":")).encode()
    (dump / name).write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    m = json.loads((dump / MANIFEST_NAME).read_text())
    m["files"][name] = (dump / name).stat().st_size
    _write(dump, m)


def _header_span(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    return int.from_bytes(raw[:8], "little"), raw


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=300)
def test_mutated_safetensors_headers(box, data):
    """The length field, offsets, dtypes and shapes changed, ranges swapped, bytes flipped in header or data."""
    name = data.draw(st.sampled_from(box.files))
    dump = box.copy()
    header, body = header_of(dump / name)
    keys = sorted(header)
    key = data.draw(st.sampled_from(keys))
    op = data.draw(st.sampled_from(["length", "offset", "dtype", "shape", "swap", "garbage", "data"]))
    expect = {2}
    if op == "length":  # the 8-byte length field, edited in place
        n, raw = _header_span(dump / name)
        new = data.draw(st.sampled_from([0, 1, 2**32, 2**40, 2**63, 2**64 - 1]) | st.integers(n - 16, n + 16))
        new = new if new != n else n + 1
        (dump / name).write_bytes((new % 2**64).to_bytes(8, "little") + raw[8:])
    elif op == "offset":
        i, new = data.draw(st.integers(0, 1)), data.draw(st.sampled_from(BIG_INTS) | st.integers(-8, 300))
        offsets = list(header[key]["data_offsets"])
        if offsets[i] == new:
            new += 1
        offsets[i] = new
        _rewrite(dump, name, {**header, key: {**header[key], "data_offsets": offsets}}, body)
    elif op == "dtype":
        new = data.draw(st.sampled_from(["F64", "F32", "F16", "BF16", "I64", "I32", "U8", "BOOL", "F8_E4M3", "", 4]))
        expect = {0} if new == header[key]["dtype"] else {2}
        _rewrite(dump, name, {**header, key: {**header[key], "dtype": new}}, body)
    elif op == "shape":
        shape = list(header[key]["shape"])
        i = data.draw(st.integers(0, len(shape) - 1)) if shape else 0
        new = data.draw(st.sampled_from([0, -1, 2**31, 2**63]) | st.integers(1, 16))
        shape = shape[:i] + [new] + shape[i + 1 :] if shape else [new]
        expect = {0} if shape == header[key]["shape"] else {2}
        _rewrite(dump, name, {**header, key: {**header[key], "shape": shape}}, body)
    elif op == "swap":  # two tensors trade byte ranges: a well-formed file holding other values
        other = data.draw(st.sampled_from(keys))
        a, b = header[key]["data_offsets"], header[other]["data_offsets"]
        same_size = a[1] - a[0] == b[1] - b[0] and header[key]["dtype"] == header[other]["dtype"]
        expect = {2} if not same_size else {0} if body[a[0] : a[1]] == body[b[0] : b[1]] else {1}
        _rewrite(
            dump,
            name,
            {**header, key: {**header[key], "data_offsets": b}, other: {**header[other], "data_offsets": a}},
            body,
        )
    else:  # bytes flipped in place: inside the header JSON, or inside the data section
        n, raw = _header_span(dump / name)
        lo, hi = (8, 8 + n) if op == "garbage" else (8 + n, len(raw))
        buf = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            buf[data.draw(st.integers(lo, hi - 1))] = data.draw(st.integers(0, 255))
        (dump / name).write_bytes(bytes(buf))
        if op == "data":
            expect = {0, 1}  # other numbers: within tolerance or a divergence, never corrupt
        else:
            try:
                same = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8")) == header
            except ValueError:
                same = False
            expect = {0} if same else {2}
    rc, ls = box.run(dump)
    assert rc in expect, (op, key, rc, expect)
    assert ls == 0  # ls reads the manifest only, which is intact


# -- the largest hostile inputs, in real processes -----------------------------------------------
@pytest.mark.slow
def test_largest_hostile_inputs_stay_under_512_mib(box, tmp_path):
    base, data0 = box.base, box.files[0]
    header = box.copy()  # a sparse data file declaring a 2^40-byte header, all of it present
    with open(header / data0, "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))
        f.truncate(2**40 + 8)
    m = copy.deepcopy(box.manifest)
    m["files"][data0] = 2**40 + 8
    _write(header, m)
    rows = box.copy()  # a manifest claiming 2^31 rows of its first tensor
    m = copy.deepcopy(box.manifest)
    m["tensors"][0].update(shape=[2**31, 8], positions=[[0, 2**31]], sequence_ids=[[0, 2**31]])
    _write(rows, m)
    dense = box.copy()  # the costliest JSON the bound lets through, then one bad field
    m = copy.deepcopy(box.manifest)
    m["tensors"][0]["layer"] = "3"
    m["extra"]["blob"] = "@@"
    text = json.dumps(m, separators=(",", ":"))

    def keys(n: int) -> bytes:
        return text.replace('"@@"', "{" + ",".join(f'"k{i:07d}":"ab"' for i in range(n)) + "}").encode()

    per_key = (json_memory_bound(keys(2000)) - json_memory_bound(keys(1000))) / 1000  # the bound is linear
    good = keys(int((JSON_MEMORY_BUDGET - json_memory_bound(keys(1000))) / per_key) + 999)
    assert JSON_MEMORY_BUDGET - 4096 < json_memory_bound(good) <= JSON_MEMORY_BUDGET
    (dense / MANIFEST_NAME).write_bytes(good)
    results = {}
    cases = [header, rows, dense]
    for label, bad, needle in [
        ("2^40-byte header", header, "exceeds the 100000000-byte limit"),
        ("2^31 rows", rows, "needs 68719476736 bytes"),
        (f"{len(good) >> 20} MiB of distinct keys", dense, "tensors[0].layer"),
    ]:
        rc, err, rss = run_child("comparator", base, bad, "--quiet")
        assert rc == 2 and needle in err, (label, err)
        assert rss < LIMIT, (label, rss)
        results[label] = rss >> 20
    print("peak RSS (MiB):", results)
    for d in cases:
        shutil.rmtree(d)
