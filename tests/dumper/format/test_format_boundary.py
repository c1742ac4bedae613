"""The dump format's trust boundary: one regression test per class of hostile or broken dump.

Every dump here is real (written by the dumper, or by ``python -m dumper run`` for the CLI
tests) and then damaged on disk the way a bad disk, a hand edit or an attacker would. Each
class must fail as one :class:`CorruptDumpError` line naming the file and the field (exit 2),
never as a crash, a hang, an allocation sized by the damage, a read outside the dump, or a
divergence (exit 1, which CI reads as a regression).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dumper
from comparator.cli.main import main as compare_main
from dumper.cli.main import main as dumper_main
from dumper.errors import CorruptDumpError, IncompleteDumpError
from dumper.format import (
    MANIFEST_NAME,
    DumpReader,
    Manifest,
    TensorRecord,
    atomic_path,
    load_manifest,
    write_json_atomic,
)
from dumper.format.files import JSON_MEMORY_BUDGET, json_memory_bound
from dumper.format.validate import MANIFEST_KEYS, MAX_HEADER_BYTES, RECORD_KEYS
from tests.conftest import run_cli, subprocess_env

DATA0 = "r0-p000000-000.safetensors"


def write_small_dump(out: Path) -> Path:
    """A real dump without a model: 2 passes x 2 layers of [4, 8] rows with positions, and BF16 logits."""
    g = torch.Generator().manual_seed(0)
    with dumper.capture(None, out, model_name="boundary", extra={"input_ids": [list(range(8))]}):
        for p in range(2):
            for layer in range(2):
                dumper.dump(
                    f"model.layers.{layer}.self_attn.input",
                    torch.randn(4, 8, generator=g),
                    layer=layer,
                    point="input",
                    positions=range(4 * p, 4 * p + 4),
                    sequence_ids=[0] * 4,
                )
            dumper.step()
        dumper.dump("logits", torch.randn(1, 6, generator=g).to(torch.bfloat16))
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return write_small_dump(tmp_path_factory.mktemp("small") / "dump")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A real tiny-llama dump written by the CLI under umask 022 (the child inherits the umask)."""
    out = tmp_path_factory.mktemp("llama") / "dump"
    old = os.umask(0o022)
    try:
        r = run_cli("dumper", "run", "--out", out, "--quiet")
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr
    return out


def copy_dump(src: Path, dst: Path, edit: Callable[[dict], Any] | None = None) -> Path:
    """A copy of a dump whose manifest JSON went through ``edit`` (written plainly, as a hand edit would)."""
    shutil.copytree(src, dst)
    if edit is not None:
        m = json.loads((dst / MANIFEST_NAME).read_text())
        edit(m)
        (dst / MANIFEST_NAME).write_text(json.dumps(m))
    return dst


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite_header(dump: Path, name: str, header: Any, data: bytes | None = None) -> None:
    """Replace one data file's header (and data section) and record the new size in the manifest,
    so only the header itself is wrong."""
    path = dump / name
    old_header, old_data = header_of(path)
    blob = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + (old_data if data is None else data))
    m = json.loads((dump / MANIFEST_NAME).read_text())
    m["files"][name] = path.stat().st_size
    (dump / MANIFEST_NAME).write_text(json.dumps(m))


def compare_in_process(capsys, base: Path, target: Path) -> tuple[int, str]:
    rc = compare_main([str(base), str(target), "--quiet"])
    return rc, capsys.readouterr().err


def assert_one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, err)


def read_everything(dump: Path) -> None:
    """Load the manifest and read every tensor, as a comparison would."""
    m = load_manifest(dump)
    reader = DumpReader(dump, m)
    for rec in m.tensors:
        np.asarray(reader.array(rec)).sum()


def tensor(m: dict, name: str, forward_pass: int = 0) -> dict:
    return next(t for t in m["tensors"] if t["name"] == name and t["forward_pass"] == forward_pass)


L0 = "model.layers.0.self_attn.input"
L1 = "model.layers.1.self_attn.input"


# -- 1. one validating reader: types, ranges, run lengths, duplicates, keys ----------------------
@pytest.mark.parametrize(
    "edit,field,got",
    [
        pytest.param(
            lambda m: tensor(m, L1).update(layer="3"),
            "tensors[1].layer: expected an integer or null",
            '"3"',
            id="layer-str",
        ),
        pytest.param(
            lambda m: tensor(m, L1).update(layer=3.5),
            "tensors[1].layer: expected an integer or null",
            "3.5",
            id="layer-float",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(forward_pass="0"),
            "tensors[0].forward_pass: expected an integer >= 0",
            '"0"',
            id="pass-str",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(rank=True),
            "tensors[0].rank: expected an integer >= 0",
            "true",
            id="rank-bool",
        ),
        pytest.param(lambda m: m.update(files=list(m["files"])), "files: expected an object", "[", id="files-list"),
        pytest.param(
            lambda m: m["files"].update({DATA0: "304"}),
            f'files["{DATA0}"]: expected an integer >= 0',
            '"304"',
            id="size-str",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(shape=[4, "8"]),
            "tensors[0].shape: expected a list of integers",
            '"8"',
            id="dim-str",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(dtype="F99"), "tensors[0].dtype: expected one of", '"F99"', id="dtype"
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(name=7), "tensors[0].name: expected a non-empty string", "7", id="name-int"
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(name="x\x1b[2Jy"),
            "tensors[0].name: expected a non-empty string of printable characters",
            '"x\\u001b[2Jy"',
            id="name-terminal-escape",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(name="\ud800"),
            "tensors[0].name: expected a non-empty string",
            '"\\ud800"',
            id="name-lone-surrogate",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(meta=[1]), "tensors[0].meta: expected an object", "[1]", id="meta-list"
        ),
        pytest.param(lambda m: m.update(tensors={}), "tensors: expected a list of tensor records", "{}", id="tensors"),
        pytest.param(
            lambda m: m["environment"].update(torch=["2.4"]),
            "environment.torch: expected a string, number",
            '["2.4"]',
            id="env-list",
        ),
        pytest.param(
            lambda m: m["model"].update(name=3), "model.name: expected a string or null", "3", id="model-name"
        ),
        pytest.param(
            lambda m: m["extra"].update(input_ids=[[1, "2"]]),
            "extra.input_ids[0]: expected a list of integers",
            '"2"',
            id="input-ids",
        ),
    ],
)
def test_type_confusion_is_corrupt(tmp_path, capsys, small, edit, field, got):
    bad = copy_dump(small, tmp_path / "bad", edit)
    with pytest.raises(CorruptDumpError) as e:
        load_manifest(bad)
    assert str(e.value).startswith(f"{bad / MANIFEST_NAME}: {field}") and got in str(e.value), e.value
    rc, err = compare_in_process(capsys, small, bad)
    assert rc == 2
    assert_one_line(err, f"{bad / MANIFEST_NAME}: {field}")


def test_bool_format_version_is_not_version_1(tmp_path, small):
    bad = copy_dump(small, tmp_path / "bad", lambda m: m.update(format_version=True))
    with pytest.raises(CorruptDumpError, match="format version True is not supported"):
        load_manifest(bad)


@pytest.mark.parametrize(
    "edit,field",
    [
        pytest.param(lambda m: tensor(m, L0).update(shape=[-4, 8]), "tensors[0].shape", id="dim"),
        pytest.param(lambda m: tensor(m, L0).update(forward_pass=-1), "tensors[0].forward_pass", id="pass"),
        pytest.param(lambda m: tensor(m, L0).update(call=-1), "tensors[0].call", id="call"),
        pytest.param(
            lambda m: tensor(m, L0).update(shard_dim=2),
            "tensors[0].shard_dim: expected null or a dim index below 2",
            id="shard-dim",
        ),
        pytest.param(
            lambda m: tensor(m, L0).update(shape=[1] * 33), "tensors[0].shape: expected a list of at most 32", id="ndim"
        ),
        pytest.param(lambda m: m["files"].update({DATA0: -1}), f'files["{DATA0}"]', id="size"),
        pytest.param(
            lambda m: tensor(m, L0).update(positions=[[2**63 - 2, 4]]), "tensors[0].positions[0]", id="int64-overflow"
        ),
    ],
)
def test_out_of_range_values_are_corrupt(tmp_path, small, edit, field):
    bad = copy_dump(small, tmp_path / "bad", edit)
    with pytest.raises(CorruptDumpError, match="^" + re.escape(f"{bad / MANIFEST_NAME}: {field}")):
        load_manifest(bad)


@pytest.mark.parametrize(
    "key,runs,match",
    [
        ("positions", [[0, 3]], "positions: runs cover 3 rows but the tensor has 4"),
        ("sequence_ids", [[0, 4], [1, 1]], "sequence_ids: runs cover 5 rows but the tensor has 4"),
        ("positions", [[0, 6], [0, -2]], r"positions\[1\]: expected a \[start, count\] pair"),
        ("positions", [[0, 4, 1]], r"positions\[0\]: expected a \[start, count\] pair"),
        ("sequence_ids", "0", "sequence_ids: expected null or a list of"),
    ],
)
def test_run_lengths_inconsistent_with_rows_are_corrupt(tmp_path, small, key, runs, match):
    bad = copy_dump(small, tmp_path / "bad", lambda m: tensor(m, L0).update({key: runs}))
    with pytest.raises(CorruptDumpError, match=r"tensors\[0\]\." + match):
        load_manifest(bad)


def test_duplicate_records_are_corrupt(tmp_path, small):
    twin = copy_dump(small, tmp_path / "twin", lambda m: m["tensors"].append({**tensor(m, L0), "key": L1}))
    with pytest.raises(
        CorruptDumpError,
        match=r"tensors\[5\]: same \(name, forward_pass, rank, call\) .* "
        r"as tensors\[0\]",
    ):
        load_manifest(twin)
    # two records reading the same bytes: a tensor compared against itself would always pass
    alias = copy_dump(small, tmp_path / "alias", lambda m: m["tensors"].append({**tensor(m, L0), "name": "x"}))
    with pytest.raises(CorruptDumpError, match=r"tensors\[5\]: same \(file, key\) .* as tensors\[0\]"):
        load_manifest(alias)


def test_missing_and_unknown_keys_are_corrupt(tmp_path, small):
    """Unknown keys in the top level or a record are refused (free-form data goes in extra/meta)."""
    cases = {
        "top": (lambda m: m.update(colour=1), r"top level: unknown keys \['colour'\]"),
        "rec": (lambda m: tensor(m, L0).update(colour=1), r"tensors\[0\]: unknown keys \['colour'\]"),
        "req": (lambda m: tensor(m, L0).pop("dtype"), r"tensors\[0\]: missing keys \['dtype'\]"),
        "files": (lambda m: m.pop("files"), r"top level: missing keys \['files'\]"),
    }
    for label, (edit, match) in cases.items():
        with pytest.raises(CorruptDumpError, match="malformed manifest: " + match):
            load_manifest(copy_dump(small, tmp_path / label, edit))
    # optional keys may be left out, and descriptive objects keep keys this version does not know
    ok = copy_dump(
        small,
        tmp_path / "ok",
        lambda m: (m.pop("extra"), tensor(m, L0).pop("meta"), m["model"].update(vendor_field=[1, 2])),
    )
    assert load_manifest(ok).extra == {}


def test_nested_json_is_corrupt(tmp_path, small):
    deep = copy_dump(small, tmp_path / "deep")
    (deep / MANIFEST_NAME).write_text('{"format_version": 1, "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CorruptDumpError, match="unreadable manifest .JSON nested too deeply"):
        load_manifest(deep)
    deep = copy_dump(small, tmp_path / "deep_header")
    path = deep / DATA0
    blob = b"[" * 50_000 + b"]" * 50_000
    path.write_bytes(len(blob).to_bytes(8, "little") + blob)
    _fix_size(deep, DATA0)
    with pytest.raises(CorruptDumpError, match=f"{DATA0}: unreadable safetensors header .JSON nested too deeply"):
        read_everything(deep)


def _fix_size(dump: Path, name: str) -> None:
    m = json.loads((dump / MANIFEST_NAME).read_text())
    m["files"][name] = (dump / name).stat().st_size
    (dump / MANIFEST_NAME).write_text(json.dumps(m))


def _peak(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """(what ``fn`` raised, its peak traced allocation in bytes)."""
    tracemalloc.start()
    try:
        fn()
        err = None
    except Exception as e:  # noqa: BLE001 - returned to the caller to inspect
        err = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return err, peak


@pytest.mark.parametrize("shape", [[2**31, 8], [2**31, 0], [2**20, 2**20, 2**20]])
def test_huge_declared_sizes_never_allocate(tmp_path, capsys, small, shape):
    """2^31 rows (or a zero-width tensor of 2^31 rows) against a 600-byte file: refused before any decode."""
    rows = int(np.prod(shape[:-1]))
    bad = copy_dump(
        small,
        tmp_path / "bad",
        lambda m: tensor(m, L0).update(shape=shape, positions=[[0, rows]], sequence_ids=[[0, rows]]),
    )
    err, peak = _peak(lambda: load_manifest(bad))
    assert isinstance(err, CorruptDumpError) and f"tensors[0].shape: F32{shape} needs" in str(err), err
    assert peak < 8 << 20
    rc, out = compare_in_process(capsys, small, bad)
    assert rc == 2 and "bytes but its file" in out


def test_tensors_sharing_a_file_must_fit_in_it_together(tmp_path, small):
    def grow(m: dict) -> None:  # each record alone fits its file, the two together do not
        for t in m["tensors"][:2]:
            t.update(shape=[9, 8], positions=[[0, 9]], sequence_ids=[[0, 9]])

    with pytest.raises(CorruptDumpError, match=rf'files\["{DATA0}"\]: its tensors need \d+ bytes together'):
        load_manifest(copy_dump(small, tmp_path / "bad", grow))


def test_oversized_and_dense_manifests_are_refused_before_parsing(tmp_path, small):
    big = copy_dump(small, tmp_path / "big")
    with open(big / MANIFEST_NAME, "r+b") as f:  # a sparse 2 GiB manifest: never read
        f.truncate(2 << 30)
    err, peak = _peak(lambda: load_manifest(big))
    assert isinstance(err, CorruptDumpError) and "exceeds the 128 MiB limit" in str(err), err
    assert peak < 1 << 20
    dense = copy_dump(small, tmp_path / "dense")  # 5 MB of empty objects would build ~130 MiB of dicts
    (dense / MANIFEST_NAME).write_text('{"format_version": 1, "extra": [' + ",".join(["{}"] * 2_000_000) + "]}")
    err, peak = _peak(lambda: load_manifest(dense))
    assert isinstance(err, CorruptDumpError) and "too many JSON values to parse safely" in str(err), err
    assert peak < 16 << 20


def test_memory_bound_covers_the_densest_json_shapes():
    """The bound that guards every parse is above what CPython really takes, for each kind of dense text."""
    n = 60_000
    shapes = {
        "empty objects": "[" + ",".join(["{}"] * n) + "]",
        "nested lists": "[" + ",".join(["[[]]"] * n) + "]",
        "one-key objects": "[" + ",".join(['{"a":1}'] * n) + "]",
        "distinct keys": "{" + ",".join(f'"k{i:07d}":"ab"' for i in range(n)) + "}",
        "pairs": "[" + ",".join(["[1000,2000]"] * n) + "]",
        "floats": "[" + ",".join(["1.5"] * n) + "]",
        "short strings": "[" + ",".join(['"ab"'] * n) + "]",
        "long string": '["' + "a" * (20 * n) + '"]',
        "non-ascii": '["\U0001f600' + "a" * (20 * n) + '"]',
        "escapes": "[" + ",".join(['"\\ud83d\\ude00"'] * n) + "]",
        "whitespace": "[" + " " * (20 * n) + "]",
    }
    for label, text in shapes.items():
        data = text.encode()
        tracemalloc.start()
        obj = json.loads(data.decode("utf-8"))
        used = tracemalloc.get_traced_memory()[1] + len(data)
        tracemalloc.stop()
        del obj
        assert used <= json_memory_bound(data), (label, used, json_memory_bound(data))


def test_a_manifest_of_100k_records_fits_the_parse_budget():
    record = {
        "name": "model.layers.31.self_attn.input",
        "file": "r0-p000999-000.safetensors",
        "key": "model.layers.31.self_attn.input",
        "shape": [1, 2048, 4096],
        "dtype": "BF16",
        "forward_pass": 999,
        "rank": 0,
        "call": 0,
        "layer": 31,
        "point": "input",
        "positions": [[0, 2048]],
        "sequence_ids": [[0, 2048]],
        "shard_dim": None,
        "meta": {},
    }
    per_record = json_memory_bound(json.dumps({"tensors": [record] * 100}, indent=1).encode()) / 100
    assert 100_000 * per_record < JSON_MEMORY_BUDGET, per_record


# -- safetensors headers -------------------------------------------------------------------------
def test_huge_declared_header_length_is_corrupt_without_allocating(tmp_path, small):
    bad = copy_dump(small, tmp_path / "bad")
    path = bad / DATA0
    with open(path, "r+b") as f:  # a sparse file: 2^40 declared header bytes, all present
        f.write((2**40).to_bytes(8, "little"))
        f.truncate(2**40 + 8)
    _fix_size(bad, DATA0)
    err, peak = _peak(lambda: read_everything(bad))
    assert isinstance(err, CorruptDumpError), err
    assert str(err) == f"{path}: safetensors header of {2**40} bytes exceeds the {MAX_HEADER_BYTES}-byte limit"
    assert peak < 1 << 20


def _with_entry(header: dict, key: str, **changes: Any) -> dict:
    return {**header, key: {**header[key], **changes}}


@pytest.mark.parametrize(
    "change,match",
    [
        pytest.param(lambda h, d: (_with_entry(h, L1, data_offsets=[64, 192]), d), "tensors .* overlap", id="overlap"),
        pytest.param(
            lambda h, d: (h, d + b"\0" * 4),
            r"bytes 256\.\.260 of the data section belong to no tensor",
            id="stray-bytes",
        ),
        pytest.param(
            lambda h, d: (_with_entry(h, L1, data_offsets=[128, 300]), d),
            r"data_offsets: expected \[begin, end\]",
            id="past-end",
        ),
        pytest.param(
            lambda h, d: (_with_entry(h, L1, data_offsets=[-128, 0]), d),
            r"data_offsets: expected \[begin, end\]",
            id="negative",
        ),
        pytest.param(
            lambda h, d: (_with_entry(h, L1, data_offsets=[128.0, 256]), d),
            r"data_offsets: expected \[begin, end\]",
            id="float",
        ),
        pytest.param(lambda h, d: (_with_entry(h, L1, dtype="F8_E4M3"), d), r"\.dtype: expected one of", id="dtype"),
        pytest.param(
            lambda h, d: (_with_entry(h, L1, shape=[4, -8]), d),
            r"\.shape: expected a list of integers >= 0",
            id="shape",
        ),
        pytest.param(
            lambda h, d: (_with_entry(h, L1, shape=[4, 4]), d),
            "data_offsets span 128 bytes but F32.4, 4. needs 64",
            id="dtype-x-shape",
        ),
        pytest.param(
            lambda h, d: ({**h, "__metadata__": {"format": 1}}, d),
            "__metadata__: expected an object of strings",
            id="metadata-value",
        ),
        pytest.param(
            lambda h, d: ({**h, "__metadata__": "pt"}, d),
            "__metadata__: expected an object of strings",
            id="metadata-str",
        ),
        pytest.param(
            lambda h, d: (_with_entry(h, L1, extra=1), d),
            "expected an object of dtype, shape and data_offsets",
            id="entry-keys",
        ),
        pytest.param(lambda h, d: (list(h.values()), d), "safetensors header is not a JSON object", id="not-object"),
    ],
)
def test_inconsistent_safetensors_headers_are_corrupt(tmp_path, capsys, small, change, match):
    bad = copy_dump(small, tmp_path / "bad")
    header, data = header_of(bad / DATA0)
    new_header, new_data = change(header, data)
    rewrite_header(bad, DATA0, new_header, new_data)
    with pytest.raises(CorruptDumpError, match=match) as e:
        read_everything(bad)
    assert str(e.value).startswith(str(bad / DATA0))
    rc, err = compare_in_process(capsys, small, bad)
    assert rc == 2, err  # never 1: a corrupt file must not read as a regression
    assert_one_line(err, str(bad / DATA0))


def test_a_duplicate_header_key_is_caught_by_the_tiling(tmp_path, small):
    """JSON keeps the last of two equal keys; the first one's bytes are then left over, so it is caught."""
    bad = copy_dump(small, tmp_path / "bad")
    path = bad / DATA0
    header, data = header_of(path)

    def entry(info: dict) -> str:
        return json.dumps(info, separators=(",", ":"))

    blob = (
        f'{{"{L0}":{entry(header[L0])},"{L1}":{entry(header[L1])},'
        f'"{L0}":{entry({**header[L0], "data_offsets": header[L1]["data_offsets"]})}}}'
    ).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    _fix_size(bad, DATA0)
    with pytest.raises(CorruptDumpError, match="overlap|belong to no tensor"):
        read_everything(bad)


def test_swapped_offsets_are_a_divergence_not_corruption(tmp_path, capsys, small):
    """A well-formed file whose two tensors trade places holds other values: that is a real divergence."""
    swapped = copy_dump(small, tmp_path / "swapped")
    header, data = header_of(swapped / DATA0)
    a, b = header[L0]["data_offsets"], header[L1]["data_offsets"]
    rewrite_header(
        swapped, DATA0, {**header, L0: {**header[L0], "data_offsets": b}, L1: {**header[L1], "data_offsets": a}}
    )
    read_everything(swapped)
    rc, _ = compare_in_process(capsys, small, swapped)
    assert rc == 1


# -- 2. containment ------------------------------------------------------------------------------
@pytest.fixture
def outside(tmp_path, small) -> Path:
    """A sentinel directory beside the dumps holding a valid copy of a data file: reading it would pass."""
    d = tmp_path / "outside"
    d.mkdir()
    shutil.copy(small / DATA0, d / DATA0)
    return d


def _point_file_at(m: dict, name: str) -> None:
    m["files"][name] = m["files"].pop(DATA0)
    for t in m["tensors"]:
        if t["file"] == DATA0:
            t["file"] = name


@pytest.mark.parametrize("how", ["dotdot", "absolute", "subdir"])
def test_paths_leaving_the_dump_are_refused(tmp_path, capsys, small, outside, how):
    name = {"dotdot": f"../../outside/{DATA0}", "absolute": str(outside / DATA0), "subdir": f"sub/{DATA0}"}[how]
    bad = copy_dump(small, tmp_path / "dumps" / "bad", lambda m: _point_file_at(m, name))
    with pytest.raises(CorruptDumpError, match="expected a plain file name inside the dump directory"):
        load_manifest(bad)
    assert dumper_main(["ls", str(bad)]) == 2
    assert_one_line(capsys.readouterr().err, str(bad / MANIFEST_NAME), "plain file name")
    rc, err = compare_in_process(capsys, small, bad)
    assert rc == 2
    assert_one_line(err, str(bad / MANIFEST_NAME))


def test_symlinks_leaving_the_dump_are_refused(tmp_path, small, outside):
    data_link = copy_dump(small, tmp_path / "data_link")
    (data_link / DATA0).unlink()
    (data_link / DATA0).symlink_to(outside / DATA0)
    with pytest.raises(CorruptDumpError, match=f"{DATA0}: symlink to .*outside.*, outside the dump directory"):
        load_manifest(data_link)
    manifest_link = copy_dump(small, tmp_path / "manifest_link")
    shutil.copy(small / MANIFEST_NAME, outside / MANIFEST_NAME)
    (manifest_link / MANIFEST_NAME).unlink()
    (manifest_link / MANIFEST_NAME).symlink_to(outside / MANIFEST_NAME)
    with pytest.raises(CorruptDumpError, match=f"{MANIFEST_NAME}: symlink to .*, outside the dump directory"):
        load_manifest(manifest_link)
    # a DumpReader given a manifest it did not load checks every file it opens as well
    with pytest.raises(CorruptDumpError, match="outside the dump directory"):
        DumpReader(data_link, load_manifest(small)).array(load_manifest(small).tensors[0])


def test_symlinks_inside_the_dump_and_a_symlinked_dump_are_read(tmp_path, small):
    inner = copy_dump(small, tmp_path / "inner")
    (inner / DATA0).rename(inner / "moved.safetensors")
    (inner / DATA0).symlink_to("moved.safetensors")
    read_everything(inner)
    (tmp_path / "alias").symlink_to(inner)
    read_everything(tmp_path / "alias")


def test_non_regular_files_are_never_opened(tmp_path, small):
    """A FIFO named as a data file or as the manifest would block open() forever; a directory would crash."""
    code = (
        "import sys\nfrom dumper.errors import CorruptDumpError\nfrom dumper.format import DumpReader\n"
        "try:\n    r = DumpReader(sys.argv[1])\n    [r.array(t) for t in r.manifest.tensors]\n"
        "except CorruptDumpError as e:\n    print(e)\n"
    )  # a light child: no torch import
    for victim, kind in [(DATA0, "fifo"), (MANIFEST_NAME, "fifo"), (DATA0, "dir")]:
        bad = copy_dump(small, tmp_path / f"{victim}-{kind}")
        (bad / victim).unlink()
        os.mkfifo(bad / victim) if kind == "fifo" else (bad / victim).mkdir()
        r = subprocess.run(
            [sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=60, env=subprocess_env()
        )
        what = "a FIFO" if kind == "fifo" else "a directory"
        assert r.stdout.strip() == f"{bad / victim}: {what}, not a regular file; refusing to open it", r


def test_missing_manifest_is_still_incomplete(tmp_path, small):
    partial = copy_dump(small, tmp_path / "partial")
    (partial / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteDumpError):
        load_manifest(partial)


# -- real CLI runs (subprocesses) on a real tiny-llama dump -----------------------------------------
@pytest.mark.slow
def test_cli_refuses_hostile_paths_with_exit_2(tmp_path, llama):
    root = tmp_path / "dumps"
    (tmp_path / "outside").mkdir()
    shutil.copy(llama / DATA0, tmp_path / "outside" / DATA0)  # a valid copy: following it would pass
    dotdot = copy_dump(llama, root / "dotdot", lambda m: _point_file_at(m, f"../../outside/{DATA0}"))
    absolute = copy_dump(llama, root / "absolute", lambda m: _point_file_at(m, str(tmp_path / "outside" / DATA0)))
    link = copy_dump(llama, root / "link")
    (link / DATA0).unlink()
    (link / DATA0).symlink_to(tmp_path / "outside" / DATA0)
    for bad, needle in [(dotdot, f"{dotdot / MANIFEST_NAME}: files"), (link, f"{link / DATA0}: symlink to")]:
        r = run_cli("comparator", llama, bad, "--quiet")
        assert r.returncode == 2, r.stdout + r.stderr
        assert_one_line(r.stderr, needle)
    r = run_cli("dumper", "ls", absolute)
    assert r.returncode == 2 and r.stdout == ""
    assert_one_line(r.stderr, f"{absolute / MANIFEST_NAME}: files")


@pytest.mark.slow
def test_cli_reports_overlapping_offsets_as_corrupt_not_diverged(tmp_path, llama):
    bad = copy_dump(llama, tmp_path / "bad")
    header, _ = header_of(bad / DATA0)
    keys = sorted(header, key=lambda k: header[k]["data_offsets"])
    first, second = header[keys[0]], header[keys[1]]
    shift = (first["data_offsets"][1] - first["data_offsets"][0]) // 2
    rewrite_header(
        bad,
        DATA0,
        {
            **header,
            keys[1]: {**second, "data_offsets": [second["data_offsets"][0] - shift, second["data_offsets"][1] - shift]},
        },
    )
    r = run_cli("comparator", llama, bad, "--quiet")
    assert r.returncode == 2, r.stdout + r.stderr
    assert_one_line(r.stderr, f"{bad / DATA0}: ")


# -- umask ---------------------------------------------------------------------------------------
def _modes(dump: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in dump.iterdir()}


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_files_are_created_with_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_small_dump(tmp_path / "dump")
        write_json_atomic(tmp_path / "report.json", {"ok": True})
        with atomic_path(tmp_path / "plot.bin") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "dump")
    assert set(modes) == {MANIFEST_NAME, DATA0, "r0-p000001-000.safetensors", "r0-p000002-000.safetensors"}
    assert set(modes.values()) == {mode}, {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "plot.bin").stat().st_mode) == mode


@pytest.mark.slow
def test_cli_dump_is_readable_by_others_under_umask_022(llama):
    modes = _modes(llama)
    assert MANIFEST_NAME in modes and len(modes) >= 2
    assert set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}


# -- the codec and the checker agree --------------------------------------------------------------
def test_checker_knows_every_field_of_the_format(small):
    assert set(RECORD_KEYS) == {f.name for f in fields(TensorRecord)}
    assert set(MANIFEST_KEYS) == {f.name for f in fields(Manifest)}
    raw = json.loads((small / MANIFEST_NAME).read_text())
    assert load_manifest(small) == Manifest.from_json(raw)
    rec = load_manifest(small).tensors[0]
    assert rec == TensorRecord(**{**raw["tensors"][0], "shape": tuple(raw["tensors"][0]["shape"])})
    with pytest.raises(TypeError, match="unknown keys"):
        TensorRecord.from_json({**raw["tensors"][0], "colour": 1})


def test_the_json_memory_budget_can_be_raised_for_a_huge_real_dump(tmp_path, monkeypatch):
    """The budget refuses a manifest before parsing it; DRIFTSCOPE_JSON_MEMORY_MIB lets a user with the memory read
    it."""
    from dumper.errors import UsageError
    from dumper.format.files import json_memory_bound

    src = tmp_path / "d"
    with dumper.capture(None, src, model_name="budget"):
        for i in range(400):
            dumper.dump(f"t{i}", torch.ones(2, 4), layer=i, point="input", positions=[0, 1], sequence_ids=[0, 0])
    need_mib = json_memory_bound((src / MANIFEST_NAME).read_bytes()) / 2**20
    assert 1 < need_mib < 4
    monkeypatch.setenv("DRIFTSCOPE_JSON_MEMORY_MIB", "1")
    with pytest.raises(CorruptDumpError, match="limit 1 MiB; real input this large can raise it with DRIFTSCOPE_JSON"):
        load_manifest(src)
    monkeypatch.setenv("DRIFTSCOPE_JSON_MEMORY_MIB", "4")
    assert len(load_manifest(src).tensors) == 400
    monkeypatch.setenv("DRIFTSCOPE_JSON_MEMORY_MIB", "0")
    with pytest.raises(UsageError, match="DRIFTSCOPE_JSON_MEMORY_MIB"):
        load_manifest(src)


# -- zero-width tensors, lone surrogates --------------------------------------------------------
def _zero_width_dump(src: Path, dst: Path, rows: int) -> Path:
    """A copy of ``src`` whose logits tensor became a complete, consistent F32 ``[rows, 0]`` (a hand edit)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST_NAME).read_text())
    rec = tensor(m, "logits", forward_pass=2)
    header, data = header_of(dst / rec["file"])
    begin, end = header[rec["key"]]["data_offsets"]
    for info in header.values():
        if isinstance(info, dict) and "data_offsets" in info and info["data_offsets"][0] >= end:
            info["data_offsets"] = [o - (end - begin) for o in info["data_offsets"]]
    header[rec["key"]] = {"dtype": "F32", "shape": [rows, 0], "data_offsets": [begin, begin]}
    rewrite_header(dst, rec["file"], header, data[:begin] + data[end:])
    m2 = json.loads((dst / MANIFEST_NAME).read_text())
    tensor(m2, "logits", forward_pass=2).update(shape=[rows, 0], dtype="F32")
    (dst / MANIFEST_NAME).write_text(json.dumps(m2))
    return dst


def test_zero_width_tensors_read_as_rows_of_nothing(tmp_path, small):
    from comparator.hidden.metrics import pair_stats

    dump = _zero_width_dump(small, tmp_path / "zw", rows=3)
    m = load_manifest(dump)
    rec = next(t for t in m.tensors if t.name == "logits")
    rows = DumpReader(dump, m).rows(rec)
    assert rows.shape == (3, 0)
    stats = pair_stats(rows, rows, "F32")
    assert stats.token_rel_diff.shape == (3,) and stats.max_abs_diff == 0.0
    read_everything(dump)


def test_lone_surrogates_in_descriptive_objects_are_corrupt(tmp_path, capsys, small):
    def setter(path: str) -> Callable[[dict], None]:
        def edit(m: dict) -> None:
            *parents, last = path.split(".")
            d = m
            for p in parents:
                d = d.setdefault(p, {})
            d[last] = "\ud800"

        return edit

    cases = {
        "model.foo": setter("model.foo"),
        "capture_signature.x": setter("capture_signature.x"),
        "extra.prompts.a": setter("extra.prompts.a"),
        "environment key": lambda m: m["environment"].update({"\udfff": 1}),
        "extra.p[1]": lambda m: m["extra"].update(p=["ok", "\ud800"]),
        "tensors[0].meta.k": lambda m: m["tensors"][0].update(meta={"k": "\ud800"}),
    }
    for field, edit in cases.items():
        bad = copy_dump(small, tmp_path / f"d{len(os.listdir(tmp_path))}", edit)
        with pytest.raises(CorruptDumpError, match=re.escape(field)):
            load_manifest(bad)
        rc = compare_main([str(small), str(bad), "--quiet", "--html", str(tmp_path / "r.html")])
        assert rc == 2, field
        assert_one_line(capsys.readouterr().err, str(bad / MANIFEST_NAME), field)
