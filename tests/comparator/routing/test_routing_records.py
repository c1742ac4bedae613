"""Hostile routing records (issue 32): refused in one line, exit 2, before numpy ever sees them.

The dumps are written by driftscope's own capture with routing parts made by hand (a router that
chooses its experts from a fixed table), so each case is exactly the damage named: expert counts
that differ between the sides or between two passes of one dump, top-k lists that repeat an
expert. A real Mixtral baseline whose ids record is edited in place checks ``replay
--force-routing`` refuses the same row before it runs anything.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dumper
from comparator import compare_dumps
from dumper.errors import CorruptDumpError, NotComparableError
from dumper.format import MANIFEST_NAME, ROUTER_IDS, ROUTER_LOGITS, ROUTER_WEIGHTS, load_manifest
from tests.conftest import run_cli
from tests.fuzzing import edit_stored

ROWS = 6
PREFIX = "model.layers.1.mlp"


def _parts(experts: int, ids: list[list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    logits = torch.randn(len(ids), experts, generator=torch.Generator().manual_seed(seed))
    chosen = torch.tensor(ids, dtype=torch.int64)
    return {ROUTER_LOGITS: logits, ROUTER_IDS: chosen, ROUTER_WEIGHTS: torch.full(chosen.shape, 1.0 / chosen.shape[1])}


def _top2(experts: int) -> list[list[int]]:
    return [[r % experts, (r + 1) % experts] for r in range(ROWS)]


def _dump(path: Path, passes: list[dict[str, torch.Tensor]]) -> Path:
    """One sequence per pass: pass p holds sequence p's ROWS positions, a hidden row and its routing."""
    with dumper.capture(None, path) as cap:
        for p, parts in enumerate(passes):
            rows = dict(positions=range(ROWS), sequence_ids=[p] * ROWS)
            cap.record("model.layers.1.input", torch.ones(ROWS, 8) * (p + 1), layer=1, point="input", **rows)
            cap.record_router(PREFIX, 1, parts, **rows)
            cap.step()
    return path


def _cli_one_line(base: Path, target: Path, *needles: str) -> str:
    r = run_cli("comparator", base, target, "--quiet")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def test_sides_with_different_expert_counts_are_refused_naming_the_layer_and_both(tmp_path):
    base = _dump(tmp_path / "base", [_parts(16, _top2(16))])
    target = _dump(tmp_path / "target", [_parts(8, _top2(8))])
    _cli_one_line(base, target, "layer 1", "8 experts", "over 16")


def test_a_top_k_that_differs_between_the_sides_is_refused(tmp_path):
    base = _dump(tmp_path / "base", [_parts(8, _top2(8))])
    target = _dump(tmp_path / "target", [_parts(8, [[r, (r + 1) % 8, (r + 2) % 8] for r in range(ROWS)])])
    _cli_one_line(base, target, "layer 1", "top-3", "top-2")


def test_an_expert_count_that_changes_between_passes_of_one_dump_is_refused(tmp_path):
    good = _dump(tmp_path / "good", [_parts(8, _top2(8)), _parts(8, _top2(8), seed=1)])
    bad = _dump(tmp_path / "bad", [_parts(8, _top2(8)), _parts(16, _top2(16), seed=1)])
    for base, target in ((good, bad), (bad, good)):
        line = _cli_one_line(base, target, "layer 1 routing", "8 columns in pass 0", "16 in pass 1")
        assert str(bad) in line
    with pytest.raises(NotComparableError, match="expert count and top-k are the same in every record"):
        compare_dumps(good, bad)


def test_identical_dumps_whose_rows_repeat_an_expert_are_refused_not_failed(tmp_path):
    ids = _top2(8)
    ids[3] = [5, 5]  # sequence 0, position 3 chooses expert 5 twice
    base = _dump(tmp_path / "base", [_parts(8, ids)])
    target = _dump(tmp_path / "target", [_parts(8, ids)])
    line = _cli_one_line(base, target, "sequence 0, position 3 chooses expert 5 twice", "[5, 5]")
    assert str(base) in line  # the baseline is read first
    with pytest.raises(CorruptDumpError, match="a top-k picks distinct experts"):
        compare_dumps(base, target)


def test_padding_rows_may_repeat_an_expert(tmp_path):
    """Padding rows are never compared, so what they hold is not refused."""
    ids = _top2(8)
    ids[5] = [0, 0]
    paths = []
    for name in ("base", "target"):
        with dumper.capture(None, tmp_path / name) as cap:
            rows = dict(positions=range(ROWS), sequence_ids=[0] * (ROWS - 1) + [-1])
            cap.record("model.layers.1.input", torch.ones(ROWS, 8), layer=1, point="input", **rows)
            cap.record_router(PREFIX, 1, _parts(8, ids), **rows)
            cap.step()
        paths.append(tmp_path / name)
    report = compare_dumps(*paths)
    assert report.passed and report.router is not None and report.router.layers[0].tokens == ROWS - 1


def _repeat_an_id(dump: Path, layer: int, row: int) -> tuple[int, int]:
    """Overwrite, in place, the second expert of ``row`` of the ids record of ``layer`` (pass 0) with its first.
    Returns (sequence, position) of that row."""
    rec = next(
        r
        for r in load_manifest(dump).tensors
        if r.layer == layer and r.name.endswith(ROUTER_IDS) and r.forward_pass == 0
    )

    def repeat(ids: np.ndarray) -> None:
        rows = ids.reshape(-1, rec.shape[-1])
        rows[row, 1] = rows[row, 0]

    edit_stored(dump / rec.file, rec.key, np.int64, repeat)
    return int(rec.row_sequence_ids()[row]), int(rec.row_positions()[row])


def test_replay_refuses_a_repeated_expert_before_it_runs_anything(tmp_path):
    from dumper.jobs.replay import replay_model
    from tests.moe_models import build_moe

    model = build_moe("mixtral")
    with torch.no_grad(), dumper.capture(model, tmp_path / "base", layers="all", points=("residual", "router")):
        model(torch.arange(3, 19).view(1, 16))
    seq, pos = _repeat_an_id(tmp_path / "base", layer=1, row=4)
    for mode in ("ids", "all", None):
        out = tmp_path / f"out-{mode}"
        with pytest.raises(CorruptDumpError, match=f"sequence {seq}, position {pos} chooses expert"):
            replay_model(model, tmp_path / "base", out, force_routing=mode)
        assert not out.exists()  # refused before the replay wrote (or ran) anything
    assert (tmp_path / "base" / MANIFEST_NAME).exists()
