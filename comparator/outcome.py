"""The outcome of a comparison and the words every output writes for it.

One place for ``PASS`` / ``FAIL`` / ``DIVERGED`` / ``UNUSABLE`` / ``BOOTSTRAP``, for why a report
did not pass (:class:`Outcome`: a tensor diverged, replicas differ, the MoE routing broke first, the
logprobs fail), and for the one-line summaries built from them: the terminal verdict, ``--quiet``,
Markdown, HTML, :mod:`comparator.testing`'s assertion message, the store's listings and ``regress``
messages, and the dumper's ``selfcheck`` lines. A new output uses these instead of spelling the words again.

Nothing here imports a result type at run time (they import this module's words), so every
module of the comparator may use it; the functions read the reports they are given.

Example::

    from comparator.outcome import Outcome, headline
    Outcome.of(report)          # Outcome.TENSORS: a matched tensor diverged
    print(headline(report))     # "DIVERGED at layer 3 (model.layers.3.self_attn.input, pass 0, rank 0), ..."
    # a MoE routing bug: "DIVERGED: routing first flips at layer 1, token 34 of sequence 1 (margin 0.0572, ...)"
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from comparator.formatting import format_float, format_located, format_ratio
from dumper.format import ROUTER_LOGITS, router_name
from dumper.format.decode import CACHE_HIT
from dumper.format.points import CACHE_POINTS, SUBLAYER_POINTS

if TYPE_CHECKING:
    from comparator.hidden.speculative_types import Acceptance
    from comparator.hidden.types import DecodeFork, FirstDivergence, Report, TensorComparison
    from comparator.logprobs import LogprobVerdict
    from comparator.routing.types import Flip, RankRouting, RouterComparison, RouterLayer

__all__ = [
    "PASS",
    "FAIL",
    "DIVERGED",
    "UNUSABLE",
    "BOOTSTRAP",
    "Outcome",
    "status",
    "headline",
    "clause",
    "sentence",
    "assertion_head",
    "describe_divergence",
    "describe_decode",
    "describe_speculative",
    "describe_acceptance",
    "acceptance_failure",
    "describe_routing",
    "routing_failures",
    "describe_rank",
    "judged_by",
    "flip_ratio",
    "flip_margin",
    "threshold_summary",
    "verdict_notes",
    "reaches_output",
]

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
    """Why a report did not pass: the first thing that broke.

    Checked in this order: a decode step without rows; the routing when its first failing layer is
    at or before the first layer whose hidden states diverge (a routing bug shows in the hidden
    states only after it); then a diverged tensor, differing replicas, the routing alone, a
    speculative target's acceptance, a decode fork the noise does not explain, the logprobs. The
    hidden states are every compared tensor but the routers' logits, which are judged as routing here.
    """

    PASSED = "passed"
    TENSORS = "tensors"
    """A matched tensor is over its threshold (``report.first_divergent`` says where)."""
    REPLICAS = "replicas"
    """Ranks that should hold identical rows (replicated under TP) differ."""
    ROUTING = "routing"
    """The MoE routing fails (``report.router``) at a layer before the hidden states diverge, or they pass."""
    LOGPROBS = "logprobs"
    """The hidden states pass (or were not compared) but the logprobs fail their thresholds."""
    KV_CACHE = "kv_cache"
    """A dump's KV cache read-back check failed: a query read a row other than the one written there
    (``report.kv_cache``; checked right after decode coverage: what every later layer read was wrong)."""
    DECODE = "decode"
    """A decode dump lacks the rows of a decode step it claims (``report.decode.missing``: checked first), or two
    decode runs forked at a step the logprob noise does not explain (checked last)."""
    ACCEPTANCE = "acceptance"
    """Two speculative decodes: the target's acceptance length falls below the baseline's by more than the
    tolerance over the steps both fed alike (``report.speculative.comparison``), while the hidden states pass."""

    @classmethod
    def of(cls, report: Report) -> Outcome:
        if report.passed:
            return cls.PASSED
        if report.decode is not None and report.decode.missing:
            return cls.DECODE
        if _readback_failure(report):
            return cls.KV_CACHE
        routing, hidden = _routing_layer(report), _first_hidden_failure(report)
        # every hidden state recorded at layer L enters layer L, before its router: routing first when L is later
        if routing is not None and hidden is not None and routing < _order(hidden):
            return cls.ROUTING  # routing broke first; the hidden states followed
        if report.first_divergent is not None and (hidden is not None or routing is None):
            return cls.TENSORS
        if report.replica_mismatches:
            return cls.REPLICAS
        if routing is not None:
            return cls.ROUTING
        if report.speculative is not None and not report.speculative.passed:
            return cls.ACCEPTANCE
        logprobs_pass = report.logprobs is None or report.logprobs.passed
        if report.decode is not None and not report.decode.passed and logprobs_pass:
            return cls.DECODE
        return cls.LOGPROBS

    @property
    def passed(self) -> bool:
        return self is Outcome.PASSED

    @property
    def word(self) -> str:
        """``PASS`` or ``DIVERGED``."""
        return PASS if self.passed else DIVERGED

    @property
    def separator(self) -> str:
        """What stands between :attr:`word` and the clause: ``": "`` before a routing clause
        (``DIVERGED: routing first flips ...``), a space otherwise (``DIVERGED at layer 3 ...``)."""
        return ": " if self is Outcome.ROUTING else " "


def _readback_failure(report: Report) -> str | None:
    """The first read-back failure of either dump, as a sentence (None: none)."""
    found = report.kv_cache.readback_sentences() if report.kv_cache is not None else []
    return found[0] if found else None


def _failures(report: Report) -> str:
    return ", ".join(report.logprobs.failures()) if report.logprobs is not None else ""


def _order(t: TensorComparison) -> float:
    """Where a tensor sits in layer order; one without a layer (the final norm, say) after every layer."""
    return math.inf if t.layer is None else t.layer


def _hidden(report: Report) -> list[TensorComparison]:
    """The compared hidden-state tensors: every tensor but the routers' logits (judged as routing)."""
    logits = {router_name(la.name, ROUTER_LOGITS) for la in report.router.layers} if report.router else set()
    return [t for t in report.tensors if t.name not in logits]


def _first_hidden_failure(report: Report) -> TensorComparison | None:
    return min((t for t in _hidden(report) if not t.passed), key=_order, default=None)


def _routing_layer(report: Report) -> float | None:
    """The first MoE layer whose routing fails (``inf`` when no MoE layer was compared: a failure too);
    None when the routing passes or was not compared."""
    if report.router is None or report.router.passed:
        return None
    la = report.router.first_failing_layer
    return math.inf if la is None else la.layer


def _routing_tail(report: Report) -> str:
    """``; routing first fails at layer 4`` after another outcome's clause; empty when the routing does not fail."""
    layer = _routing_layer(report)
    if layer is None or report.router is None:
        return ""
    return f"; routing first fails at layer {layer}" if layer != math.inf else f"; {describe_routing(report.router)}"


def _routing_clause(report: Report) -> str:
    """The routing failure, then what the hidden states did: ``...; hidden states diverge from layer 2``."""
    assert report.router is not None
    hidden = _first_hidden_failure(report)
    if hidden is not None:
        where = f"from layer {hidden.layer}" if hidden.layer is not None else f"at {hidden.name}"
        tail = f"; hidden states diverge {where}"
    else:
        tail = "; hidden states match" if _hidden(report) else ""
    return describe_routing(report.router) + tail


def clause(report: Report, *, escape: Callable[[str], str] = str, detail: bool = True) -> str:
    """What follows the word on a verdict line; empty on a pass.

    ``at layer 3 (...); rel_diff 2.1e-02`` (``escape``-d: it holds names from the dump),
    ``(replicas differ)``, ``routing first flips at layer 1, ...; hidden states diverge from layer 2``
    (also ``escape``-d), ``(logprobs: mse, kl_max)`` (``(logprobs)`` without ``detail``). After a
    diverged tensor or differing replicas, a routing that fails later adds ``; routing first fails at layer L``.
    """
    outcome = Outcome.of(report)
    if outcome is Outcome.TENSORS:
        assert report.first_divergent is not None
        return escape(describe_divergence(report.first_divergent) + _routing_tail(report) + _acceptance_tail(report))
    if outcome is Outcome.REPLICAS:
        return "(replicas differ)" + _routing_tail(report) + _acceptance_tail(report)
    if outcome is Outcome.ROUTING:
        return escape(_routing_clause(report))
    if outcome is Outcome.LOGPROBS:
        return f"(logprobs: {_failures(report)})" if detail else "(logprobs)"
    if outcome is Outcome.DECODE:
        return escape(f"({_decode_failure(report)})")
    if outcome is Outcome.KV_CACHE:
        return escape(f"({_readback_failure(report)})")
    if outcome is Outcome.ACCEPTANCE:
        return escape(f"({acceptance_failure(report)})")
    return ""


def _decode_failure(report: Report) -> str:
    """``decode coverage: ...`` (the first step without rows, and how many more) or ``decode fork: ...``."""
    assert report.decode is not None
    missing = report.decode.missing
    if missing:
        return "decode coverage: " + missing[0] + (f"; {len(missing) - 1} more" if len(missing) > 1 else "")
    fork = next(f for f in report.decode.forks if f.near_tie is False)
    return f"decode fork: {_fork(fork)}"


def headline(report: Report, *, escape: Callable[[str], str] = str) -> str:
    """The verdict in one line: ``PASS``, ``DIVERGED at layer ...``, ``DIVERGED (replicas differ)``,
    ``DIVERGED: routing first flips at layer ...``, ``DIVERGED (logprobs: mse)``; what ``--quiet``
    prints before its notes."""
    outcome, rest = Outcome.of(report), clause(report, escape=escape)
    return f"{outcome.word}{outcome.separator}{rest}" if rest else outcome.word


def _routing_passed(router: RouterComparison) -> str:
    """``; the routing agrees: 3 flips, each benign by the margin rule`` after a pass."""
    flips = "no flips" if not router.flips else f"{router.flips} flips, each benign by {judged_by(router.basis)}"
    return f"; the routing agrees: {flips}"


def sentence(report: Report) -> str:
    """The verdict as a sentence under a ``PASS`` / ``DIVERGED`` heading (the HTML page)."""
    outcome = Outcome.of(report)
    if outcome is Outcome.TENSORS:
        assert report.first_divergent is not None
        return describe_divergence(report.first_divergent) + _routing_tail(report) + _acceptance_tail(report)
    if outcome is Outcome.ROUTING:
        return _routing_clause(report)
    if outcome is Outcome.ACCEPTANCE:
        return acceptance_failure(report)
    if outcome is Outcome.PASSED and report.router is not None:
        return "every matched tensor passed" + _routing_passed(report.router)
    if outcome is Outcome.DECODE:
        return _decode_failure(report)
    if outcome is Outcome.KV_CACHE:
        return str(_readback_failure(report))
    return {
        Outcome.PASSED: "every matched tensor passed",
        Outcome.REPLICAS: "replicas differ" + _routing_tail(report),
        Outcome.LOGPROBS: "the logprobs fail their thresholds",
    }[outcome]


def assertion_head(report: Report) -> str:
    """The first line of :func:`comparator.testing.assert_dumps_match`'s ``AssertionError``."""
    outcome = Outcome.of(report)
    if outcome is Outcome.TENSORS:
        assert report.first_divergent is not None
        return f"dumps diverge {describe_divergence(report.first_divergent)}{_routing_tail(report)}"
    if outcome is Outcome.REPLICAS:
        return f"dumps diverge: ranks that should hold identical rows differ{_routing_tail(report)}"
    if outcome is Outcome.ROUTING:
        return f"dumps diverge in their routing: {_routing_clause(report)}"
    if outcome is Outcome.DECODE:
        return f"dumps diverge on their decode path: {_decode_failure(report)}"
    if outcome is Outcome.KV_CACHE:
        return f"dumps diverge in their KV cache: {_readback_failure(report)}"
    if outcome is Outcome.ACCEPTANCE:
        return f"dumps diverge in their speculative decoding: {acceptance_failure(report)}"
    return f"dumps diverge in their logprobs: {_failures(report)}"


# --------------------------------------------------------------------------- one-line summaries


def _ranges(ranges: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


_METHOD = {
    "calibrated": "over its calibrated noise",
    "change-point": "estimated from the run: change point",
    "threshold": "first over the threshold",
}


_POINT_WORDS = {
    "attn_output": "attention output",
    "mlp_input": "MLP input",
    "mlp_output": "MLP output",
    "input": "attention input",
    "residual": "residual input",
    "k_cache": "k_cache row",
    "v_cache": "v_cache row",
}
"""How a verdict names a capture point inside a layer (:mod:`dumper.format.points`)."""


_FINDING = {
    "cache": "the layer's input agrees and its KV cache row differs: the cache write or read is wrong",
    "upstream": "the layer's input already differs: the error came from upstream, and its KV cache follows it",
    "unknown": "the layer's input was not captured, so a cache fault cannot be told from an upstream one "
    "(add --points input)",
}
"""What the verdict says of :attr:`FirstDivergence.finding` (data flow through the KV cache)."""


def describe_divergence(fd: FirstDivergence) -> str:
    """One sentence: where the first divergence is (the point inside the layer, when points inside it were
    captured), which sequence and tokens fail, and why it may be."""
    where = f"layer {fd.layer}" if fd.layer is not None else "a tensor without layer"
    if fd.layer is not None and fd.point is not None and (fd.point in (*SUBLAYER_POINTS, *CACHE_POINTS) or fd.agreeing):
        where += f"'s {_POINT_WORDS.get(fd.point, fd.point)}"
    text = f"at {where} ({fd.name}, pass {fd.forward_pass}, rank {fd.rank})"
    if fd.agreeing:
        words = [_POINT_WORDS.get(p, p) for p in fd.agreeing]
        listed = f"{', '.join(words[:-1])} and {words[-1]} agree" if len(words) > 1 else f"{words[0]} agrees"
        text += f"; its {listed}"
    if fd.phase == "decode":
        text += f", decode step {fd.decode_step}"
    if fd.verify_step is not None:
        text += f", verify step {fd.verify_step}, draft index {fd.draft_index}"
    if fd.phase == CACHE_HIT:
        text += ", a row the prefix cache served (cache hit)"
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
    if fd.finding is not None:
        text += f"; {_FINDING[fd.finding]}"
    if fd.onset_layer is not None and fd.onset_layer != fd.layer:
        text += (
            f"; first departs from noise at layer {fd.onset_layer} ({_METHOD[fd.onset_layer_method or 'threshold']})"
        )
    return text + f"; rel_diff {format_float(fd.rel_diff)}"


def threshold_summary(report: Report, *, quote: Callable[[str], str] = str) -> str:
    """What the tensors were judged by: fixed thresholds, or the noise file (``quote``-d) with its factor and floor."""
    if report.noise is None:
        return f"thresholds rel_diff <= {report.threshold:g}, per-token rel_diff <= {report.token_threshold:g}"
    return f"thresholds {report.noise_factor:g} x the noise in {quote(report.noise)} (floor {report.noise_floor:g})"


def verdict_notes(report: Report) -> list[str]:
    """What every verdict line adds, ``--quiet`` included: tensors not compared, model notes, the decode path."""
    unmatched = report.unmatched_note()
    return (
        ([unmatched] if unmatched else [])
        + list(report.notes)
        + describe_decode(report)
        + describe_speculative(report)
        + describe_kv(report)
    )


def describe_kv(report: Report) -> list[str]:
    """The KV cache's lines: read-back checks and, fp8 against auto, the worst layer against fp8 rounding."""
    kv = report.kv_cache
    if kv is None:
        return []
    out = []
    checked = {side: r for side, r in kv.readback.items() if not int(r.get("failed", 0))}
    if checked:
        out.append(
            "KV cache read-back: "
            + ", ".join(
                f"{side} {int(r.get('checked', 0))} rows read, each the row written"
                for side, r in sorted(checked.items())
            )
        )
    if kv.fp8_side is not None and kv.fp8:
        worst = max(kv.fp8, key=lambda r: r.ratio)  # every row within: all finite
        out += kv.fp8_sentences() or [
            f"the {kv.fp8_side}'s fp8 KV cache is within fp8 rounding at every layer (worst: layer {worst.layer} "
            f"{worst.point} at {worst.ratio:.2f}x the rounding it predicts)"
        ]
    return out


def describe_decode(report: Report) -> list[str]:
    """What a comparison of decode dumps compared, and each fork between two decode runs, one line each."""
    d = report.decode
    if d is None:
        return []
    forked = f"; {len(d.forks)} forked (rows and logprobs from each fork on not compared)" if d.forks else ""
    return [
        f"decode: {d.steps} decode steps compared over {d.sequences} sequences{forked}",
        *(f"decode fork: {_fork(f)}" for f in d.forks),
    ]


def _length(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def describe_acceptance(a: Acceptance) -> str:
    """``target ngram:k=3: acceptance length 1.88 (0.875 drafts kept per verify step) over 8 verify steps; kept per
    draft position 1: 38% (3/8), 2: 33% (2/6), 3: 25% (1/4)``."""
    rates = ", ".join(f"{i}: {'-' if r is None else f'{r:.0%}'} ({k}/{n})" for i, n, k, r in a.rates)
    mean = "-" if a.mean_accepted is None else f"{a.mean_accepted:.3g}"
    return (
        f"{a.side} {a.setting or 'speculative'}: acceptance length {_length(a.acceptance_length)} ({mean} drafts kept "
        f"per verify step) over {a.steps} verify steps" + (f"; kept per draft position {rates}" if rates else "")
    )


def describe_speculative(report: Report) -> list[str]:
    """A comparison with a speculative side: each speculative side's acceptance and, both speculative, the
    acceptance check when it passes (a failing one is the verdict's clause)."""
    sp = report.speculative
    if sp is None:
        return []
    out = [f"speculative: {describe_acceptance(a)}" for a in sp.acceptance.values()]
    c = sp.comparison
    if c is not None and c.passed:
        drop = "" if c.drop is None else f", {_signed(-c.drop)}"
        out.append(
            f"speculative acceptance: target {_length(c.target.acceptance_length)} vs baseline "
            f"{_length(c.baseline.acceptance_length)}{drop} over the steps both fed alike "
            f"(tolerance {_percent(c.tolerance)})"
        )
    return out


def _percent(v: float) -> str:
    return f"{v * 100:g}%"


def _signed(v: float) -> str:
    return f"{v + 0.0:+.1%}"  # + 0.0: no "-0.0%"


def acceptance_failure(report: Report) -> str:
    """Why two speculative decodes fail on acceptance: both lengths over the steps both fed alike, the first
    (sequence, verify step, position, draft index) where the target kept no draft the baseline kept, and the
    layer where the hidden states first differ."""
    assert report.speculative is not None and report.speculative.comparison is not None
    c = report.speculative.comparison
    text = (
        f"speculative acceptance: target acceptance length {_length(c.target.acceptance_length)} vs baseline "
        f"{_length(c.baseline.acceptance_length)} ({_signed(-(c.drop or 0.0))}, tolerance {_percent(c.tolerance)}) "
        "over the "
        f"steps both fed alike ({c.target.steps} vs {c.baseline.steps} verify steps"
        + (f"; sequences {list(c.forked)} up to their decode fork" if c.forked else "")
        + ")"
    )
    f = c.first
    if f is not None:
        what = "rejected a draft" if f.rejected else "proposed no draft where"
        text += (
            f"; first at sequence {f.sequence}, verify step {f.step} (position {f.position}, draft index "
            f"{f.draft_index}): the target {what} the baseline accepted (its verify step {f.baseline_step}, "
            f"draft index {f.baseline_draft_index})"
        )
    if c.layer is not None:
        text += f"; the hidden states first differ at layer {c.layer}"
    else:
        text += "; the hidden states agree at every compared layer"
    return text


def _acceptance_tail(report: Report) -> str:
    """``; speculative acceptance falls: target 1.15 vs baseline 1.88`` after another outcome's clause."""
    sp = report.speculative
    if sp is None or sp.passed or sp.comparison is None:
        return ""
    c = sp.comparison
    return (
        f"; speculative acceptance falls: target acceptance length {_length(c.target.acceptance_length)} vs "
        f"baseline {_length(c.baseline.acceptance_length)}"
    )


def _fork(f: DecodeFork) -> str:
    """``sequence 0 at step 4 (position 44): baseline token 5, target token 17; a near-tie: ...``."""
    if f.near_tie is None:
        why = "not judged: " + (
            "no top-2 logprobs in the baseline (--logprobs --top-k 2)"
            if f.gap is None
            else "no logprob noise to judge by"
        )
    else:
        why = (
            f"{'a near-tie' if f.near_tie else 'a real divergence'}: baseline logprob gap "
            f"{'>= ' if f.gap_is_bound else ''}{format_float(f.gap)} vs {format_ratio(f.factor)} noise "
            f"{format_float(f.noise)}"
        )
    return (
        f"sequence {f.sequence} at step {f.step} (position {f.position}): baseline token {f.baseline_token}, "
        f"target token {f.target_token}; {why}"
    )


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


# --------------------------------------------------------------------------- routing words

_UNITS = {"calibrated": "noise", "margin rule": "the margin rule"}
"""What a flip's noise ratio is a multiple of, by its layer's basis (:data:`comparator.routing.types.CALIBRATED`,
:data:`~comparator.routing.types.MARGIN_RULE_BASIS`)."""
_JUDGED = {"calibrated": "calibrated noise", "margin rule": "the margin rule"}
"""What a layer of that basis was judged by."""


def judged_by(basis: str) -> str:
    """What a routing ``basis`` judges by, after "judged by": ``calibrated noise``, ``the margin rule``."""
    return _JUDGED.get(basis, basis)


def flip_ratio(flip: Flip, basis: str) -> str:
    """A flip's margin in units of its layer's ``basis``: ``4.29e+03x the margin rule``, ``45x noise``."""
    return f"{format_ratio(flip.noise_ratio)} {_UNITS.get(basis, basis)}"


def flip_margin(flip: Flip, basis: str) -> str:
    """``margin 0.0572, 4.29e+03x the margin rule`` (``45x noise`` when calibrated): why a flip is benign or not."""
    return f"margin {flip.margin:.3g}, {flip_ratio(flip, basis)}"


def routing_failures(layer: RouterLayer) -> list[str]:
    """Why one MoE layer's routing fails, in words (``NaN/Inf``, ``flips``, ``flip rate``, ``weights``,
    ``no tokens``); empty when it passes."""
    return [
        word
        for word, failed in (
            ("NaN/Inf", layer.nonfinite),
            ("flips", layer.failing_flips),
            ("flip rate", not layer.flip_rate_passed),
            ("weights", not layer.weights_passed),
            ("no tokens", layer.tokens == 0),
        )
        if failed
    ]


def describe_rank(r: RankRouting) -> str:
    """``target rank 1 routes layer 1 unlike rank 0: token 5 of sequence 0 to experts [3, 1], rank 0 [3, 6] ...``."""
    what = (
        f"to experts {list(r.ids)}, rank {r.reference_rank} {list(r.reference_ids)}"
        if r.ids != r.reference_ids
        else f"with other {', '.join(p.removeprefix('router.') for p in r.parts)}"
    )
    return (
        f"{r.side} rank {r.rank} routes layer {r.layer} ({r.name}) unlike rank {r.reference_rank}: token {r.token} "
        f"of sequence {r.sequence} {what} ({r.rows} rows differ, max |Δw| {format_float(r.weight_max_diff)})"
    )


def describe_routing(router: RouterComparison) -> str:
    """Why the routing fails, at its first failing layer: ranks that route unlike their lowest rank, NaN/Inf,
    a flip outside noise, too many flips, the weights."""
    la, flip = router.first_failing_layer, router.first_failing_flip
    rank = next((r for r in router.ranks if la is not None and r.layer == la.layer), None)
    if rank is not None:
        return describe_rank(rank)
    if la is None:
        return "routing passes" if router.passed else "routing compared no MoE layer: none was routed on both sides"
    if la.nonfinite:
        return f"routing has NaN/Inf at layer {la.layer} ({la.nonfinite} of {la.tokens} tokens)"
    if la.failing_flips and flip is not None:
        return (
            f"routing first flips at layer {flip.layer}, token {flip.token} of sequence {flip.sequence} "
            f"({flip_margin(flip, la.basis)})"
        )
    if not la.flip_rate_passed:
        return (
            f"routing flips too often at layer {la.layer}: {la.flips} of {la.tokens} tokens "
            f"(rate {format_float(la.flip_rate)} > {format_float(la.flip_rate_limit)})"
        )
    if not la.weights_passed:
        return (
            f"routing weights differ at layer {la.layer} with the same experts "
            f"(max |Δw| {format_float(la.weight_max_err)} > {format_float(la.weight_limit)})"
        )
    return f"routing compared no tokens at layer {la.layer}"
