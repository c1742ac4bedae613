"""``comparator.testing``: ``assert_dumps_match`` (a pytest assertion whose message is the per-layer table) and
``regress`` (a run gated against a store), as a user's test suite calls them."""

from __future__ import annotations

import pytest

from comparator import Report
from comparator.outcome import BOOTSTRAP, FAIL, PASS
from comparator.store import RunStore
from comparator.testing import RegressResult, assert_dumps_match, regress
from dumper.errors import EXIT_DIVERGED, EXIT_OK, NotComparableError
from tests.storeutil import synth_dump


def test_matching_dumps_return_the_report(tmp_path):
    a, b = synth_dump(tmp_path / "a"), synth_dump(tmp_path / "b")
    report = assert_dumps_match(a, b, threshold=1e-9, token_threshold=1e-9)
    assert isinstance(report, Report) and report.passed and report.matched == 3


def test_divergence_raises_with_the_layer_table(tmp_path):
    a, bad = synth_dump(tmp_path / "a"), synth_dump(tmp_path / "bad", bump=(1, 5))
    with pytest.raises(AssertionError) as err:
        assert_dumps_match(a, bad)
    msg = str(err.value)
    first = msg.splitlines()[0]
    assert first.startswith("dumps diverge at layer 1 (model.layers.1.self_attn.input")
    assert "first failing token 5" in first
    assert "FIRST DIVERGENCE" in msg and "max token rel_diff" in msg and "\x1b[" not in msg
    assert "DIVERGED at layer 1" in msg
    # a loose enough threshold lets the same pair pass; keyword options reach the config
    assert assert_dumps_match(a, bad, threshold=2.0, token_threshold=2.0, threads=1).passed


def test_unusable_input_is_not_an_assertion(tmp_path):
    a, other = synth_dump(tmp_path / "a"), synth_dump(tmp_path / "o", hidden=8)
    with pytest.raises(NotComparableError):
        assert_dumps_match(a, other)


def test_regress_gates_a_run_against_its_store(tmp_path):
    """``comparator.testing.regress`` in a user's suite: a bootstrapped baseline, a bumped run that fails
    (exit 1, stored as failed evidence), and a clean re-run that still passes against the first baseline."""
    store = tmp_path / "store"
    base, bad, again = (synth_dump(tmp_path / n, bump=b) for n, b in (("base", None), ("bad", (1, 5)), ("again", None)))
    first = regress(base, store, bootstrap=True)
    assert isinstance(first, RegressResult) and first and first.label == "baseline" and first.report is None
    assert first.message.startswith(f"{BOOTSTRAP}: ")
    failed = regress(bad, store)
    assert failed.exit_code == EXIT_DIVERGED and not failed and failed.label == "failed"
    assert failed.baseline_run == first.run_id and failed.report.first_divergent.layer == 1
    assert failed.message.startswith(f"{FAIL}: stored run {failed.run_id} as failed")
    ok = regress(again, store)
    assert ok.exit_code == EXIT_OK and ok.baseline_run == first.run_id, "a failed run became the baseline"
    assert ok.message.startswith(f"{PASS}: stored run {ok.run_id} as passed") and ok.report.matched == 3
    assert [e.record.label for e in RunStore(store).runs()] == ["baseline", "failed", "passed"]
