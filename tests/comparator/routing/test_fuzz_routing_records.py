"""Fuzzing routing records: generated damage to a dump's router logits, ids, weights, scores and scores meta.

Each case writes two dumps with driftscope's own capture (one MoE layer, a hidden row beside it)
whose routing parts hypothesis draws: expert counts and top-k per side and per pass, ids in and
out of range and repeated, weights and scores holding NaN, Inf, negatives, scores of the wrong
width, a grouped top-k meta that does not divide the experts, padding rows. The comparator runs
in-process (:func:`tests.fuzzing.run_main` + :func:`tests.fuzzing.check_outcome`: exit 0, 1 or 2,
never 3, no traceback, one ``error:`` line, bounded memory), and the oracle says which damage is
unusable input (exit 2) and that identical routing never fails but for NaN (which never passes).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dumper
from comparator.cli.main import main as compare_main
from dumper.format import ROUTER_IDS, ROUTER_LOGITS, ROUTER_SCORES, ROUTER_WEIGHTS
from tests.fuzzing import FUZZ, check_outcome, run_child, run_main

ROWS = 5
PREFIX = "model.layers.1.mlp"


def _write(path: Path, passes: list[dict[str, np.ndarray]], meta: dict | None, padding: int) -> Path:
    with dumper.capture(None, path) as cap:
        for p, parts in enumerate(passes):
            seqs = [p] * (ROWS - padding) + [-1] * padding
            rows = dict(positions=range(ROWS), sequence_ids=seqs)
            cap.record("model.layers.1.input", torch.ones(ROWS, 4), layer=1, point="input", **rows)
            cap.record_router(PREFIX, 1, {k: torch.from_numpy(v) for k, v in parts.items()}, scores_meta=meta, **rows)
            cap.step()
    return path


@st.composite
def routing(draw: st.DrawFn, experts: int, k: int) -> dict[str, np.ndarray]:
    """One pass's parts: mostly sound (distinct ids of the top-k), with drawn damage."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    logits = rng.standard_normal((ROWS, experts)).astype(np.float32)
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int64)
    weights = np.full((ROWS, k), 1.0 / k, np.float32)
    parts = {ROUTER_LOGITS: logits, ROUTER_IDS: ids, ROUTER_WEIGHTS: weights}
    for _ in range(draw(st.integers(0, 2))):
        what = draw(
            st.sampled_from(["repeat", "range", "negative_id", "nan", "inf", "neg_weight", "scores", "wide_scores"])
        )
        r = draw(st.integers(0, ROWS - 1))
        if what == "repeat" and k > 1:
            ids[r, 1] = ids[r, 0]
        elif what == "range":
            ids[r, 0] = experts + draw(st.integers(0, 10**6))
        elif what == "negative_id":
            ids[r, -1] = -draw(st.integers(1, 10**6))
        elif what in ("nan", "inf"):
            target = draw(st.sampled_from([logits, weights]))
            target[r, 0] = math.nan if what == "nan" else -math.inf
        elif what == "neg_weight":
            weights[r, 0] = -1.0
        elif what == "scores":
            parts[ROUTER_SCORES] = rng.random((ROWS, experts)).astype(np.float32)
        elif what == "wide_scores":
            parts[ROUTER_SCORES] = rng.random((ROWS, experts + 1)).astype(np.float32)
    return parts


def _bad_input(passes: list[dict[str, np.ndarray]], padding: int, meta: dict | None) -> bool:
    """Damage the format refuses (exit 2): widths that differ, ids repeated (outside padding) or out of range, scores
    in some passes only."""
    e, k = passes[0][ROUTER_LOGITS].shape[1], passes[0][ROUTER_IDS].shape[1]
    real = ROWS - padding
    for parts in passes:
        ids = parts[ROUTER_IDS]
        if parts[ROUTER_LOGITS].shape[1] != e or ids.shape[1] != k or not 1 <= k <= e:
            return True
        if ROUTER_SCORES in parts and parts[ROUTER_SCORES].shape[1] != e:
            return True
        if ids.min() < 0 or ids.max() >= e:
            return True
        if k > 1 and (np.sort(ids[:real], axis=1)[:, 1:] == np.sort(ids[:real], axis=1)[:, :-1]).any():
            return True
    if any(ROUTER_SCORES in p for p in passes) and not all(ROUTER_SCORES in p for p in passes):
        return True  # scores for some passes' rows only
    if meta and any(ROUTER_SCORES in p for p in passes):
        g, keep = meta.get("n_group"), meta.get("topk_group")
        if not (type(g) is int and type(keep) is int and 0 < keep <= g and e % g == 0 and e // g >= 2):
            return True
    return False


_N = itertools.count()


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=60)
def test_generated_routing_damage(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    root = tmp_path_factory.getbasetemp() / "fuzz-routing" / str(next(_N))
    experts = data.draw(st.sampled_from([2, 4, 8, 16]), label="experts")
    k = data.draw(st.integers(1, min(experts, 3)), label="k")
    padding = data.draw(st.integers(0, 2), label="padding")
    meta = data.draw(
        st.sampled_from(
            [None, {"n_group": 2, "topk_group": 1}, {"n_group": 3, "topk_group": 1}, {"n_group": 2, "topk_group": 5}]
        ),
        label="meta",
    )
    base_passes = [data.draw(routing(experts, k)) for _ in range(data.draw(st.integers(1, 2)))]
    same = data.draw(st.booleans(), label="identical target")
    if same:
        target_passes = [{n: v.copy() for n, v in p.items()} for p in base_passes]
    else:
        e2 = data.draw(st.sampled_from([experts, experts, 2 * experts]), label="target experts")
        k2 = data.draw(st.sampled_from([k, k, min(e2, k + 1)]), label="target k")
        target_passes = [data.draw(routing(e2, k2)) for _ in range(len(base_passes))]
    # an expert count that changes between the passes of one dump
    if len(base_passes) == 2 and data.draw(st.booleans(), label="widen pass 1"):
        e1 = base_passes[1][ROUTER_LOGITS].shape[1] * 2
        base_passes[1] = data.draw(routing(e1, min(k, e1)))
    a = _write(root / "a", base_passes, meta, padding)
    b = _write(root / "b", target_passes, meta, padding)
    o = run_main(compare_main, [a, b, "--quiet"])
    code = check_outcome(o)
    bad_a, bad_b = _bad_input(base_passes, padding, meta), _bad_input(target_passes, padding, meta)
    widths = {(p[ROUTER_LOGITS].shape[1], p[ROUTER_IDS].shape[1]) for p in (*base_passes, *target_passes)}
    if bad_a or bad_b or len(widths) > 1:
        assert code == 2, (o.out, o.err)
    elif same:
        nan = any(
            not np.isfinite(v[: ROWS - padding]).all() for p in base_passes for n, v in p.items() if v.dtype.kind == "f"
        )
        assert code == (1 if nan else 0), (o.out, o.err)  # identical routing passes; NaN or Inf never does
    else:
        assert code in (0, 1), (o.out, o.err)


def test_a_hostile_routing_dump_stays_in_bounded_memory(tmp_path):
    """50,000 routing rows of 64 experts with one repeated id at the end: refused in one line, peak RSS measured."""
    n, experts, k = 50_000, 64, 8
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((n, experts)).astype(np.float32)
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int64)
    ids[-1, 1] = ids[-1, 0]
    parts = {ROUTER_LOGITS: logits, ROUTER_IDS: ids, ROUTER_WEIGHTS: np.full((n, k), 1 / k, np.float32)}
    paths = []
    for name in ("a", "b"):
        with dumper.capture(None, tmp_path / name) as cap:
            rows = dict(positions=range(n), sequence_ids=[0] * n)
            cap.record_router(PREFIX, 1, {p: torch.from_numpy(v) for p, v in parts.items()}, **rows)
            cap.step()
        paths.append(tmp_path / name)
    code, err, peak = run_child("comparator", *paths, "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and f"position {n - 1} chooses expert" in err, err
    assert peak < 600 << 20, peak  # the import of numpy and torch-free comparator, plus a few copies of 25 MB
