"""Fuzzing the SGLang dump reader: real SGLang ``.pt`` files damaged byte by byte and structurally.

Each case copies the committed SGLang dump (``tests/fixtures/sglang/clean``, written by sglang
0.5.23's own dumper), damages one of its ``.pt`` files, and runs the command of docs/engines.md
("SGLang dumps"), ``python -m comparator HF_DUMP SGLANG_DIR --quiet``, in-process
(:func:`tests.fuzzing.run_main`). Every case holds to :func:`tests.fuzzing.check_outcome` (exit
0, 1 or 2, no traceback, one line on exit 2, no control character on the terminal, nothing
opened under the sentinel ``outside/``, traced memory bounded), and besides:

* bytes overwritten, inserted or deleted anywhere in a file (zip headers, data descriptors, the
  pickle, a tensor's bytes), a truncated file or appended bytes: exit 2, or exactly what the
  undamaged dump gives (same exit, same verdict line). Every byte that decides what is compared
  is framed or CRC-checked, so damage never moves a verdict;
* damage to a tensor's framing, written as a consistent zip (a compressed or encrypted record,
  sizes, offsets, the storage size the pickle declares, a record named twice): always exit 2,
  never a verdict computed from bytes that are not the tensor's;
* file names, record names, dict keys and meta strings with control characters: never raw on
  the terminal.

The last tests check that errors name the user's path (never the temporary conversion folder)
and measure a child's peak RSS on the largest hostile inputs.
"""

from __future__ import annotations

import io
import itertools
import os
import pickletools
import shutil
import struct
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from comparator.cli.main import main as compare_main
from dumper.engines.torch_archive import MAX_CENTRAL_BYTES, MAX_PICKLE_BYTES, MAX_RECORDS
from dumper.format.files import printable
from tests.fuzzing import FUZZ, LIMIT, Outcome, check_outcome, run_child, run_main

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "sglang"
NAMES = sorted(p.name for p in (FIX / "clean").iterdir())
HIDDEN = [n for n in NAMES if "hidden_states" in n]
CONTROL = ["\x1b[31m", "\x07", "\x1b]0;pwned\x07", "\r", "\n", "\x9b2J", "\x7f"]
"""Escape sequences and control characters (none is a NUL or a ``/``, so each can be in a file name)."""


def _tags(name: str) -> list[str]:
    """The records of a fixture file that the framing cases damage (``rids`` holds strings, no tensor)."""
    present = {n.partition("/")[2] for n in zipfile.ZipFile(FIX / "clean" / name).namelist()}
    return [t for t in ("data/0", "data.pkl", "byteorder", "version") if t in present]


TAGS = {n: _tags(n) for n in NAMES}


class Sandbox:
    """The clean SGLang dump, a sentinel ``outside/`` beside it, and fresh copies to damage."""

    def __init__(self, root: Path) -> None:
        self.root, self.outside = root, root / "outside"
        self.outside.mkdir()
        for n in HIDDEN[:2]:  # valid files: a reader that followed a symlink out here would pass
            shutil.copy(FIX / "clean" / n, self.outside / n)
        self._n = itertools.count()
        self.clean = self.run(self.copy())
        assert self.clean.code == 0 and self.clean.out.startswith("PASS"), self.clean

    def copy(self) -> Path:
        dst = self.root / f"case{next(self._n)}" / "dump_20260101_000000_000001"
        shutil.copytree(FIX / "clean", dst)
        return dst

    def run(self, dump: Path) -> Outcome:
        o = run_main(compare_main, [FIX / "hf", dump, "--quiet"])
        check_outcome(o, outside=self.outside)
        shutil.rmtree(dump.parent)
        return o


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("fuzz-sglang"))


# -- zip surgery (the test's own reading of the format, not the reader's) -----------------------
def regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges of a torch.save zip: each record's local header, bytes and descriptor, the directory, the end."""
    z = zipfile.ZipFile(io.BytesIO(data))
    out = {}
    for i in z.infolist():
        n, e = struct.unpack_from("<2H", data, i.header_offset + 26)
        start = i.header_offset + 30 + n + e
        tag = i.filename.partition("/")[2]
        out[f"local {tag}"] = (i.header_offset, start)
        out[f"bytes {tag}"] = (start, start + i.file_size)
        out[f"descriptor {tag}"] = (start + i.file_size, start + i.file_size + 16)
    out["central"] = (z.start_dir, len(data) - 22)
    out["end"] = (len(data) - 22, len(data))
    return {k: v for k, v in out.items() if v[1] > v[0]}


def rezip(
    data: bytes,
    *,
    edit: Callable[[str, bytes], bytes] = lambda _, b: b,
    method: Callable[[str], int] = lambda _: zipfile.ZIP_STORED,
    extra: tuple[tuple[str, bytes], ...] = (),
) -> bytes:
    """``data`` rewritten as a consistent zip (fresh CRCs and sizes), records edited or compressed."""
    src, buf = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a name written twice, on purpose
        for i in src.infolist():
            out.writestr(i.filename, edit(i.filename, src.read(i)), compress_type=method(i.filename))
        for name, b in extra:
            out.writestr(name, b)
    return buf.getvalue()


def central_entry(data: bytes, tag: str) -> int:
    """Offset of the central directory entry of the record ``ARCHIVE/tag``."""
    z = zipfile.ZipFile(io.BytesIO(data))
    pos = z.start_dir
    for i in z.infolist():
        if i.filename.partition("/")[2] == tag:
            return pos
        pos += 46 + len(i.orig_filename.encode()) + len(i.extra) + len(i.comment)
    raise KeyError(tag)


def _numel_op(pkl: bytes) -> tuple[int, int, int]:
    """(start, end, value) of the storage's declared element count: the int just before its persistent id."""
    ops = list(pickletools.genops(pkl))
    at = next(k for k, (op, _, _) in enumerate(ops) if op.name == "BINPERSID")
    k = next(j for j in range(at - 1, 0, -1) if ops[j][0].name.startswith(("BININT", "LONG")))
    return ops[k][2], ops[k + 1][2], ops[k][1]


def patch_numel(pkl: bytes, numel: int) -> bytes:
    """The pickle with the storage's declared element count replaced (as a LONG1)."""
    start, end, _ = _numel_op(pkl)
    body = numel.to_bytes((numel.bit_length() + 8) // 8, "little", signed=True)
    return pkl[:start] + b"\x8a" + bytes([len(body)]) + body + pkl[end:]


def _pickle_of(raw: bytes) -> bytes:
    z = zipfile.ZipFile(io.BytesIO(raw))
    return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


# -- byte damage: exit 2, or the clean verdict --------------------------------------------------
@pytest.mark.slow
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_byte_damage_never_moves_the_verdict(box: Sandbox, data: st.DataObject) -> None:
    d = box.copy()
    f = d / data.draw(st.one_of(st.sampled_from(HIDDEN), st.sampled_from(NAMES)), label="file")
    raw = f.read_bytes()
    spans = regions(raw)
    part = data.draw(
        st.one_of(st.just("bytes"), st.sampled_from(["bytes", "local", "descriptor", "central", "end"])), label="part"
    )
    if part in ("central", "end"):
        start, end = spans[part]
    else:  # the tensor's bytes and the pickle most often, as they decide what is compared
        records = sorted(k.partition(" ")[2] for k in spans if k.startswith(part + " "))
        first = [r for r in ("data/0", "data.pkl") if r in records]
        record = data.draw(st.one_of(*map(st.just, first), st.sampled_from(records)), label="record")
        start, end = spans[f"{part} {record}"]
    at = data.draw(st.integers(start, end - 1), label="offset")
    how = data.draw(st.sampled_from(["overwrite", "insert", "delete", "truncate", "append"]), label="how")
    junk = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
    raw = {
        "overwrite": raw[:at] + junk + raw[at + len(junk) :],
        "insert": raw[:at] + junk + raw[at:],
        "delete": raw[:at] + raw[at + len(junk) :],
        "truncate": raw[:at],
        "append": raw + junk,
    }[how]
    f.write_bytes(raw)
    o = box.run(d)
    event(f"{part} {how}: exit {o.code}")
    assert o.code == 2 or (o.code, o.out) == (box.clean.code, box.clean.out), (o.code, o.out, o.err)


def test_bytes_that_frame_nothing_keep_the_verdict(box: Sandbox) -> None:
    """Fields no reader uses may change (times, dates, the padding torch.save aligns records with): same verdict."""
    d = box.copy()
    for name in NAMES:
        f = d / name
        raw = f.read_bytes()
        b = bytearray(raw)
        for key, (start, end) in regions(raw).items():
            if key.startswith("local "):
                b[start + 10 : start + 14] = b"\x21\x43\x65\x87"  # modification time and date
                pad = start + 30 + struct.unpack_from("<H", raw, start + 26)[0] + 4  # after the padding's own header
                b[pad:end] = b"\x5a" * (end - pad) if end > pad else b""
        for tag in {i.filename.partition("/")[2] for i in zipfile.ZipFile(io.BytesIO(raw)).infolist()}:
            b[central_entry(raw, tag) + 12 : central_entry(raw, tag) + 16] = b"\x21\x43\x65\x87"
        f.write_bytes(bytes(b))
    o = box.run(d)
    assert (o.code, o.out) == (box.clean.code, box.clean.out), o.err


# -- framing damage: always exit 2 ---------------------------------------------------------------
def _framing(raw: bytes, kind: str, tag: str, n: int) -> bytes:
    """``raw`` with the framing of record ``tag`` changed by ``kind`` (``n``: a size or an offset delta)."""
    b = bytearray(raw)
    central = central_entry(raw, tag)
    local = struct.unpack_from("<L", raw, central + 42)[0]
    if kind == "compressed":
        methods = [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]
        return rezip(raw, method=lambda name: methods[n % 3] if name.endswith("/" + tag) else zipfile.ZIP_STORED)
    if kind == "encrypted":
        b[central + 8] |= 1
        b[local + 6] |= 1
    elif kind == "sizes":  # both sizes of the record, in the directory (the local header defers to a descriptor)
        size = struct.unpack_from("<L", raw, central + 20)[0]
        struct.pack_into("<2L", b, central + 20, max(size + n, 0), max(size + n, 0))
    elif kind == "offset":
        struct.pack_into("<L", b, central + 42, local + n if local + n >= 0 else local - n)
    elif kind == "local extra":  # moves where the record's bytes start
        extra = struct.unpack_from("<H", raw, local + 28)[0]
        struct.pack_into("<H", b, local + 28, extra + n if extra + n >= 0 else extra - n)
    elif kind == "declared numel":
        return rezip(raw, edit=lambda name, v: patch_numel(v, n) if name.endswith("/data.pkl") else v)
    elif kind == "named twice":
        return rezip(
            raw,
            extra=(
                (
                    next(
                        i.filename
                        for i in zipfile.ZipFile(io.BytesIO(raw)).infolist()
                        if i.filename.endswith("/" + tag)
                    ),
                    b"\0" * max(n, 1),
                ),
            ),
        )
    return bytes(b)


@pytest.mark.slow
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_framing_damage_is_refused(box: Sandbox, data: st.DataObject) -> None:
    d = box.copy()
    kind = data.draw(
        st.sampled_from(["compressed", "encrypted", "sizes", "offset", "local extra", "declared numel", "named twice"]),
        label="kind",
    )
    tensors = [n for n in NAMES if "data/0" in TAGS[n]]
    f = d / data.draw(st.sampled_from(tensors if kind == "declared numel" else NAMES), label="file")
    raw = f.read_bytes()
    tag = data.draw(st.sampled_from(TAGS[f.name]), label="record")
    if kind == "declared numel":
        want = _numel_op(_pickle_of(raw))[2]
        n = data.draw(
            st.one_of(st.integers(0, 3 * want), st.sampled_from([2**31 - 1, 2**32, 2**40, 2**62])).filter(
                lambda v: v != want
            ),
            label="numel",
        )
    else:
        n = data.draw(st.integers(1, 70), label="delta") * data.draw(st.sampled_from([1, -1]), label="sign")
    f.write_bytes(_framing(raw, kind, tag, n))
    o = box.run(d)
    event(f"{kind}: exit {o.code}")
    assert o.code == 2, (kind, tag, n, o.out, o.err)
    assert f.name in o.err, o.err


def test_a_deflated_tensor_is_refused_not_compared(box: Sandbox) -> None:
    """The reported bug: a deflate-compressed data record was mapped raw and compared (rel_diff inf)."""
    d = box.copy()
    f = d / HIDDEN[0]
    f.write_bytes(_framing(f.read_bytes(), "compressed", "data/0", 0))
    o = box.run(d)
    assert o.code == 2 and "zip record data/0: compressed (method 8)" in o.err and str(f) in o.err, o.err


# -- hostile files and names -------------------------------------------------------------------
def _hostile(box: Sandbox, d: Path, kind: str, text: str) -> None:
    f = d / HIDDEN[0]
    extra = d / "step=0___rank=0___dump_index=99___name=x___recompute_status=disabled.pt"
    if kind == "fifo":
        os.mkfifo(extra)
    elif kind == "/dev/zero":
        os.symlink("/dev/zero", extra)
    elif kind == "symlink out":
        os.symlink(box.outside / HIDDEN[0], extra)
    elif kind == "file name":  # a control character in a tag, then a refused file that names it
        bad = f.rename(d / f.name.replace("recompute_status=disabled", f"recompute_status={text}"))
        bad.write_bytes(bad.read_bytes()[:100])
    elif kind == "name tag":
        f.rename(d / f.name.replace("name=non_intrusive", f"name=non{text}intrusive"))
    elif kind == "meta":
        obj = torch.load(f, weights_only=True)
        obj["meta"]["name"] = text
        torch.save(obj, f)
    elif kind == "dict key":
        obj = torch.load(f, weights_only=True)
        obj["value"] = {text: obj["value"]}
        torch.save(obj, f)
    elif kind == "record name":
        f.write_bytes(rezip(f.read_bytes(), extra=((f"{text}/evil", b"x"),)))


@settings(FUZZ, max_examples=40)
@given(
    kind=st.sampled_from(
        ["fifo", "/dev/zero", "symlink out", "file name", "name tag", "meta", "dict key", "record name"]
    ),
    text=st.lists(st.sampled_from([*CONTROL, "a", "é"]), min_size=1, max_size=4).map("".join),
)
def test_hostile_files_and_names(box: Sandbox, kind: str, text: str) -> None:
    d = box.copy()
    _hostile(box, d, kind, text)
    started = time.monotonic()
    o = box.run(d)
    event(f"{kind}: exit {o.code}")
    assert time.monotonic() - started < 60
    if kind not in ("name tag", "dict key") or not text.isprintable():  # a printable one names a tensor
        assert o.code == 2, (kind, o.out, o.err)


# -- errors name the user's path ---------------------------------------------------------------
def _narrow(f: Path) -> None:
    obj = torch.load(f, weights_only=True)
    obj["value"] = obj["value"][:, :32].clone()
    torch.save(obj, f)


def _rows_twice(f: Path) -> None:
    obj = torch.load(f, weights_only=True)
    obj["value"] = torch.cat([obj["value"], obj["value"]])
    torch.save(obj, f)


def _many_dims(f: Path) -> None:
    obj = torch.load(f, weights_only=True)
    obj["value"] = torch.zeros([1] * 40)
    torch.save(obj, f)


@pytest.mark.parametrize(
    "damage, why",
    [
        (_narrow, "different models"),
        (_rows_twice, "cannot be aligned"),
        (_many_dims, "(as converted): tensors[0].shape"),
    ],
)
def test_errors_name_the_users_path_not_the_temporary_folder(
    tmp_path: Path, damage: Callable[[Path], None], why: str
) -> None:
    d = tmp_path / "dump\x1b]0;x\x07_20260101_000000_000001"  # shown escaped, as every path from outside
    shutil.copytree(FIX / "clean", d)
    for name in HIDDEN:
        damage(d / name)
    o = run_main(compare_main, [FIX / "hf", d, "--quiet"])
    assert check_outcome(o) == 2 and why in o.err, o.err
    shown = printable(str(d))
    assert o.err.startswith(f"error: {shown}") and "driftscope-sglang-" not in o.err and "/." not in o.err, o.err
    out = tmp_path / "converted"
    o = run_main(compare_main, ["import-sglang", d, "--out", out])
    if damage is _many_dims:  # caught while converting: names the dump, not the folder being written beside --out
        assert check_outcome(o) == 2 and o.err.startswith(f"error: {shown} (as converted)") and "/." not in o.err
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".converted.")]
    else:
        assert check_outcome(o) == 0


# -- memory on the largest hostile inputs -------------------------------------------------------
def _heavy_pickle(f: Path) -> None:
    """A data.pkl at the limit, of one-byte opcodes that each build the costliest object, then not a tensor."""
    raw = f.read_bytes()
    body = b"\x80\x04" + b"\x8f" * (MAX_PICKLE_BYTES - 5) + b"K\x05."  # EMPTY_SET: ~230 bytes each
    f.write_bytes(rezip(raw, edit=lambda name, v: body if name.endswith("/data.pkl") else v))


def _full_directory(f: Path) -> None:
    """A valid archive with as many records as allowed, their names filling the directory's limit."""
    raw = f.read_bytes()
    prefix = zipfile.ZipFile(io.BytesIO(raw)).namelist()[0].partition("/")[0]
    n = MAX_RECORDS - 8
    width = MAX_CENTRAL_BYTES // MAX_RECORDS - 46 - len(prefix) - 11
    f.write_bytes(rezip(raw, extra=tuple((f"{prefix}/x/{i:06d}{'y' * width}", b"") for i in range(n))))


@pytest.mark.slow
def test_peak_rss_on_hostile_inputs(tmp_path: Path) -> None:
    results = {}
    for label, damage in (("256 KiB pickle of sets", _heavy_pickle), ("16k-record directory", _full_directory)):
        d = tmp_path / label.replace(" ", "-") / "dump_20260101_000000_000001"
        shutil.copytree(FIX / "clean", d)
        damage(d / HIDDEN[0])
        rc, err, rss = run_child("comparator", FIX / "hf", d, "--quiet")
        if damage is _full_directory:  # valid, if odd: the extra records are never read
            assert rc == 0, err
        else:
            assert rc == 2 and HIDDEN[0] in err and len(err.strip().splitlines()) == 1, (label, err)
        assert rss < LIMIT, (label, rss)
        results[label] = rss >> 20
    print("peak RSS (MiB):", results)


def test_a_deflate_bomb_is_refused_unread(box: Sandbox) -> None:
    """64 MiB of zeros deflated into a few KiB: refused from its header, never inflated."""
    d = box.copy()
    f = d / HIDDEN[0]
    f.write_bytes(
        rezip(
            f.read_bytes(),
            edit=lambda name, v: bytes(64 << 20) if name.endswith("/data/0") else v,
            method=lambda name: zipfile.ZIP_DEFLATED if name.endswith("/data/0") else 0,
        )
    )
    assert f.stat().st_size < 1 << 20
    o = box.run(d)
    assert o.code == 2 and "compressed (method 8)" in o.err and o.watched.peak < 16 << 20, (o.err, o.watched.peak)
