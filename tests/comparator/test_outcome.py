"""The one outcome wording: each outcome of a real comparison, and every output writing the same words for it."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest

from comparator import CompareConfig, compare_dumps
from comparator.hidden.types import ReplicaMismatch, Report
from comparator.outcome import (
    DIVERGED,
    FAIL,
    PASS,
    Outcome,
    assertion_head,
    clause,
    describe_divergence,
    headline,
    sentence,
    status,
)
from comparator.reports.html import render_html
from comparator.reports.markdown import to_markdown
from comparator.testing import assert_dumps_match, render_to_string
from tests.report_dumps import clean_dump, one_token_bug_dump
from tests.storeutil import synth_dump

LOOSE = {"threshold": 10.0, "token_threshold": 10.0}
"""Hidden-state thresholds no tensor of the one-token bug exceeds: only its logprobs fail."""


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[Outcome, Report]:
    root = tmp_path_factory.mktemp("outcome")
    a, same, bump = synth_dump(root / "a"), synth_dump(root / "same"), synth_dump(root / "bump", bump=(1, 5))
    base = clean_dump(root / "base")
    bug = one_token_bug_dump(root / "bug", layer=2, token=57)
    passed = compare_dumps(a, same)
    # a replica mismatch needs a tensor-parallel run; the wording only needs the report to carry one
    replicas = dataclasses.replace(
        passed,
        replica_mismatches=(
            ReplicaMismatch(
                side="target",
                name="model.layers.1.self_attn.input",
                layer=1,
                sequence=0,
                rank=1,
                reference_rank=0,
                first_token=3,
                max_token_rel_diff=0.5,
            ),
        ),
    )
    return {
        Outcome.PASSED: passed,
        Outcome.TENSORS: compare_dumps(a, bump),
        Outcome.REPLICAS: replicas,
        Outcome.LOGPROBS: compare_dumps(base, bug, CompareConfig.resolve(**LOOSE)),
    }


def test_each_report_has_its_outcome(reports):
    for outcome, report in reports.items():
        assert Outcome.of(report) is outcome
        assert outcome.passed is report.passed and outcome.word == (PASS if report.passed else DIVERGED)
    assert all(t.passed for t in reports[Outcome.LOGPROBS].tensors)  # the logprob case fails on logprobs alone


def test_headlines(reports):
    fd = reports[Outcome.TENSORS].first_divergent
    assert headline(reports[Outcome.PASSED]) == "PASS" and clause(reports[Outcome.PASSED]) == ""
    assert headline(reports[Outcome.TENSORS]) == f"DIVERGED {describe_divergence(fd)}"
    assert headline(reports[Outcome.TENSORS]).startswith(
        "DIVERGED at layer 1 (model.layers.1.self_attn.input, pass 0, rank 0), first failing token 5 of sequence 0"
    )
    assert headline(reports[Outcome.REPLICAS]) == "DIVERGED (replicas differ)"
    failures = reports[Outcome.LOGPROBS].logprobs.failures()
    assert failures and headline(reports[Outcome.LOGPROBS]) == f"DIVERGED (logprobs: {', '.join(failures)})"
    assert clause(reports[Outcome.LOGPROBS], detail=False) == "(logprobs)"
    assert clause(reports[Outcome.TENSORS], escape=str.upper) == describe_divergence(fd).upper()


def test_status_words():
    assert (status(True), status(True, "x"), status(False), status(False, 3), status(False, "mse, kl_max")) == (
        PASS,
        PASS,
        FAIL,
        "FAIL (3)",
        "FAIL (mse, kl_max)",
    )


@pytest.mark.slow
def test_every_output_writes_the_same_words(reports):
    """Markdown, HTML, the terminal and the pytest helper name the outcome alike."""
    for outcome, report in reports.items():
        md = to_markdown(report).splitlines()[0]
        assert md.startswith(f"**driftscope: {outcome.word}** ")
        page = render_html(report)
        assert f"<h1>{outcome.word}</h1>" in page and f"<p>{html.escape(sentence(report))}</p>" in page
        assert re.search(rf"<title>driftscope: {outcome.word}: ", page)
        short = clause(report, detail=False)  # the terminal's table above already lists the failures
        expected = (
            f"{headline(report)}. matched "
            if outcome is Outcome.TENSORS
            else f"{outcome.word}{' ' * bool(short)}{short}: matched "
        )
        verdict = [
            line for line in render_to_string(report, width=400).splitlines() if line.startswith((PASS, DIVERGED))
        ]
        assert verdict and verdict[-1].startswith(expected), (verdict, expected)
    assert to_markdown(reports[Outcome.PASSED]).startswith("**driftscope: PASS** (every matched tensor passed)")
    assert sentence(reports[Outcome.LOGPROBS]) == "the logprobs fail their thresholds"


def test_the_assertion_message_leads_with_the_outcome(reports, tmp_path):
    assert assertion_head(reports[Outcome.REPLICAS]) == "dumps diverge: ranks that should hold identical rows differ"
    failures = ", ".join(reports[Outcome.LOGPROBS].logprobs.failures())
    assert assertion_head(reports[Outcome.LOGPROBS]) == f"dumps diverge in their logprobs: {failures}"
    tensors = reports[Outcome.TENSORS]
    with pytest.raises(AssertionError) as err:
        assert_dumps_match(tensors.baseline, tensors.target)
    head = str(err.value).splitlines()[0]
    assert head == assertion_head(tensors) == f"dumps diverge {describe_divergence(tensors.first_divergent)}"
