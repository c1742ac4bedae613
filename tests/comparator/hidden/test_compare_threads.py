"""Comparisons run several at a time (``CompareConfig.threads``): the report is the same as one at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps
from dumper.errors import NotComparableError

LAYERS, TOKENS, HIDDEN = 6, 40, 64
BUG_LAYER, BUG_TOKEN = 3, 17


def _write(out: Path, *, bug: float = 0.0, sequences: int = 3, chunked: bool = False) -> Path:
    """Hidden states of ``sequences`` prompts through ``LAYERS`` layers; with ``bug``, one token of one layer
    (and every later layer, as a real bug propagates) moves by ``bug``; ``chunked`` splits each prompt in two
    forward passes."""
    gen = torch.Generator().manual_seed(0)
    with dumper.capture(None, out) as cap:
        for seq in range(sequences):
            rows = [torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float32) for _ in range(LAYERS)]
            for layer in range(BUG_LAYER, LAYERS):
                if seq == 1:
                    rows[layer][BUG_TOKEN] += bug
            cuts = [(0, 23), (23, TOKENS)] if chunked else [(0, TOKENS)]
            for lo, hi in cuts:
                for layer, x in enumerate(rows):
                    cap.record(f"model.layers.{layer}.self_attn.input", x[lo:hi], layer=layer, point="input",
                               positions=range(lo, hi), sequence_ids=[seq] * (hi - lo))
                cap.step()
    return out


@pytest.mark.parametrize("chunked", [False, True])
def test_the_report_does_not_depend_on_the_thread_count(tmp_path: Path, chunked: bool) -> None:
    base = _write(tmp_path / "base")
    target = _write(tmp_path / "target", bug=0.5, chunked=chunked)
    reports = [compare_dumps(base, target, CompareConfig(threads=n)) for n in (1, 2, 4)]
    for r in reports:
        assert not r.passed
        assert (r.first_divergent.layer, r.first_divergent.sequence, r.first_divergent.token) == (BUG_LAYER, 1,
                                                                                                  BUG_TOKEN)
        assert repr(r.tensors) == repr(reports[0].tensors)  # every statistic, bit for bit, in the same order
        assert r.first_divergent == reports[0].first_divergent and r.amplification == reports[0].amplification


def test_a_comparison_that_fails_is_raised_with_several_running(tmp_path: Path) -> None:
    base = _write(tmp_path / "base")
    with dumper.capture(None, tmp_path / "target") as cap:  # sequence 2 of layer 4 on other positions
        gen = torch.Generator().manual_seed(0)
        for seq in range(3):
            for layer in range(LAYERS):
                x = torch.randn(TOKENS, HIDDEN, generator=gen)
                lo = 5 if (seq, layer) == (2, 4) else 0
                cap.record(f"model.layers.{layer}.self_attn.input", x[lo:], layer=layer, point="input",
                           positions=range(lo, TOKENS), sequence_ids=[seq] * (TOKENS - lo))
            cap.step()
    with pytest.raises(NotComparableError):
        compare_dumps(base, tmp_path / "target", CompareConfig(threads=2))
