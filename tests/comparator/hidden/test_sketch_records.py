"""Hostile sketch dumps (issue 32): norms, widths and a manifest's sketch claim checked where they are read.

The dumps are a real Llama's (hidden 64, 2 layers) captured with and without ``sketch``; the
damage is made the way a broken writer or a hand edit would: norms overwritten in place (the file
keeps its size), a manifest's fields edited. A negative norm or a width that the model or the
other side contradicts is exit 2 in one line; a NaN or Inf norm is no input error (a hidden state
that held one has one) and fails its row, never passes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dumper
from comparator import compare_dumps
from dumper.errors import CorruptDumpError, NotComparableError
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.format.sketch import NORM_SUFFIX
from tests.conftest import run_cli
from tests.fuzzing import edit_stored

HIDDEN, K, TOKENS = 64, 16, 12


def _llama(hidden: int = HIDDEN) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sketch-records")
    ids = torch.randint(3, 128, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, sketch in (("full", None), ("sketch", K)):
        model = _llama()
        with torch.inference_mode(), dumper.capture(model, root / name, layers="all", sketch=sketch):
            model(input_ids=ids)
        out[name] = root / name
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_norm(dump: Path, row: int, value: float) -> str:
    """Overwrite row ``row`` of the first sketched record's norms with ``value``; returns the record's name."""
    rec = next(r for r in load_manifest(dump).tensors if r.sketch is not None)

    def put(norms: np.ndarray) -> None:
        norms[row] = value

    edit_stored(dump / rec.file, rec.key + NORM_SUFFIX, np.float64, put)
    return rec.name


def _edit_manifest(dump: Path, edit) -> None:
    m = json.loads((dump / MANIFEST_NAME).read_text())
    edit(m)
    (dump / MANIFEST_NAME).write_text(json.dumps(m))


def _one_line(r, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.mark.parametrize("side", ["baseline", "target"])
def test_a_negative_norm_is_refused_naming_file_key_and_row(dumps, tmp_path, side):
    bad = _copy(dumps["sketch"], tmp_path / "bad")
    _edit_norm(bad, 5, -1.0)
    pair = (bad, dumps["full"]) if side == "baseline" else (dumps["full"], bad)
    _one_line(run_cli("comparator", *pair, "--quiet"), str(bad), NORM_SUFFIX, "row 5", "-1.0", ">= 0")


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("side", ["baseline", "target"])
def test_a_nan_or_inf_norm_fails_its_row_never_passes(dumps, tmp_path, side, value):
    clean = compare_dumps(dumps["full"], dumps["sketch"])
    assert clean.passed  # the same forward, one side sketched
    bad = _copy(dumps["sketch"], tmp_path / "bad")
    name = _edit_norm(bad, 7, value)
    report = compare_dumps(*((bad, dumps["full"]) if side == "baseline" else (dumps["full"], bad)))
    failed = [t for t in report.tensors if not t.passed]
    assert not report.passed and [t.name for t in failed] == [name], [t.name for t in failed]
    assert failed[0].first_failing_token == 7 and failed[0].failing_tokens == 1
    assert math.isinf(failed[0].metrics["rel_diff"])
    r = run_cli("comparator", dumps["full"], bad, "--quiet")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_sketch_width_the_model_contradicts_is_refused(dumps, tmp_path):
    bad = _copy(dumps["sketch"], tmp_path / "bad")
    _edit_manifest(bad, lambda m: next(t for t in m["tensors"] if t.get("sketch"))["sketch"].update(hidden=48))
    line = _one_line(
        run_cli("comparator", dumps["full"], bad, "--quiet"), "sketch.hidden: 48", f"hidden_size is {HIDDEN}"
    )
    assert str(bad) in line


def test_a_full_dump_claiming_a_sketch_is_refused(dumps, tmp_path):
    bad = _copy(dumps["full"], tmp_path / "bad")
    _edit_manifest(bad, lambda m: m["capture_signature"].update(sketch={"kind": "rademacher", "k": K, "seed": 0}))
    with pytest.raises(CorruptDumpError, match="a full input record .* under capture_signature.sketch"):
        load_manifest(bad)
    _one_line(run_cli("comparator", dumps["sketch"], bad, "--quiet"), str(bad), "under capture_signature.sketch")


def test_rows_of_another_width_than_the_sketch_says_are_refused(dumps, tmp_path):
    """A full side whose rows are 48 wide against a sketch of 64-wide rows (no model named: explicit records)."""
    gen = torch.Generator().manual_seed(0)
    paths = {}
    for name, width, sketch in (("wide", HIDDEN, K), ("narrow", 48, None)):
        with dumper.capture(None, tmp_path / name, sketch=sketch) as cap:
            cap.record(
                "model.layers.0.input",
                torch.randn(TOKENS, width, generator=gen),
                layer=0,
                point="input",
                positions=range(TOKENS),
                sequence_ids=[0] * TOKENS,
            )
            cap.step()
        paths[name] = tmp_path / name
    with pytest.raises(NotComparableError, match="rows are 48 wide .full. but the baseline .* are 64 .sketched."):
        compare_dumps(paths["wide"], paths["narrow"])
    _one_line(run_cli("comparator", paths["wide"], paths["narrow"], "--quiet"), "48 wide", "64")
