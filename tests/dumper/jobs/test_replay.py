"""``python -m dumper replay``: each layer run on the baseline's own residual input gives its local error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dumper
from dumper.errors import ModelMismatchError, NotComparableError, UsageError
from dumper.format import PAD_SEQUENCE, DumpReader, to_float64
from dumper.jobs.replay import ReplayConfig, replay, replay_model
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import run_cli, tiny_llama

TEXT = "Inference engines change daily; each change can shift numerics without an error. " * 2
POINTS = ("input", "residual")


def _seqs(tok) -> list[list[int]]:
    return [tok.encode(TEXT)[:48], tok.encode(TEXT[7:])[:40]]


def _rows(directory) -> dict[int, dict[tuple[int, int], np.ndarray]]:
    """layer -> {(sequence, position): row} of a dump's residual point (padding rows left out), as float64."""
    reader = DumpReader(directory)
    out: dict[int, dict[tuple[int, int], np.ndarray]] = {}
    for rec in reader.manifest.tensors:
        if rec.point == "residual":
            rows = to_float64(reader.rows(rec), rec.dtype)
            for row, pos, seq in zip(rows, rec.row_positions(), rec.row_sequence_ids(), strict=True):
                if seq != PAD_SEQUENCE:
                    out.setdefault(rec.layer, {})[(int(seq), int(pos))] = row
    return out


def _by_layer(report_json) -> dict[int, float]:
    """layer -> largest rel_diff over the sequences of the residual tensors in a comparator JSON report."""
    out: dict[int, float] = {}
    for t in json.loads(report_json.read_text())["tensors"]:
        if t["name"].endswith(".residual"):
            out[t["layer"]] = max(out.get(t["layer"], 0.0), float(t["rel_diff"]))
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A baseline dump; a checkpoint with a strong bug in layer 2, a mild one in layer 1; its dump and its replay."""
    root = tmp_path_factory.mktemp("replay")
    model, tok = tiny_llama()
    dump_sequences(model, _seqs(tok), RunConfig(out=str(root / "base"), layers="all", points=POINTS))
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(1.05)
        model.model.layers[1].mlp.down_proj.weight.mul_(1 + 1e-3)
    model.save_pretrained(root / "ckpt")
    dump_sequences(model, _seqs(tok), RunConfig(out=str(root / "bugged"), layers="all", points=POINTS))
    r = run_cli("dumper", "replay", "--model", root / "ckpt", "--baseline", root / "base", "--out", root / "replay")
    assert r.returncode == 0, r.stderr
    for name in ("bugged", "replay"):  # thresholds far below the bugs (rel_diff 1e-8 and 1.5e-5), far above 0
        c = run_cli(
            "comparator",
            root / "base",
            root / name,
            "--json",
            root / f"{name}.json",
            "--threshold",
            "1e-6",
            "--token-threshold",
            "1e-6",
        )
        assert c.returncode == 1, c.stdout + c.stderr
    return root


@pytest.mark.parametrize(
    ("dtype", "attn", "layout"),
    [("float32", "eager", {}), ("bfloat16", "sdpa", {}), ("float32", "sdpa", {"chunk_size": 16, "batch_size": 2})],
)
def test_replaying_the_baseline_model_reproduces_its_own_forward(tmp_path, dtype, attn, layout):
    model, tok = tiny_llama(attn=attn, dtype=dtype)
    dump_sequences(
        model,
        _seqs(tok),
        RunConfig(out=str(tmp_path / "base"), layers="all", points=("residual",), dtype=dtype, attn=attn, **layout),
    )
    m = replay_model(model, tmp_path / "base", tmp_path / "replay", dtype=dtype, attn=attn)
    assert m.extra["replay"]["layers"] == list(range(8))
    base, rep = _rows(tmp_path / "base"), _rows(tmp_path / "replay")
    assert sorted(rep) == list(range(1, 9)) and {r.dtype for r in m.tensors} == {
        "F32" if dtype == "float32" else "BF16"
    }
    for layer, rows in rep.items():
        assert rows.keys() == base[layer].keys()
        x, y = np.stack([rows[k] for k in sorted(rows)]), np.stack([base[layer][k] for k in sorted(rows)])
        if layout:  # chunks and padding change the summation order: fp32 rounding, not exactness
            assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-6, layer
        else:
            assert np.array_equal(x, y), layer  # one prefill per sequence, as the baseline ran it: bit for bit


@pytest.mark.slow
def test_replay_localizes_a_bug_to_its_layer_when_a_milder_one_comes_before(case):
    normal, local = _by_layer(case / "bugged.json"), _by_layer(case / "replay.json")
    # the plain comparison: layer 2's input already differs, inherited from layer 1's mild bug,
    # and every layer after layer 2 inherits its error
    assert normal[0] == normal[1] == 0.0 and normal[2] > 1e-9
    assert all(normal[k] > 1e-6 for k in range(3, 9))
    # replay: each layer's own error, one layer up; layer 2 introduces >100x what layer 1 does
    assert sorted(local) == list(range(1, 9))
    assert local[2] > 1e-9 and local[3] > 100 * local[2] and local[3] > 1e-6
    assert all(local[k] == 0.0 for k in (1, 4, 5, 6, 7, 8))  # bug-free layers on the baseline's input: exact
    report = json.loads((case / "replay.json").read_text())
    assert report["first_divergent"]["layer"] == 3 and any("replay" in n for n in report["notes"])
    assert [t["layer"] for t in report["tensors"] if not t["passed"]] == [3, 3]  # one per sequence, nothing else


@pytest.mark.slow
def test_replay_refuses_a_baseline_without_the_residual_point(case, tmp_path):
    model, tok = tiny_llama()
    with torch.inference_mode(), dumper.capture(model, tmp_path / "plain", layers="all"):
        model(torch.tensor([_seqs(tok)[1]]))
    r = run_cli("dumper", "replay", "--model", case / "ckpt", "--baseline", tmp_path / "plain", "--out", tmp_path / "o")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(tmp_path / "plain") in r.stderr and "--points input,residual" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_replay_refuses_another_model(case, tmp_path):
    with pytest.raises(ModelMismatchError, match="the baseline's model has num_layers 8, tiny-qwen2 has 6"):
        replay(ReplayConfig(model="tiny-qwen2", baseline=str(case / "base"), out=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_replay_refuses_rows_that_are_not_a_whole_prefill(tmp_path):
    model, tok = tiny_llama()
    ids = torch.tensor([_seqs(tok)[1]])
    with torch.inference_mode(), dumper.capture(model, tmp_path / "late", layers="all", points="residual"):
        model(input_ids=ids, position_ids=torch.arange(5, 5 + ids.shape[1])[None])
    with pytest.raises(NotComparableError, match=r"positions 5\.\.44 of sequence 0, not one prefill 0\.\.39"):
        replay_model(model, tmp_path / "late", tmp_path / "o")
    with torch.inference_mode(), dumper.capture(model, tmp_path / "gaps", layers="0,2", points="residual"):
        model(ids)
    with pytest.raises(UsageError, match=r"no layer has both its residual input and the next one's \(\[0, 2\]\)"):
        replay_model(model, tmp_path / "gaps", tmp_path / "o")
