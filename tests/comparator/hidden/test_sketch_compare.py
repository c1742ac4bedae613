"""Comparing sketch dumps (comparator.hidden.sketch) on a real Llama: localization, small bugs, reports.

A seeded bug perturbs one token after decoder layer ``L``; plain hooks show that the first place
it can be seen is layer ``L+1`` at that token, and every mix of full and sketched sides must say
so. A bug of rel_diff ~1e-8 is still found under a threshold set below it, where two clean
sketches are exactly equal. Benign eager vs SDPA attention passes through the CLI with either side
sketched, two sketches of different projections are refused (exit 2), and the reports say the
values are estimates of spread sqrt(2/K) and show no max |diff| or cosine.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps
from comparator.hidden.registry import metrics
from comparator.results import load_report
from dumper.cli.main import main as dumper_main
from tests.conftest import run_cli

HIDDEN, LAYERS, N_TOKENS = 128, 4, 48
K, SEED = 64, 7
BUG_LAYER, BUG_TOKEN = 1, 29
"""The seeded bug perturbs the output of decoder layer BUG_LAYER at this token only."""
BIG, TINY = 0.2, math.sqrt(2e-8)
"""Relative size of the perturbation: a rel_diff of about BIG**2/2 = 0.02, and of about 1e-8."""
TINY_THRESHOLD = 1e-9
"""A per-token threshold ten times below the tiny bug."""
POINTS = ("input", "residual")
COMBOS = ["full/full", "full/sketch", "sketch/full", "sketch/sketch"]
NOT_FROM_NORMS = {"max_abs_diff", "mean_abs_diff", "cosine"}
"""Metrics that need the whole rows: never given for a sketch."""


def llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A real HF Llama (hidden 128, 4 layers) built from its config with a fixed seed (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        max_position_embeddings=256,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(dtype)


def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, N_TOKENS), generator=torch.Generator().manual_seed(0))


def token_bug(model: torch.nn.Module, eps: float) -> torch.utils.hooks.RemovableHandle:
    """After decoder layer BUG_LAYER, add to token BUG_TOKEN a seeded random vector of ``eps`` times its size."""

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # [batch, seq, hidden]
        row = hidden[:, BUG_TOKEN]  # [batch, hidden]
        noise = torch.randn(row.shape, generator=torch.Generator().manual_seed(1)).to(hidden.dtype)
        delta = eps * row.norm(dim=-1, keepdim=True) / math.sqrt(row.shape[-1]) * noise
        at_token = (torch.arange(hidden.shape[1]) == BUG_TOKEN).to(hidden.dtype)[None, :, None]  # [1, seq, 1]
        hidden = hidden + at_token * delta[:, None, :]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return model.model.layers[BUG_LAYER].register_forward_hook(hook)


def capture(model: torch.nn.Module, out: Path, *, sketch: int | None = None, bug: float | None = None) -> Path:
    handle = token_bug(model, bug) if bug is not None else None
    try:
        with (
            torch.inference_mode(),
            dumper.capture(
                model, out, layers="all", points=POINTS, sketch=sketch, sketch_seed=SEED if sketch else None
            ),
        ):
            model(input_ids=prompt(), use_cache=False)
    finally:
        if handle is not None:
            handle.remove()
    return out


def runs_of(root: Path, dtype: torch.dtype) -> dict[str, Path]:
    """A clean run, its re-run ("again"), a big-bug and a tiny-bug run, each dumped whole and as a K=64 sketch."""
    model = llama(dtype)
    out: dict[str, Path] = {}
    for run, bug in (("clean", None), ("again", None), ("big", BIG), ("tiny", TINY)):
        out[f"{run}-full"] = capture(model, root / f"{run}-full", bug=bug)
        out[f"{run}-sketch"] = capture(model, root / f"{run}-sketch", sketch=K, bug=bug)
    return out


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(2)
    return runs_of(tmp_path_factory.mktemp("f32"), torch.float32)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(2)
    return runs_of(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


def pair(runs: dict[str, Path], combo: str, run: str) -> tuple[Path, Path]:
    """(baseline, target) of ``combo``: the clean run against ``run``, each side full or sketched."""
    base, target = combo.split("/")
    return runs[f"clean-{base}"], runs[f"{run}-{target}"]


def at_bug_layer(report) -> list:
    return [t for t in report.tensors if t.layer == BUG_LAYER + 1]


# -- the truth, by hand -----------------------------------------------------------------------------
def decoder_inputs(model: torch.nn.Module, bug: float | None) -> list[torch.Tensor]:
    """Every decoder layer's input and the final norm's ([seq, hidden] each), read with plain hooks."""
    seen: list[torch.Tensor] = []

    def grab(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append(x[0].detach().clone())

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in (*model.model.layers, model.model.norm)]
    handles += [token_bug(model, bug)] if bug is not None else []
    try:
        with torch.inference_mode():
            model(input_ids=prompt(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("eps", [BIG, TINY])
def test_truth_by_hand_the_bug_first_shows_at_the_next_layer_at_its_token(eps):
    model = llama()
    clean, bad = decoder_inputs(model, None), decoder_inputs(model, eps)
    assert len(clean) == len(bad) == LAYERS + 1
    for layer, (x, y) in enumerate(zip(clean, bad, strict=True)):
        changed = torch.nonzero((x != y).any(dim=-1)).flatten().tolist()
        if layer <= BUG_LAYER:
            assert changed == [], layer
        elif layer == BUG_LAYER + 1:
            assert changed == [BUG_TOKEN]
            rel = (
                (x[BUG_TOKEN] - y[BUG_TOKEN]).square().sum()
                / (x[BUG_TOKEN].square().sum() + y[BUG_TOKEN].square().sum())
            ).item()
            assert eps**2 / 4 < rel < eps**2, rel  # about eps^2/2: the size the constants promise
        else:  # attention carries it to later tokens, never to earlier ones
            assert changed and min(changed) == BUG_TOKEN


# -- localization in every mix of full and sketched sides -------------------------------------------
@pytest.mark.parametrize("combo", COMBOS)
def test_token_bug_is_localized_in_every_mix(f32, combo):
    report = compare_dumps(*pair(f32, combo, "big"))
    assert not report.passed
    fd = report.first_divergent
    assert fd is not None and (fd.layer, fd.token) == (BUG_LAYER + 1, BUG_TOKEN), fd
    for t in report.tensors:
        assert t.passed == (t.layer <= BUG_LAYER), (t.name, t.max_token_rel_diff)
    for t in at_bug_layer(report):  # one token fails, and it is the worst
        assert t.failing_tokens == 1 and t.first_failing_token == t.worst_token == BUG_TOKEN, t.name
    if combo == "full/full":
        assert report.sketch is None
        return
    # the estimate at the bug's token is within the stated spread of the true value
    truth = {t.name: t.max_token_rel_diff for t in at_bug_layer(compare_dumps(*pair(f32, "full/full", "big")))}
    spread = math.sqrt(2 / K)
    for t in at_bug_layer(report):
        assert abs(t.max_token_rel_diff / truth[t.name] - 1) < 3 * spread, (t.name, t.max_token_rel_diff, truth)


@pytest.mark.parametrize("combo", COMBOS)
def test_tiny_fp32_bug_is_found_under_a_threshold_below_it(f32, combo):
    config = CompareConfig(token_threshold=TINY_THRESHOLD)
    report = compare_dumps(*pair(f32, combo, "tiny"), config)
    fd = report.first_divergent
    assert not report.passed and fd is not None and (fd.layer, fd.token) == (BUG_LAYER + 1, BUG_TOKEN), fd
    bug = max(t.max_token_rel_diff for t in at_bug_layer(report))
    assert bug > 3 * TINY_THRESHOLD, bug
    # a clean comparison of the same mix passes under that threshold, far below it
    clean = compare_dumps(*pair(f32, combo, "again"), config)
    assert clean.passed and clean.first_divergent is None
    assert max(t.max_token_rel_diff for t in clean.tensors) < 1e-3 * TINY_THRESHOLD


def test_two_clean_sketches_of_the_same_projection_are_exactly_equal(f32):
    report = compare_dumps(f32["clean-sketch"], f32["again-sketch"], CompareConfig(threshold=0, token_threshold=0))
    assert report.passed and report.matched == 2 * LAYERS + 1
    assert all(t.rel_diff == 0 and t.max_token_rel_diff == 0 for t in report.tensors)


@pytest.mark.parametrize("combo", ["sketch/sketch", "full/sketch"])
def test_bf16_token_bug_is_localized_with_sketches(bf16, combo):
    report = compare_dumps(*pair(bf16, combo, "big"))
    fd = report.first_divergent
    assert not report.passed and fd is not None and (fd.layer, fd.token) == (BUG_LAYER + 1, BUG_TOKEN), fd
    assert all(t.passed == (t.layer <= BUG_LAYER) for t in report.tensors)
    assert compare_dumps(*pair(bf16, combo, "again")).passed
    m = json.loads((bf16["big-sketch"] / "manifest.json").read_text())
    assert {t["sketch"]["dtype"] for t in m["tensors"]} == {"BF16"} and {t["dtype"] for t in m["tensors"]} == {"F32"}


# -- the Report ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("combo", COMBOS)
def test_report_says_which_sides_were_sketched(f32, combo):
    report = compare_dumps(*pair(f32, combo, "big"))
    base, target = (side == "sketch" for side in combo.split("/"))
    all_metrics, from_norms = {m.name for m in metrics()}, {m.name for m in metrics() if m.from_norms}
    assert NOT_FROM_NORMS <= all_metrics - from_norms and {"rel_diff", "max_token_rel_diff"} <= from_norms
    if not (base or target):
        assert report.sketch is None and not any("sketch" in n for n in report.notes)
        assert all(set(t.metrics) == all_metrics for t in report.tensors)
        assert all(s.max_abs_diff is not None and s.min_cosine is not None for s in report.layers())
        return
    assert report.sketch == {
        "kind": "rademacher",
        "k": K,
        "seed": SEED,
        "baseline": base,
        "target": target,
        "spread": math.sqrt(2 / K),
    }
    note = [n for n in report.notes if n.startswith("sketch comparison")]
    assert len(note) == 1 and f"K={K} seed={SEED}" in note[0] and "sqrt(2/K)" in note[0], report.notes
    assert all(set(t.metrics) == from_norms for t in report.tensors)
    assert all(s.max_abs_diff is None and s.min_cosine is None for s in report.layers())


# -- the CLI: benign attention change, refusals, report files --------------------------------------------
CLI_K = 32
"""tiny-llama's rows are 64 wide."""
SIDES = {(True, True): "both sides", (True, False): "the baseline", (False, True): "the target"}


def json_path(root: Path, what: str) -> Path:
    return root / f"{what.replace('/', '-')}.json"


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict[str, object]:
    """tiny-llama dumped by ``python -m dumper run`` under eager and SDPA attention, whole and sketched, and the
    comparator CLI's answers on them (the subprocesses two at a time). The two sketches of other projections are
    dumped by the same CLI in this process (they are only refused)."""
    root = tmp_path_factory.mktemp("cli")
    common = (
        "--layers",
        "all",
        "--points",
        "input,residual",
        "--quiet",
        "--prompt",
        "Inference engines change daily; each change can shift numerics without an error.",
    )
    dumps = {
        "eager-full": (),
        "sdpa-full": ("--attn", "sdpa"),
        "eager-sketch": ("--sketch", CLI_K),
        "sdpa-sketch": ("--attn", "sdpa", "--sketch", CLI_K),
    }
    others = {
        "sdpa-seed1": ("--attn", "sdpa", "--sketch", CLI_K, "--sketch-seed", 1),
        "sdpa-k16": ("--attn", "sdpa", "--sketch", 16),
    }
    compares = {
        "full/full": ("eager-full", "sdpa-full"),
        "full/sketch": ("eager-full", "sdpa-sketch"),
        "sketch/full": ("eager-sketch", "sdpa-full"),
        "sketch/sketch": ("eager-sketch", "sdpa-sketch"),
        "seed": ("eager-sketch", "sdpa-seed1"),
        "k": ("eager-sketch", "sdpa-k16"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        made = dict(
            zip(
                dumps,
                pool.map(lambda n: run_cli("dumper", "run", "--out", root / n, *common, *dumps[n]), dumps),
                strict=True,
            )
        )
        for name, argv in others.items():
            assert dumper_main(["run", "--out", str(root / name), *common, *map(str, argv)]) == 0, name
        for name, r in made.items():
            assert r.returncode == 0, (name, r.stderr)
        answers = dict(
            zip(
                compares,
                pool.map(
                    lambda c: run_cli(
                        "comparator",
                        root / compares[c][0],
                        root / compares[c][1],
                        "--tensors",
                        "--json",
                        json_path(root, c),
                    ),
                    compares,
                ),
                strict=True,
            )
        )
    return {"root": root, "answers": answers, "pairs": compares}


def table_column(stdout: str, header: str) -> list[str]:
    """The cells under ``header`` of the first table in the comparator's text output."""
    lines = stdout.splitlines()
    head = next(line for line in lines if header in line)
    col = [c.strip() for c in head.split("┃")].index(header)
    cells = []
    for line in lines[lines.index(head) + 1 :]:
        if line.startswith("└"):  # the table's bottom border
            break
        if line.startswith("│"):
            cells.append([c.strip() for c in line.split("│")][col])
    return cells


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS)
def test_benign_eager_vs_sdpa_passes_with_either_side_sketched(cli, combo):
    r = cli["answers"][combo]
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr)
    text = " ".join(r.stdout.split())
    assert text.count("PASS:") == 1
    base, target = (side == "sketch" for side in combo.split("/"))
    report = json.loads(json_path(cli["root"], combo).read_text())
    assert report["passed"] is True and report["matched"] > 0
    assert load_report(json_path(cli["root"], combo)).sketch == report["sketch"]
    max_abs = table_column(r.stdout, "max |diff|")
    if not (base or target):
        assert report["sketch"] is None and "sketch comparison" not in text
        assert max_abs and all(cell not in ("n/a", "") for cell in max_abs), max_abs
        assert all({m.name for m in metrics()} <= t.keys() for t in report["tensors"])
        return
    assert report["sketch"] == {
        "kind": "rademacher",
        "k": CLI_K,
        "seed": 0,
        "baseline": base,
        "target": target,
        "spread": math.sqrt(2 / CLI_K),
    }
    assert f"sketch comparison ({SIDES[base, target]} sketched, rademacher K={CLI_K} seed=0" in text, text
    assert "max |diff| and cosine need the full tensors and are not available" in text
    assert max_abs and all(cell == "n/a" for cell in max_abs), max_abs
    assert all(
        {m.name for m in metrics() if m.from_norms} <= t.keys() and not NOT_FROM_NORMS & t.keys()
        for t in report["tensors"]
    )
    assert any(note.startswith("sketch comparison") for note in report["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["seed", "k"])
def test_sketches_of_different_projections_are_refused(cli, what):
    r = cli["answers"][what]
    base, target = (cli["root"] / n for n in cli["pairs"][what])
    assert r.returncode == 2 and not r.stdout.strip(), (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert str(base) in lines[0] and str(target) in lines[0], lines[0]
    assert "same --sketch and --sketch-seed" in lines[0]
    assert not json_path(cli["root"], what).exists()
