"""The outcome of a comparison and the words every output writes for it.

One place for ``PASS`` / ``FAIL`` / ``DIVERGED`` / ``UNUSABLE`` / ``BOOTSTRAP``, for why a report
did not pass (:class:`Outcome`: a tensor diverged, replicas differ, the logprobs fail), and for
the one-line summaries built from them: the terminal verdict, ``--quiet``, Markdown, HTML,
:mod:`comparator.testing`'s assertion message, the store's listings and ``regress`` messages,
and the dumper's ``selfcheck`` lines. A new output uses these instead of spelling the words again.

Nothing here imports a result type at run time (they import this module's words), so every
module of the comparator may use it; the functions read the reports they are given.

Example::

    from comparator.outcome import Outcome, headline
    Outcome.of(report)          # Outcome.TENSORS: a matched tensor diverged
    print(headline(report))     # "DIVERGED at layer 3 (model.layers.3.self_attn.input, pass 0, rank 0), ..."
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from comparator.logprobs import Located, LogprobVerdict
    from comparator.hidden.types import FirstDivergence, Report

__all__ = ["PASS", "FAIL", "DIVERGED", "UNUSABLE", "BOOTSTRAP", "Outcome", "status", "headline", "clause",
           "sentence", "assertion_head", "describe_divergence", "threshold_summary", "verdict_notes",
           "reaches_output", "format_float", "format_ratio", "format_located"]

PASS = "PASS"
"""Every compared value is within its threshold (exit 0)."""
FAIL = "FAIL"
"""One row, tensor, run or logprob verdict over its threshold."""
DIVERGED = "DIVERGED"
"""A whole comparison that did not pass (exit 1)."""
UNUSABLE = "UNUSABLE"
"""Nothing could be judged: the input cannot be compared (exit 2)."""
BOOTSTRAP = "BOOTSTRAP"
"""``regress`` stored a first baseline and compared nothing (exit 0)."""


def status(passed: bool, why: str | int | None = None) -> str:
    """``PASS``, ``FAIL`` or ``FAIL (why)``: the word for one row, tensor, run or logprob verdict."""
    if passed:
        return PASS
    return FAIL if why is None or why == "" else f"{FAIL} ({why})"


class Outcome(enum.Enum):
    """Why a report passed or not, checked in this order: the first one that holds is the outcome."""

    PASSED = "passed"
    TENSORS = "tensors"
    """A matched tensor is over its threshold (``report.first_divergent`` says where)."""
    REPLICAS = "replicas"
    """Ranks that should hold identical rows (replicated under TP) differ."""
    LOGPROBS = "logprobs"
    """The hidden states pass (or were not compared) but the logprobs fail their thresholds."""

    @classmethod
    def of(cls, report: Report) -> Outcome:
        if report.passed:
            return cls.PASSED
        if report.first_divergent is not None:
            return cls.TENSORS
        return cls.REPLICAS if report.replica_mismatches else cls.LOGPROBS

    @property
    def passed(self) -> bool:
        return self is Outcome.PASSED

    @property
    def word(self) -> str:
        """``PASS`` or ``DIVERGED``."""
        return PASS if self.passed else DIVERGED


def _failures(report: Report) -> str:
    return ", ".join(report.logprobs.failures()) if report.logprobs is not None else ""


def clause(report: Report, *, escape: Callable[[str], str] = str, detail: bool = True) -> str:
    """What follows the word on a verdict line; empty on a pass.

    ``at layer 3 (...); rel_diff 2.1e-02`` (``escape``-d: it holds names from the dump),
    ``(replicas differ)``, ``(logprobs: mse, kl_max)`` (``(logprobs)`` without ``detail``).
    """
    outcome = Outcome.of(report)
    if outcome is Outcome.TENSORS:
        assert report.first_divergent is not None
        return escape(describe_divergence(report.first_divergent))
    if outcome is Outcome.REPLICAS:
        return "(replicas differ)"
    if outcome is Outcome.LOGPROBS:
        return f"(logprobs: {_failures(report)})" if detail else "(logprobs)"
    return ""


def headline(report: Report, *, escape: Callable[[str], str] = str) -> str:
    """The verdict in one line: ``PASS``, ``DIVERGED at layer ...``, ``DIVERGED (replicas differ)``,
    ``DIVERGED (logprobs: mse)``; what ``--quiet`` prints before its notes."""
    rest = clause(report, escape=escape)
    return f"{Outcome.of(report).word} {rest}" if rest else Outcome.of(report).word


def sentence(report: Report) -> str:
    """The verdict as a sentence under a ``PASS`` / ``DIVERGED`` heading (the HTML page)."""
    outcome = Outcome.of(report)
    if outcome is Outcome.TENSORS:
        assert report.first_divergent is not None
        return describe_divergence(report.first_divergent)
    return {Outcome.PASSED: "every matched tensor passed", Outcome.REPLICAS: "replicas differ",
            Outcome.LOGPROBS: "the logprobs fail their thresholds"}[outcome]


def assertion_head(report: Report) -> str:
    """The first line of :func:`comparator.testing.assert_dumps_match`'s ``AssertionError``."""
    outcome = Outcome.of(report)
    if outcome is Outcome.TENSORS:
        assert report.first_divergent is not None
        return f"dumps diverge {describe_divergence(report.first_divergent)}"
    if outcome is Outcome.REPLICAS:
        return "dumps diverge: ranks that should hold identical rows differ"
    return f"dumps diverge in their logprobs: {_failures(report)}"


# --------------------------------------------------------------------------- numbers in words


def format_float(v: float | None) -> str:
    """A metric in text: ``1.234e-03``, ``0`` (bit-identical), ``inf``, ``nan`` (``nan`` also for None)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if math.isinf(v):
        return "inf"
    return "0" if v == 0 else f"{v:.3e}"


def format_ratio(v: float | None) -> str:
    """A multiple (of noise, or a growth factor): ``2.1e+06x``, ``-`` when unknown."""
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return "inf"
    return f"{v:.3g}x"


def format_located(loc: Located) -> str:
    """A max-type logprob value with where it sits: ``1.900e-03 (request 0, position 57)``, ``-`` when not computed."""
    if loc.value is None:
        return "-"
    return f"{format_float(loc.value)} (request {loc.request}, position {loc.position})"


# --------------------------------------------------------------------------- one-line summaries


def _ranges(ranges: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


_METHOD = {"calibrated": "over its calibrated noise", "change-point": "estimated from the run: change point",
           "threshold": "first over the threshold"}


def describe_divergence(fd: FirstDivergence) -> str:
    """One sentence: where the first divergence is, which sequence and tokens fail, and why it may be."""
    where = f"layer {fd.layer}" if fd.layer is not None else "a tensor without layer"
    text = f"at {where} ({fd.name}, pass {fd.forward_pass}, rank {fd.rank})"
    if fd.onset is not None and fd.onset != fd.token:
        text += f", divergence starts at token {fd.onset} ({_METHOD[fd.onset_method or 'threshold']})"
    if fd.token is not None:
        text += f", first failing token {fd.token}"
    if fd.sequence is not None:
        text += f" of sequence {fd.sequence}"
    if fd.note:
        text += f" ({fd.note})"
    if fd.worst_token is not None:
        text += f", worst token {fd.worst_token}"
    if fd.failing_ranges:
        text += f"; failing tokens {_ranges(fd.failing_ranges)}"
    if len(fd.failing_sequences) > 1:
        text += f"; failing sequences {fd.failing_sequences}"
    if fd.onset_layer is not None and fd.onset_layer != fd.layer:
        text += (f"; first departs from noise at layer {fd.onset_layer} "
                 f"({_METHOD[fd.onset_layer_method or 'threshold']})")
    return text + f"; rel_diff {format_float(fd.rel_diff)}"


def threshold_summary(report: Report, *, quote: Callable[[str], str] = str) -> str:
    """What the tensors were judged by: fixed thresholds, or the noise file (``quote``-d) with its factor and floor."""
    if report.noise is None:
        return (f"thresholds rel_diff <= {report.threshold:g}, "
                f"per-token rel_diff <= {report.token_threshold:g}")
    return (f"thresholds {report.noise_factor:g} x the noise in {quote(report.noise)} "
            f"(floor {report.noise_floor:g})")


def verdict_notes(report: Report) -> list[str]:
    """What every verdict line adds, ``--quiet`` included: tensors not compared, model notes."""
    unmatched = report.unmatched_note()
    return ([unmatched] if unmatched else []) + list(report.notes)


def reaches_output(report: Report) -> str:
    """One line tying the hidden-state verdict to the logprob verdict."""
    v: LogprobVerdict | None = report.logprobs
    fd = report.first_divergent
    assert v is not None
    worst = f"largest logprob error {format_located(v.max_abs_err)}"
    if v.kl_max.value is not None:
        worst += f", largest KL {format_located(v.kl_max)}"
    if fd is None:
        return f"hidden states match; logprobs {'pass' if v.passed else FAIL}: {worst}"
    if v.passed:
        return f"the divergence from layer {fd.layer} does not reach the output beyond the logprob thresholds: {worst}"
    return f"the divergence from layer {fd.layer} reaches the output: {worst}"
