"""Helpers for users' own test suites: assert that two dumps match, or regress against a store.

Example (pytest)::

    from comparator.testing import assert_dumps_match

    def test_fused_attention_matches_eager(tmp_path):
        ...  # dump both paths with dumper.capture
        report = assert_dumps_match(tmp_path / "eager", tmp_path / "fused", threshold=1e-4)
        assert report.matched > 0

On a divergence the ``AssertionError`` message holds the first divergent layer and token and
the rendered per-layer table, so the pytest failure output alone says where it broke.
"""

from __future__ import annotations

import io
import os
from typing import Any

from rich.console import Console

from comparator.config import CompareConfig
from comparator.hidden.compare import compare_dumps
from comparator.hidden.types import Report
from comparator.outcome import assertion_head
from comparator.reports.text import render_report
from comparator.store.regress import RegressResult, regress

__all__ = ["assert_dumps_match", "regress", "RegressResult", "render_to_string"]


def render_to_string(report: Report, *, tensors: bool = False, width: int = 160) -> str:
    """The per-layer table and verdict lines as plain text (no colour codes)."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None, no_color=True)
    render_report(report, console, tensors=tensors)
    return buf.getvalue()


def assert_dumps_match(
    baseline: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    threshold: float | None = None,
    token_threshold: float | None = None,
    **kw: Any,
) -> Report:
    """Compare two dumps; return the :class:`Report` when they match, raise ``AssertionError`` when not.

    Args:
        baseline, target: dump directories.
        threshold, token_threshold: rel_diff thresholds (default: env vars, then 1e-3).
        **kw: other :meth:`CompareConfig.resolve` arguments (``threads``, ``logprob_thresholds``
            as ``{name: value}``, ``model``).

    Unusable input (a broken dump, zero matched tensors) raises the comparator's
    :class:`~dumper.errors.DriftscopeError`, not ``AssertionError``: it is not a divergence.
    """
    config = CompareConfig.resolve(threshold=threshold, token_threshold=token_threshold, **kw)
    report = compare_dumps(baseline, target, config)
    if report.passed:
        return report
    raise AssertionError(f"{assertion_head(report)}\n{render_to_string(report)}")
