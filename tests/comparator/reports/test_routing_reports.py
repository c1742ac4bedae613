"""MoE routing in every output, from real tiny-Mixtral dumps: the verdict line, the terminal,
Markdown, HTML, JSON and the CLI's exit code.

The dumps (:mod:`tests.routing_dumps`): eager attention as the baseline; SDPA (benign); a logit bias
that flips one token of layer 1 far from any tie (or of layer 2, the last); combine weights not
renormalised at layer 1 (same experts, other weights); bfloat16 (hidden states that differ from
layer 0 on, under tight thresholds). Expected places come from the seeded bug, never from a run.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from comparator import CompareConfig, compare_dumps
from comparator.hidden.types import Report
from comparator.noise.calibrate import calibrate
from comparator.outcome import DIVERGED, PASS, Outcome, assertion_head, clause, headline, sentence
from comparator.reports.html import render_html
from comparator.reports.markdown import to_markdown
from comparator.reports.routing_table import FIRST_FAILURE
from comparator.reports.text import render_noise
from comparator.results import load_report
from comparator.testing import render_to_string
from tests.conftest import run_cli
from tests.routing_dumps import choose_flip_token, router_dump

BATCH, SEQ = 2, 40  # router_dump's defaults: choose_flip_token's row is flat over them


def _where(row: int) -> tuple[int, int]:
    """(sequence, token) of a flat row of the batch."""
    return row // SEQ, row % SEQ


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("routing")
    out = {
        "eager": router_dump(root / "eager"),
        "sdpa": router_dump(root / "sdpa", attn="sdpa"),
        "order": router_dump(root / "order", bug="order"),
        "bf16": router_dump(root / "bf16", dtype=torch.bfloat16),
    }
    for layer, name in ((1, "bias"), (2, "bias2")):
        row, expert, bias = choose_flip_token(layer, batch=BATCH, seq=SEQ)
        out[name] = router_dump(root / name, bug="bias", layer=layer, token=row, expert=expert, bias=bias)
    return out


@pytest.fixture(scope="module")
def flips() -> dict[int, tuple[int, int]]:
    """The seeded flip's (sequence, token) per bias layer."""
    return {layer: _where(choose_flip_token(layer, batch=BATCH, seq=SEQ)[0]) for layer in (1, 2)}


@pytest.fixture(scope="module")
def reports(dumps) -> dict[str, Report]:
    return {name: compare_dumps(dumps["eager"], dumps[name]) for name in ("sdpa", "bias", "bias2", "order")}


def test_a_benign_pair_passes_with_no_flip(reports):
    r = reports["sdpa"]
    assert r.router is not None and r.router.passed and r.router.flips == 0
    assert headline(r) == PASS and clause(r) == "" and Outcome.of(r) is Outcome.PASSED
    assert sentence(r) == "every matched tensor passed; the routing agrees: no flips"
    text = render_to_string(r)
    assert "routing, judged by the margin rule" in text and "routing: PASS: 0 flips (0 failing)" in text
    rows = [line for line in text.splitlines() if "0 (0.00%)" in line]
    assert len(rows) == len(r.router.layers) and all(PASS in line for line in rows)
    assert FIRST_FAILURE not in text and "failing flips (" not in text


def test_a_flip_is_named_before_the_hidden_states_it_causes(reports, flips):
    r, (seq, token) = reports["bias"], flips[1]
    assert Outcome.of(r) is Outcome.ROUTING and not r.passed
    line = headline(r)
    assert line.startswith(f"{DIVERGED}: routing first flips at layer 1, token {token} of sequence {seq} (margin ")
    assert "the margin rule)" in line and line.endswith("; hidden states diverge from layer 2")
    flip = r.router.first_failing_flip
    assert (flip.layer, flip.sequence, flip.token) == (1, seq, token) and flip.noise_ratio > 1 and not flip.benign
    assert sentence(r) == clause(r) == line.removeprefix(f"{DIVERGED}: ")
    assert assertion_head(r) == f"dumps diverge in their routing: {clause(r)}"


def test_the_terminal_highlights_the_first_failing_layer_and_lists_the_flip(reports, flips):
    r, (seq, token) = reports["bias"], flips[1]
    text = render_to_string(r)
    flip = r.router.first_failing_flip
    first = next(line for line in text.splitlines() if FIRST_FAILURE in line)
    assert first.split("│")[1].strip() == "1" and f"{FIRST_FAILURE} (flips)" in first
    assert "first failing flips (1 of 1)" in text
    ids = f"{list(flip.baseline_ids)} -> {list(flip.target_ids)}"
    assert any(ids in line and f" {token} " in line and f" {seq} " in line for line in text.splitlines())
    assert "routing judged by the margin rule" in text
    assert text.index("routing, judged by") < text.index("FIRST DIVERGENCE")  # the routing table, then the layers
    assert f"{headline(r)}. matched" in " ".join(text.split())  # the verdict line, as a sentence


def test_equal_experts_with_other_weights_fail_on_the_weights(reports):
    r = reports["order"]
    assert Outcome.of(r) is Outcome.ROUTING
    line = headline(r)
    assert line.startswith(f"{DIVERGED}: routing weights differ at layer 1 with the same experts (max |Δw| ")
    la = r.router.first_failing_layer
    assert la.layer == 1 and la.flips == 0 and la.weight_max_err > la.weight_limit
    assert "; hidden states " in line


def test_a_flip_in_the_last_layer_leaves_the_hidden_states_matching(reports, flips):
    r, (seq, token) = reports["bias2"], flips[2]
    assert Outcome.of(r) is Outcome.ROUTING and headline(r).endswith("; hidden states match")
    assert f"routing first flips at layer 2, token {token} of sequence {seq} " in headline(r)
    assert r.first_divergent is not None and r.first_divergent.layer == 2  # its router logits, judged as routing


def test_hidden_states_that_diverge_first_stay_first(dumps):
    """bfloat16 against float32 under tight thresholds: the hidden states differ from layer 0, before the flip."""
    tight = CompareConfig.resolve(threshold=1e-7, token_threshold=1e-7)
    r = compare_dumps(dumps["bf16"], dumps["bias"], tight)
    assert Outcome.of(r) is Outcome.TENSORS and r.first_divergent.layer == 0
    assert r.router.first_failing_layer.layer == 1
    line = headline(r)
    assert line.startswith(f"{DIVERGED} at layer 0 (") and line.endswith("; routing first fails at layer 1")


def test_calibrated_noise_names_the_multiple_of_noise(dumps, flips):
    noise = calibrate(dumps["eager"], [dumps["sdpa"]])
    assert sorted(noise.router) == [0, 1, 2]
    r = compare_dumps(dumps["eager"], dumps["bias"], CompareConfig.resolve(noise=noise))
    seq, token = flips[1]
    line = headline(r)
    assert f"routing first flips at layer 1, token {token} of sequence {seq}" in line
    assert "x noise)" in line and "margin rule" not in line
    text = render_to_string(r)
    assert "routing, judged by calibrated noise" in text and "x noise" in text
    buf = io.StringIO()
    render_noise(noise, Console(file=buf, width=160, no_color=True))
    assert "routing noise" in buf.getvalue() and "flip rate" in buf.getvalue()


def test_markdown_and_html_carry_the_routing(reports, flips):
    r, (seq, token) = reports["bias"], flips[1]
    md = to_markdown(r)
    assert md.splitlines()[0] == f"**driftscope: {DIVERGED}**: {clause(r)}"
    assert "routing, judged by the margin rule: FAIL (layers 1" in md
    assert "| layer | tokens | experts / top-k |" in md and "| **1** |" in md and f"**{FIRST_FAILURE} (flips)**" in md
    assert f"- layer 1, sequence {seq}, token {token}: experts" in md
    weights = to_markdown(reports["order"])
    assert "max \\|Δw\\|" in weights.splitlines()[0]  # a Markdown table cell cannot be opened by the verdict
    page = render_html(r)
    assert '<section id="routing">' in page and 'id="routing-flips"' in page
    assert '<tr class="bad first">' in page and f"<p>{html.escape(sentence(r))}</p>" in page


@pytest.mark.slow
def test_the_cli_writes_every_output_and_exits_by_the_routing(dumps, reports, flips, tmp_path):
    """Real subprocesses: 0 for the benign pair, 1 for each routing bug; the files hold the routing."""
    seq, token = flips[1]
    md, page, js = tmp_path / "r.md", tmp_path / "r.html", tmp_path / "r.json"
    bias = run_cli("comparator", dumps["eager"], dumps["bias"], "--markdown", md, "--html", page, "--json", js)
    assert bias.returncode == 1, bias.stderr
    assert f"routing first flips at layer 1, token {token} of sequence {seq}" in " ".join(bias.stdout.split())
    assert md.read_text().splitlines()[0] == to_markdown(reports["bias"]).splitlines()[0]
    assert '<section id="routing">' in page.read_text() and "routing first flips at layer 1" in page.read_text()
    loaded = load_report(js)
    assert loaded.router == reports["bias"].router and headline(loaded) == headline(reports["bias"])
    for name, code in (("sdpa", 0), ("order", 1)):
        done = run_cli("comparator", dumps["eager"], dumps[name], "--quiet")
        assert done.returncode == code, done.stderr
        assert done.stdout.strip() == headline(reports[name])
