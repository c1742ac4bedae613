"""The on-disk format: golden bytes, run-length metadata, and every way a dump can be broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dumper
from dumper.errors import CorruptDumpError, IncompleteDumpError
from dumper.format import (
    MANIFEST_NAME,
    decode_runs,
    encode_runs,
    load_manifest,
    open_tensor,
    to_float64,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "format_v1"
VOLATILE = ("created_at", "environment")


def _write_golden_dump(out: Path) -> None:
    """The fixed content pinned by tests/golden/format_v1 (regenerate only on a format change)."""
    with dumper.capture(None, out, model_name="golden", extra={"purpose": "golden"}):
        dumper.dump(
            "model.layers.0.self_attn.input",
            torch.arange(24, dtype=torch.float32).reshape(1, 4, 6) / 8,
            layer=0,
            point="input",
            positions=[0, 1, 2, 3],
            sequence_ids=[0, 0, 0, 0],
        )
        dumper.dump(
            "model.layers.1.self_attn.input",
            (torch.arange(12, dtype=torch.float32) - 6).reshape(2, 6).to(torch.bfloat16),
            layer=1,
            point="input",
            positions=[5, 6],
            sequence_ids=[1, 1],
        )
        dumper.step()
        dumper.dump("logits", torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float16), meta_key="v")


def _normalized(manifest_path: Path) -> dict:
    d = json.loads(manifest_path.read_text())
    for k in VOLATILE:
        d.pop(k)
    return d


def test_golden_format_is_pinned(tmp_path):
    out = tmp_path / "dump"
    _write_golden_dump(out)
    assert _normalized(out / MANIFEST_NAME) == _normalized(GOLDEN / MANIFEST_NAME)
    golden_files = sorted(p.name for p in GOLDEN.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == golden_files
    for name in golden_files:
        assert (out / name).read_bytes() == (GOLDEN / name).read_bytes(), name


def test_golden_dump_reads_back():
    m = load_manifest(GOLDEN)
    assert m.format_version == 1 and m.model["name"] == "golden"
    t0, t1, t2 = m.tensors
    assert (t0.layer, t0.forward_pass, t0.row_positions().tolist()) == (0, 0, [0, 1, 2, 3])
    np.testing.assert_array_equal(open_tensor(GOLDEN, t0), np.arange(24, dtype=np.float32).reshape(1, 4, 6) / 8)
    np.testing.assert_array_equal(to_float64(open_tensor(GOLDEN, t1), "BF16"), np.arange(12).reshape(2, 6) - 6)
    assert t1.row_positions().tolist() == [5, 6] and t1.row_sequence_ids().tolist() == [1, 1]
    assert (t2.name, t2.forward_pass, t2.dtype, t2.meta) == ("logits", 1, "F16", {"meta_key": "v"})


@given(st.lists(st.integers(-5, 5000), max_size=50), st.sampled_from([0, 1]))
def test_run_length_encoding_round_trips(values, step):
    assert decode_runs(encode_runs(values, step=step), step=step).tolist() == values


def test_contiguous_positions_encode_compactly():
    assert encode_runs(range(2048), step=1) == [[0, 2048]]
    assert encode_runs([0, 1, 2, 10, 11, 0, 1], step=1) == [[0, 3], [10, 2], [0, 2]]
    assert encode_runs([4] * 7 + [5] * 2, step=0) == [[4, 7], [5, 2]]


@pytest.fixture
def dump_copy(tmp_path):
    out = tmp_path / "dump"
    shutil.copytree(GOLDEN, out)
    return out


def test_missing_manifest_is_incomplete(dump_copy):
    (dump_copy / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteDumpError, match="incomplete dump"):
        load_manifest(dump_copy)


def test_truncated_data_file_names_the_file(dump_copy):
    f = next(dump_copy.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 10])
    with pytest.raises(CorruptDumpError, match=f"{f.name}: truncated"):
        load_manifest(dump_copy)


def test_missing_data_file_names_the_file(dump_copy):
    f = next(dump_copy.glob("*.safetensors"))
    f.unlink()
    with pytest.raises(CorruptDumpError, match=f"{f.name}: data file listed in the manifest is missing"):
        load_manifest(dump_copy)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "unreadable manifest"),
        ('{"format_version": 99}', "format version 99 is not supported"),
        ('{"format_version": 1}', "malformed manifest"),
        ("[]", "format version None"),
    ],
)
def test_bad_manifest(dump_copy, content, match):
    (dump_copy / MANIFEST_NAME).write_text(content)
    with pytest.raises(CorruptDumpError, match=match):
        load_manifest(dump_copy)


def test_garbage_header_of_right_size_is_corrupt(dump_copy):
    f = sorted(dump_copy.glob("*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[8:20] = b"#" * 12  # same size, broken JSON header
    f.write_bytes(bytes(data))
    m = load_manifest(dump_copy)
    with pytest.raises(CorruptDumpError, match=f.name):
        open_tensor(dump_copy, m.tensors[0])


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_fuzzed_dumps_fail_cleanly(tmp_path_factory, data):
    """Any byte-level damage to a dump is either harmless or a DriftscopeError, never a crash."""
    from comparator import compare_dumps
    from dumper.errors import DriftscopeError

    out = tmp_path_factory.mktemp("fuzz") / "dump"
    shutil.copytree(GOLDEN, out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    victim = data.draw(st.sampled_from(files))
    raw = bytearray(victim.read_bytes())
    action = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if action == "truncate":
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    elif action == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    else:
        raw += bytes(data.draw(st.binary(min_size=1, max_size=16)))
    victim.write_bytes(bytes(raw))
    try:
        m = load_manifest(out)
        for rec in m.tensors:
            open_tensor(out, rec)
        compare_dumps(GOLDEN, out)
    except DriftscopeError:
        pass
