"""Describing a dump: the facts :func:`describe` gives, and that ``dumper ls`` and ``store show`` print the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import dumper
from dumper.format import MANIFEST_NAME, load_manifest, write_json_atomic
from dumper.format.describe import describe, describe_lines
from tests.conftest import run_cli


def _dump(out: Path, *, model_name: str = "described") -> Path:
    """Two passes: layers 0 and 3 in pass 0; layer 3 and a layer-less tensor in pass 1."""
    with dumper.capture(None, out, model_name=model_name, shard_bytes=1 << 10):
        dumper.dump("model.layers.0.self_attn.input", torch.ones(5, 8), layer=0, positions=range(5))
        dumper.dump("model.layers.3.self_attn.input", torch.ones(5, 8).half(), layer=3, positions=range(5))
        dumper.step()
        dumper.dump("model.layers.3.self_attn.input", torch.ones(2, 8), layer=3, positions=range(5, 7))
        dumper.dump("logits", torch.ones(2, 4))
    return out


def test_describe_counts_what_is_on_disk(tmp_path: Path) -> None:
    out = _dump(tmp_path / "d")
    m = load_manifest(out)
    facts = dict(describe(m))
    data = [n for n in os.listdir(out) if n != MANIFEST_NAME]
    size = sum((out / n).stat().st_size for n in data)
    assert facts["dump"].startswith(f"4 tensors in {len(data)} files ({size / 2**20:.1f} MiB), format 1, created ")
    assert facts["layers"] == "[0, 3]" and facts["forward passes"] == "2" and facts["ranks"] == "[0]"
    assert facts["names"] == "logits (x1), model.layers.0.self_attn.input (x1), model.layers.3.self_attn.input (x2)"
    assert "'name': 'described'" in facts["model"]
    lines = list(describe_lines(m, tensors=True))
    assert lines[: len(facts)] == [f"{k}: {v}" for k, v in describe(m)]
    tensor_lines = lines[len(facts) :]
    assert len(tensor_lines) == 4 and "layer=3 F16[5, 8] tokens 0..4" in tensor_lines[1]
    assert "layer=None F32[2, 4] no positions" in tensor_lines[3]


def test_control_characters_from_a_manifest_never_reach_the_terminal(tmp_path: Path) -> None:
    out = _dump(tmp_path / "d", model_name="evil\x1b[2J")
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["created_at"] = "2026\x1b]0;pwned\x07"
    write_json_atomic(out / MANIFEST_NAME, m)
    for line in describe_lines(load_manifest(out), tensors=True):
        assert line.isprintable(), line
    assert "evil\\x1b[2J" in dict(describe(load_manifest(out)))["model"]


@pytest.mark.slow
def test_dumper_ls_and_store_show_print_the_same_description(tmp_path: Path) -> None:
    out = _dump(tmp_path / "d")
    store = tmp_path / "store"
    r = run_cli("comparator", "regress", out, "--store", store, "--bootstrap", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    (run_id,) = os.listdir(store / "runs")
    ls = run_cli("dumper", "ls", out)
    show = run_cli("comparator", "store", "show", store, run_id)
    assert ls.returncode == 0 and show.returncode == 0, ls.stderr + show.stderr
    described = ls.stdout.splitlines()
    assert described[0].startswith("dump: 4 tensors") and len(described) == len(describe(load_manifest(out)))
    shown = show.stdout.splitlines()
    start = shown.index(described[0])
    assert shown[start : start + len(described)] == described  # line for line, however wide
    assert shown[start + len(described)].startswith("calibration: ")

    # a stored manifest edited by hand: the record is still shown, the dump is one UNUSABLE line and a warning
    stored = store / "runs" / run_id / "dump" / MANIFEST_NAME
    m = json.loads(stored.read_text())
    m["tensors"][0]["dtype"] = "F8"
    stored.write_text(json.dumps(m))
    show = run_cli("comparator", "store", "show", store, run_id)
    assert show.returncode == 0, show.stderr
    assert f'"run_id": "{run_id}"' in show.stdout and "calibration: " in show.stdout
    bad = [line for line in show.stdout.splitlines() if line.startswith("dump: ")]
    assert len(bad) == 1 and bad[0].startswith("dump: UNUSABLE (") and "tensors[0].dtype" in bad[0]
    assert show.stderr.startswith("warning: ") and "tensors[0].dtype" in show.stderr and "Traceback" not in show.stderr
