"""Row noise: each calibrated row judged against its own benign noise, on real dumps of the tiny preset.

The benign variants add seeded noise to the output of decoder layer 1 (so layer 2's input carries
it), small on every row but one outlier row, as trained models' massive-activation rows are: the
pooled per-token noise of each tensor is then the outlier's, about 900x every other row's. A
one-token bug 100x its row's noise hides under the pooled threshold and is named by row noise,
at its layer and token; a benign variant outside the calibration passes both ways. Rows whose
token ids the calibration did not run are judged by the pooled rule, and the verdict counts each.
The side file is untrusted input: every damage is one line naming it, exit 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load, save

from comparator import CompareConfig, compare_dumps
from comparator.cli.main import main as compare_main
from comparator.noise.calibrate import calibrate
from comparator.noise.file import load_noise, save_noise
from dumper.prefill.run import RunConfig, dump_sequences
from dumper.prompts import BUILTIN_PROMPTS
from tests.conftest import forward_hook, tiny_llama
from tests.fuzzing import check_outcome, run_main

pytestmark = pytest.mark.slow

LAYER, OUTLIER, BUG_TOKEN = 1, 3, 25
"""The noisy decoder layer (its output is layer 2's input), the outlier row, the bug's token."""
SMALL, LARGE, BUG = 1e-3, 3e-2, 1e-2
"""Relative sizes (to each row's RMS) of the benign noise, the outlier row's, and the bug."""


def _dump(out: Path, seed: int | None, *, bug: bool = False, **run: object) -> Path:
    """The built-in prompts through tiny-llama, layer ``LAYER``'s output perturbed by seeded benign noise."""
    model, tok = tiny_llama(attn=str(run.get("attn", "eager")))
    gen = torch.Generator().manual_seed(seed or 0)

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # [1, seq, hidden]
        rms = hidden.pow(2).mean(-1, keepdim=True).sqrt()
        scale = torch.full((1, hidden.shape[1], 1), SMALL)
        scale[0, OUTLIER] = LARGE
        noise = torch.randn(hidden.shape, generator=gen) * scale
        if bug:
            noise[0, BUG_TOKEN] += BUG * torch.randn(hidden.shape[-1], generator=gen)
        hidden.add_(noise * rms)
        return output

    with forward_hook(model.model.layers[LAYER] if seed is not None else None, hook):
        dump_sequences(model, [tok.encode(p) for p in BUILTIN_PROMPTS], RunConfig(out=str(out), layers="all", **run))  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("row-noise")
    base = _dump(root / "base", None)
    variants = [_dump(root / f"v{s}", s) for s in (1, 2, 3)]
    noise = calibrate(base, variants)
    save_noise(noise, root / "NOISE.json")
    return {
        "root": root,
        "base": base,
        "benign": _dump(root / "benign", 7),
        "bug": _dump(root / "bug", 8, bug=True),
        "noise": load_noise(root / "NOISE.json"),
    }


def _judge(world, target: str, noise) -> object:
    return compare_dumps(world["base"], world[target], CompareConfig(noise=noise))


def test_the_outlier_row_sets_the_pooled_noise_and_rows_keep_their_own(world):
    noise = world["noise"]
    name = f"model.layers.{LAYER + 1}.self_attn.input"
    rows = noise.rows.tensors[name]
    seq, pos = rows.keys >> 32, rows.keys & 0xFFFFFFFF
    outlier = rows.values[(seq == 0) & (pos == OUTLIER)][0]
    others = rows.values[(seq == 0) & (pos != OUTLIER)]
    assert outlier > 100 * np.median(others)  # the case: one row's benign noise far above the rest
    assert noise.tensors[name].token_max == pytest.approx(float(rows.values.max()), rel=1e-6)
    assert rows.floor == pytest.approx(float(np.median(rows.values)))
    assert noise.rows.prompts[0] == tuple(tiny_llama()[1].encode(BUILTIN_PROMPTS[0]))


def test_a_one_token_bug_under_the_pooled_noise_is_named_by_row_noise(world):
    pooled = _judge(world, "bug", dataclasses.replace(world["noise"], rows=None))
    assert pooled.passed  # the miss row noise exists for: 100x its row's noise, under the outlier's
    report = _judge(world, "bug", world["noise"])
    fd = report.first_divergent
    assert not report.passed and fd.layer == LAYER + 1 and fd.token == BUG_TOKEN and fd.onset == BUG_TOKEN
    assert fd.onset_layer == LAYER + 1 and fd.sequence == 0
    failing = [t for t in report.tensors if not t.passed]
    assert {t.layer for t in failing} == set(range(LAYER + 1, 8)) and all(
        t.failing_ranges[0][0] == BUG_TOKEN for t in failing
    )
    t = next(t for t in report.tensors if t.layer == LAYER + 1 and t.sequence == 0)
    assert t.token_noise_ratio > 3 * 10  # in units of its own row's noise


def test_a_benign_variant_outside_the_calibration_passes_both_ways(world):
    for noise in (world["noise"], dataclasses.replace(world["noise"], rows=None)):
        report = _judge(world, "benign", noise)
        assert report.passed, [(t.name, t.token_noise_ratio) for t in report.tensors if not t.passed]


def test_the_verdict_counts_the_rows_each_rule_judged(world):
    report = _judge(world, "benign", world["noise"])
    total = sum(t.shape[0] for t in report.tensors)
    assert all(t.own_noise_rows == t.shape[0] for t in report.tensors)
    assert f"row noise: {total} of {total} rows judged against their own calibrated noise" in " ".join(report.notes)


def test_rows_past_a_token_the_calibration_did_not_run_are_judged_by_the_pooled_rule(world):
    noise = world["noise"]
    cut = 10  # the calibration's prompt 0 differs from the baseline's at position 10: those rows are another text
    prompts = list(noise.rows.prompts)
    prompts[0] = (*prompts[0][:cut], prompts[0][cut] + 1, *prompts[0][cut + 1 :])
    other = dataclasses.replace(noise, rows=dataclasses.replace(noise.rows, prompts=tuple(prompts)))
    report = _judge(world, "bug", other)
    failing = {t.sequence for t in report.tensors if not t.passed}
    assert failing == {1}  # prompt 0's bug row is past the cut: pooled, and missed as before; prompt 1's is named
    for t in report.tensors:
        assert t.own_noise_rows == (cut if t.sequence == 0 else t.shape[0])
    seq0 = sum(t.shape[0] - cut for t in report.tensors if t.sequence == 0)
    assert f"{seq0} against the tensor's pooled noise" in " ".join(report.notes)


def test_the_noise_file_and_its_side_file_round_trip(world, tmp_path):
    save_noise(world["noise"], tmp_path / "again.json")
    assert sorted(os.listdir(tmp_path)) == ["again.json", "again.rows.safetensors"]
    assert load_noise(tmp_path / "again.json") == world["noise"]
    ref = json.loads((tmp_path / "again.json").read_text())["rows"]
    data = (tmp_path / "again.rows.safetensors").read_bytes()
    assert ref["file"] == "again.rows.safetensors" and ref["sha256"] == hashlib.sha256(data).hexdigest()
    rows = world["noise"].rows
    values = sum(r.values.size for r in rows.tensors.values())
    tables = {k: rows.tensors[n].keys.size for n, k in rows.tables.items()}
    assert len(tables) == 1  # every tensor covers the same rows: one table
    ids = sum(len(p) for p in rows.prompts)
    assert len(data) <= 4 * values + 16 * sum(tables.values()) + 8 * ids + 4096  # 4 bytes a row and tensor


def _rewrite(world, tmp_path: Path, edit) -> Path:
    """A copy of NOISE.json whose side file ``edit(arrays)`` changed, the JSON's SHA-256 made to match it."""
    src = world["root"]
    arrays = {k: v.copy() for k, v in load((src / "NOISE.rows.safetensors").read_bytes()).items()}
    edit(arrays)
    data = save(arrays)
    (tmp_path / "NOISE.rows.safetensors").write_bytes(data)
    d = json.loads((src / "NOISE.json").read_text())
    d["rows"]["sha256"] = hashlib.sha256(data).hexdigest()
    (tmp_path / "NOISE.json").write_text(json.dumps(d))
    return tmp_path / "NOISE.json"


def _first_noise(arrays: dict[str, np.ndarray]) -> str:
    return next(k for k in arrays if k.startswith("noise."))


def _set(arrays, key, value) -> None:
    arrays[key] = value


HOSTILE = {
    "nan": lambda a: a[_first_noise(a)].__setitem__(0, np.nan),
    "negative": lambda a: a[_first_noise(a)].__setitem__(1, -1e-6),
    "over 2": lambda a: a[_first_noise(a)].__setitem__(2, 3.0),
    "short": lambda a: _set(a, _first_noise(a), a[_first_noise(a)][:-1].copy()),
    "float64": lambda a: _set(a, _first_noise(a), a[_first_noise(a)].astype(np.float64)),
    "rows shape": lambda a: _set(a, "rows.0", a["rows.0"][:, :1].copy()),
    "rows unsorted": lambda a: _set(a, "rows.0", a["rows.0"][::-1].copy()),
    "row past its prompt": lambda a: a["rows.0"].__setitem__((-1, 1), 10_000),
    "missing tensor": lambda a: a.pop(_first_noise(a)),
    "unknown key": lambda a: _set(a, "extra", np.zeros(1, np.float32)),
    "negative token id": lambda a: a["ids.0"].__setitem__(0, -5),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_damaged_side_file_is_one_line_naming_it(world, tmp_path, case):
    noise = _rewrite(world, tmp_path, HOSTILE[case])
    o = run_main(compare_main, [world["base"], world["benign"], "--noise", noise, "--quiet"])
    assert check_outcome(o, outside=world["root"] / "v1") == 2, o.err
    assert str(tmp_path / "NOISE.rows.safetensors") in o.err, o.err


def test_a_side_file_of_another_calibration_truncated_missing_or_outside_is_refused(world, tmp_path):
    src = world["root"]
    other = calibrate(world["base"], [src / "v1"])  # another calibration: its rows, its hash
    save_noise(other, tmp_path / "OTHER.json")
    cases = {
        "another calibration": lambda p: shutil.copy(tmp_path / "OTHER.rows.safetensors", p),
        "truncated": lambda p: p.write_bytes((src / "NOISE.rows.safetensors").read_bytes()[:100]),
        "missing": lambda p: None,
        "symlink outside": lambda p: p.symlink_to(src / "NOISE.rows.safetensors"),
    }
    for label, make in cases.items():
        case = tmp_path / label.replace(" ", "-")
        case.mkdir()
        shutil.copy(src / "NOISE.json", case / "NOISE.json")
        make(case / "NOISE.rows.safetensors")
        o = run_main(compare_main, [world["base"], world["benign"], "--noise", case / "NOISE.json", "--quiet"])
        assert check_outcome(o) == 2, (label, o.err)
        assert str(case / "NOISE.rows.safetensors") in o.err, (label, o.err)


def test_the_calibration_holds_each_variant_out_against_the_others(world):
    held = world["noise"].rows.holdout
    assert held is not None and held.variant in (0, 1, 2)
    # three draws of the same seeded noise: a held-out one stays near the others' rows (chi-square spread of 64 values)
    assert 1.0 < held.ratio < 3.0 and world["noise"].holdout_warning(3.0) is None
    assert "reaches" in world["noise"].holdout_warning(held.ratio / 2)
    single = calibrate(world["base"], [world["root"] / "v1"])
    assert single.rows.holdout is None  # one variant: nothing to hold out


def test_a_damaged_holdout_record_is_one_line(world, tmp_path):
    d = json.loads((world["root"] / "NOISE.json").read_text())
    for field, value in (("tensor", "model.layers.99.self_attn.input"), ("variant", 3), ("ratio", -1.0)):
        case = tmp_path / field
        case.mkdir()
        shutil.copy(world["root"] / "NOISE.rows.safetensors", case)
        bad = json.loads(json.dumps(d))
        bad["rows"]["holdout"][field] = value
        (case / "NOISE.json").write_text(json.dumps(bad))
        o = run_main(compare_main, [world["base"], world["benign"], "--noise", case / "NOISE.json", "--quiet"])
        assert check_outcome(o) == 2 and "rows.holdout" in o.err, (field, o.err)


def test_the_calibration_records_each_runs_layout(world, tmp_path):
    layouts = world["noise"].layouts
    assert len(layouts) == 4 and all(x == layouts[0] for x in layouts)  # the baseline's and three variants'
    assert layouts[0]["engine"] == "transformers" and layouts[0]["chunk_size"] is None
    save_noise(world["noise"], tmp_path / "again.json")
    assert load_noise(tmp_path / "again.json").layouts == layouts


def test_rows_failing_on_a_layout_the_calibration_did_not_run_say_so(world):
    chunked = _dump(world["root"] / "bug-chunked", 8, bug=True, attn="sdpa")
    notes = {}
    for name, target in (("same layout", world["bug"]), ("chunked", chunked)):
        report = compare_dumps(world["base"], target, CompareConfig(noise=world["noise"]))
        assert not report.passed and report.first_divergent.token == BUG_TOKEN
        notes[name] = [n for n in report.notes if "layout is none the calibration ran" in n]
    assert notes["same layout"] == [] and len(notes["chunked"]) == 1
    assert "(attn=sdpa against the baseline)" in notes["chunked"][0]
    passing = compare_dumps(
        world["base"], _dump(world["root"] / "benign-chunked", 7, attn="sdpa"), CompareConfig(noise=world["noise"])
    )
    assert passing.passed and not any("layout" in n for n in passing.notes)  # said only of failing rows


@pytest.mark.parametrize("value", [[{"engine": "transformers"}], "x", [{"a": [1]}] * 4, [{"a": {"b": 1}}] * 4])
def test_a_damaged_layouts_record_is_one_line(world, tmp_path, value):
    d = json.loads((world["root"] / "NOISE.json").read_text())
    shutil.copy(world["root"] / "NOISE.rows.safetensors", tmp_path)
    d["layouts"] = value
    (tmp_path / "NOISE.json").write_text(json.dumps(d))
    o = run_main(compare_main, [world["base"], world["benign"], "--noise", tmp_path / "NOISE.json", "--quiet"])
    assert check_outcome(o) == 2 and "layouts" in o.err and str(tmp_path / "NOISE.json") in o.err, o.err
