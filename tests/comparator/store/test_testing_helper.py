"""``comparator.testing.assert_dumps_match``: a pytest assertion whose message is the per-layer table."""

from __future__ import annotations

import pytest

from comparator import Report
from comparator.testing import assert_dumps_match, regress
from dumper.errors import NotComparableError
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


def test_regress_is_reexported():
    from comparator import regress as top

    assert regress is top
