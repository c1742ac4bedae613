"""``python -m dumper sweep``: one capture per grid cell, each compared with one baseline (HF engine, fp32)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from comparator.config import CompareConfig
from comparator.hidden.compare import compare_dumps
from dumper.errors import NotComparableError, UsageError
from dumper.format import load_manifest
from dumper.jobs.sweep.grid import block_lengths, parse_grid
from dumper.jobs.sweep.results import ZERO_HITS, SweepResult
from dumper.jobs.sweep.run import SweepConfig, baseline_prompts, plan_sweep, run_cell, sweep
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import run_cli, tiny_llama

SHORT = "A short prompt, twenty-four."  # prompt 0: shorter than the longest length, so that cell drops it
LONG = "Inference engines change daily; each change can shift numerics."
GRID = ("chunk_size=none,5,16", "batch_size=1,2", "lengths=12,33")
BUG_LAYER = 2
"""The bug sits in this layer's attention output, so the first input it reaches is layer 3's."""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A fp32 baseline of two prompts (every layer, logprobs) from ``python -m dumper run``."""
    root = tmp_path_factory.mktemp("sweep")
    r = run_cli(
        "dumper",
        "run",
        "--layers",
        "all",
        "--logprobs",
        "--prompt",
        SHORT,
        "--prompt",
        LONG,
        "--out",
        root / "base",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    _, prompts = baseline_prompts(str(root / "base"))
    assert 24 < len(prompts[0]) < 31 and 33 <= len(prompts[1]), [len(p) for p in prompts]
    return root


def _template(root, **kw) -> RunConfig:
    return RunConfig(out=str(root), layers="all", logprobs=LogprobSpec(), **kw)


@pytest.mark.slow
def test_every_cell_passes_in_fp32_and_the_json_holds_each_cell(base, tmp_path):
    out, js = tmp_path / "sweep", tmp_path / "sweep.json"
    r = run_cli(
        "dumper",
        "sweep",
        "--baseline",
        base / "base",
        "--logprobs",
        *(a for g in GRID for a in ("--grid", g)),
        "--out",
        out,
        "--json",
        js,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(js.read_text())
    cells = result["cells"]
    assert result["passed"] and len(cells) == 12 and result["wall_s"] > 0
    assert json.loads((out / "sweep.json").read_text())["cells"] == cells
    # lengths innermost: the cells of one engine setting run one after another
    assert [(c["settings"]["chunk_size"], c["settings"]["batch_size"], c["settings"]["lengths"]) for c in cells] == [
        (ch, b, n) for ch in (None, 5, 16) for b in (1, 2) for n in (12, 33)
    ]
    for i, c in enumerate(cells):
        assert c["name"] == f"cell-{i:03d}" and c["passed"] and c["verdict"] == "PASS" and c["first_divergent"] is None
        assert c["report"] == str(out / c["name"] / "report.json") and c["dump"] == str(out / c["name"] / "dump")
        assert c["wall_s"] >= c["run_s"] > 0 and c["engine_reused"] is False and c["cache_hits"] is None
        report = json.loads((out / c["name"] / "report.json").read_text())
        assert report["passed"] and not report["unmatched_baseline"] and not report["unmatched_target"]
        n = c["settings"]["lengths"]
        # by causality the first n positions of each kept prompt, judged against the baseline's (sequence ids kept)
        rows = {(t["sequence"], t["shape"][0]) for t in report["tensors"]}
        assert rows == ({(0, n), (1, n)} if n == 12 else {(1, n)})
        lp = c["logprobs"]
        assert lp["passed"] and lp["compared_positions"] == report["logprobs"]["compared_positions"]
        assert lp["compared_positions"] == (2 * (n - 1) if n == 12 else n - 1)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 12 and lines[3].startswith("[4/12] cell-003 chunk_size=none batch_size=2 lengths=33: PASS")
    assert r.stdout.count("cell-0") == 12 and "PASS: 12 cells" in r.stdout


def _bugged_model():
    """tiny-llama whose layer-2 attention adds 5% of its input to its output in a pass that continues a request:
    one whose KV cache already held tokens before it (tensor ops; the cache is None without chunks)."""
    model, _ = tiny_llama()
    attn = model.model.layers[BUG_LAYER].self_attn

    def bug(module, args, kwargs, output):
        cache, x = kwargs.get("past_key_values"), kwargs.get("hidden_states", args[0] if args else None)
        held = torch.tensor(0 if cache is None else cache.get_seq_length(module.layer_idx) - x.shape[1])
        return (output[0] + 0.05 * x * (held > 0).to(x.dtype), *output[1:])  # [B, s, hidden]

    attn.register_forward_hook(bug, with_kwargs=True)
    return model


@pytest.fixture(scope="module")
def bugged(base, tmp_path_factory):
    """The sweep of GRID run in this process through the bugged model."""
    model = _bugged_model()

    def runner(cfg: RunConfig, *, progress=None):
        return dump_sequences(model, [list(s) for s in cfg.input_ids], cfg, progress=progress)

    out = tmp_path_factory.mktemp("bugged") / "sweep"
    cfg = SweepConfig(baseline=str(base / "base"), out=str(out), template=_template(out), grid=parse_grid(GRID))
    seen = []
    result = sweep(cfg, runner=runner, on_cell=lambda c, n: seen.append((c.index, n)))
    assert seen == [(i, 12) for i in range(12)]
    return result


@pytest.mark.slow
def test_a_bug_in_continued_chunks_fails_exactly_the_chunked_cells_from_the_first_boundary(bugged):
    assert not bugged
    for c in bugged.cells:
        chunk, n = c.settings["chunk_size"], c.settings["lengths"]
        chunked = chunk is not None and n > chunk  # the prompt spans more than one chunk
        assert c.passed is not chunked, (c.settings, c.verdict)
        if not chunked:
            assert c.first_divergent is None and c.verdict == "PASS"
            continue
        fd = c.first_divergent
        assert c.verdict == "FAIL (hidden states)" and fd.layer == BUG_LAYER + 1
        assert c.first_token == chunk and fd.note.startswith(f"token {chunk} = start of chunk 2/")
        assert c.onset == chunk  # the first chunk's own rounding (bit-identical, then fp32) is no step: issue 34
        assert c.logprobs.max_abs_err > 0


@pytest.mark.slow
def test_the_sweep_result_round_trips_through_json(bugged):
    again = SweepResult.from_json(json.loads(json.dumps(bugged.to_json())))
    assert again == bugged
    with open(f"{bugged.out}/sweep.json") as f:
        assert json.load(f) == bugged.to_json()


@pytest.mark.slow
def test_a_truncated_run_needs_the_subset_option_and_still_refuses_positions_the_baseline_lacks(base, bugged):
    cell = next(c for c in bugged.cells if c.settings == {"chunk_size": None, "batch_size": 1, "lengths": 12})
    with pytest.raises(NotComparableError, match="the target 12;"):  # logprobs refuse first, hidden states would too
        compare_dumps(base / "base", cell.dump)  # the baseline's other rows would be uncompared: refused
    assert compare_dumps(base / "base", cell.dump, CompareConfig(subset=True)).passed
    with pytest.raises(NotComparableError, match="covers 12 positions, the target 29;"):  # the longer side as target
        compare_dumps(cell.dump, base / "base", CompareConfig(subset=True))


@pytest.mark.slow
def test_lengths_block_expands_around_one_and_two_blocks(base, tmp_path):
    cfg = SweepConfig(
        baseline=str(base / "base"),
        out=str(tmp_path / "s"),
        template=_template(tmp_path),
        grid=parse_grid(["lengths=block,4", "chunk_size=none,8"]),
    )
    cells, block = plan_sweep(cfg)  # the HF engine's default block of 16
    assert block == 16 and block_lengths(16) == (15, 16, 17, 31, 32, 33)
    assert [(c.settings["chunk_size"], c.length) for c in cells] == [
        (ch, n) for ch in (None, 8) for n in (15, 16, 17, 31, 32, 33, 4)
    ]
    assert [c.group for c in cells] == [0] * 7 + [1] * 7
    assert {c.sequence_map for c in cells if c.length > 24} == {(1,)}
    cells, block = plan_sweep(replace(cfg, block_size=4))
    assert block == 4 and [c.length for c in cells[:6]] == [3, 4, 5, 7, 8, 9]  # 4 once: the grid's own 4 too
    assert not (tmp_path / "s").exists()  # planning runs nothing


@pytest.mark.slow
@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (
            "attn_backend=flash",
            "error: --grid attn_backend: unknown key; --engine transformers sweeps chunk_size, "
            "batch_size, new_tokens, speculative, lengths",
        ),
        ("chunk_size=8,0", "error: --grid chunk_size=0: --chunk-size must be >= 1, got 0"),
    ],
)
def test_a_bad_grid_exits_2_with_one_line_before_anything_runs(base, tmp_path, grid, message):
    r = run_cli("dumper", "sweep", "--baseline", base / "base", "--grid", grid, "--out", tmp_path / "s")
    assert r.returncode == 2 and r.stderr.strip() == message, r.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("grid", "match"),
    [
        (["lengths=500"], "--grid lengths=500: no prompt of the baseline .* has 500 tokens"),
        (["batch_size=two"], "--grid batch_size=two: expected a positive integer"),
        (["lengths=8", "lengths=9"], "--grid lengths: given twice"),
        (["chunk_size=4,4"], "a value is repeated"),
        (["chunk_size"], "expected KEY=V1,V2"),
    ],
)
def test_grid_errors_name_the_axis(base, tmp_path, grid, match):
    with pytest.raises(UsageError, match=match):
        plan_sweep(
            SweepConfig(
                baseline=str(base / "base"),
                out=str(tmp_path / "s"),
                template=_template(tmp_path),
                grid=parse_grid(grid),
            )
        )


@pytest.mark.slow
def test_a_prefix_caching_cell_with_no_cache_hits_fails_and_hits_must_match_the_recorded_rows(base, tmp_path):
    """The cache-hit checks on real dumps whose manifests carry ``prefix_cache_hits`` (as vLLM's do)."""
    model, _ = tiny_llama()

    def runner(cfg: RunConfig, *, progress=None):
        return dump_sequences(model, [list(s) for s in cfg.input_ids], cfg)

    cfg = SweepConfig(
        baseline=str(base / "base"),
        out=str(tmp_path),
        template=_template(tmp_path),
        grid=parse_grid(["chunk_size=none"]),
    )
    (cell,), _ = plan_sweep(cfg)
    for hits, reason in (
        ([0, 0], ZERO_HITS),
        (
            [16, 0],
            "sequence 0: rows recorded from position 0, but the prefix cache served 16 positions (1 sequences so)",
        ),
    ):
        out = tmp_path / f"hits{hits[0]}"
        run = replace(cell.config, out=str(out / cell.name / "dump"), logprobs=None, extra={"prefix_cache_hits": hits})
        c = run_cell(replace(cell, config=run, prefix_cache=True), replace(cfg, out=str(out)), runner)
        assert not c.passed and c.reasons == (reason,) and c.verdict == f"FAIL ({reason})"
        assert c.cache_hits == sum(hits) and c.cache_hits_by_sequence == tuple(hits)
        assert c.first_divergent is None and c.logprobs.note == "n/a (prefix cache)"


@pytest.mark.slow
def test_new_tokens_cells_are_judged_against_their_own_prefill_and_a_decode_bug_fails_only_them(base, tmp_path):
    """``new_tokens`` is an axis: a decode cell is compared with the transformers prefill of the tokens it fed (by the
    baseline's model); the bug in passes that continue a request hits every decode step, so only decode cells fail,
    at their first decode position, and a clean sweep of the same grid passes."""
    model = _bugged_model()

    def runner(cfg: RunConfig, *, progress=None):
        return dump_sequences(model, [list(s) for s in cfg.input_ids], cfg, progress=progress)

    grid = parse_grid(["new_tokens=0,4"])
    out = tmp_path / "bugged"
    result = sweep(
        SweepConfig(baseline=str(base / "base"), out=str(out), template=_template(out), grid=grid), runner=runner
    )
    cells = {c.settings["new_tokens"]: c for c in result.cells}
    assert cells[0].passed and not cells[4].passed and not result.passed
    fd = cells[4].first_divergent
    _, prompts = baseline_prompts(str(base / "base"))
    assert fd.layer == BUG_LAYER + 1 and fd.phase == "decode" and fd.decode_step == 0
    assert fd.token == len(prompts[fd.sequence])
    assert (out / cells[4].name / "prefill" / "manifest.json").exists()
    clean = tmp_path / "clean"
    r = run_cli(
        "dumper",
        "sweep",
        "--baseline",
        base / "base",
        "--logprobs",
        "--grid",
        "new_tokens=0,4",
        "--grid",
        "chunk_size=none,5",
        "--out",
        clean,
        "--json",
        tmp_path / "clean.json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for c in json.loads((tmp_path / "clean.json").read_text())["cells"]:
        report = json.loads(open(c["report"]).read())
        assert c["passed"] and report["passed"]
        if c["settings"]["new_tokens"]:
            assert report["decode"]["steps"] == 2 * 3 and report["logprobs"]["compared_positions"] == sum(
                len(p) - 1 + 4 for p in prompts
            )
        else:
            assert report["decode"] is None


@pytest.mark.slow
def test_a_sweep_records_the_baselines_points_inside_the_layer(tmp_path):
    """A baseline with the points inside a layer: every cell records them too (the sweep's default)."""
    points = "input,attn_output,mlp_input,mlp_output"
    r = run_cli(
        "dumper", "run", "--layers", "0,1", "--points", points, "--prompt", SHORT, "--out", tmp_path / "base", "--quiet"
    )
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "dumper",
        "sweep",
        "--baseline",
        tmp_path / "base",
        "--grid",
        "chunk_size=8",
        "--out",
        tmp_path / "s",
        "--json",
        tmp_path / "s.json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    cells = json.loads((tmp_path / "s.json").read_text())["cells"]
    manifest = load_manifest(Path(cells[0]["dump"]))
    assert {t.point for t in manifest.tensors if t.layer is not None} == set(points.split(","))
    assert cells[0]["passed"]
