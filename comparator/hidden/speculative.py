"""Speculative decoding in a comparison: verify steps and draft indices, acceptance, and acceptance between builds.

A speculative decode dump (:mod:`dumper.format.speculative`) is a decode dump whose decode passes
are verify passes: each feeds a sequence's last accepted token (draft index 0) and the drafts the
proposer made (draft indices ``1..k``); the rows of rejected drafts are left out of every
comparison (:func:`comparator.hidden.align.logical_tensors`). On top of the decode path
(:mod:`comparator.hidden.decode`) a comparison with a speculative side says:

- **Where.** The first divergent row's verify step (its index in the sequence's ``steps``) and
  draft index (``position - step.position``), the target's when it is speculative, else the
  baseline's (:func:`with_draft`): ``first_divergent.verify_step`` and ``draft_index``.
- **Per draft index.** For each draft index ``0..k``, the kept rows compared there, the largest
  per-token rel_diff over every compared hidden tensor (with the tensor, sequence and position)
  and the largest |Δlogprob| of the tokens those rows predicted (the token at ``q+1`` is
  predicted by the row at ``q``): a bug in the verify kernel that hits draft index 2 and later
  shows as indices 0 and 1 at noise and 2+ far above it (:class:`DraftIndexTable`, fed one
  comparison at a time with its per-token rel_diff, so nothing is held but one row per index).
- **Acceptance.** Each speculative side's acceptance: the mean accepted drafts per step, the
  acceptance length (mean of ``accepted + 1``: tokens per verify pass) and, per draft position
  ``i``, the share of the steps that proposed ``i`` drafts or more which kept ``i`` or more.
- **Acceptance between two builds.** When both sides are speculative, their acceptance lengths
  over the steps both fed alike (each sequence's steps whose chosen tokens all lie before its
  decode fork, if any): a target whose length is lower than the baseline's by more than
  ``acceptance_tolerance`` (relative; :data:`comparator.config.DEFAULT_ACCEPTANCE_TOLERANCE`) fails the
  comparison, naming the first (sequence, verify step, position, draft index) where the target did not keep a
  draft the baseline kept, and the layer where the hidden states first differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from comparator.hidden.speculative_types import (
    Acceptance,
    AcceptanceCheck,
    DraftIndexRow,
    FirstRejection,
    SpeculativeComparison,
)
from comparator.hidden.types import FirstDivergence, TensorComparison
from dumper.format import Manifest
from dumper.format.decode import DECODE, GENERATED_IDS, NEW_TOKENS
from dumper.format.speculative import SPECULATIVE_KEY, Step, step_at, steps_of

if TYPE_CHECKING:
    from comparator.hidden.decode import DecodePlan
    from comparator.judging.row_noise import RowKeys
    from comparator.logprobs.types import LogprobVerdict

__all__ = [
    "DraftIndexTable",
    "draft_indices",
    "acceptance",
    "with_draft",
    "compare_acceptance",
    "spec_side",
    "draft_table",
    "speculative_comparison",
]

SIDES = ("baseline", "target")


def spec_side(bm: Manifest, tm: Manifest) -> tuple[str, list[list[Step]]] | None:
    """The side whose verify steps name draft indices (the target's when it is speculative, else the baseline's),
    and its steps; None when neither side is speculative."""
    for side, m in (("target", tm), ("baseline", bm)):
        steps = steps_of(m.extra)
        if steps is not None:
            return side, steps
    return None


Spans = list[tuple[np.ndarray, np.ndarray] | None]
"""Per sequence, its steps' first positions and the positions after their kept rows (None: no steps)."""


def _spans(steps: list[list[Step]]) -> Spans:
    return [
        (
            np.fromiter((st.position for st in seq), dtype=np.int64, count=len(seq)),
            np.fromiter((st.kept_end for st in seq), dtype=np.int64, count=len(seq)),
        )
        if seq
        else None
        for seq in steps
    ]


def _draft_of(spans: Spans, sequences: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    draft = np.full(positions.shape, -1, dtype=np.int64)
    step = np.full(positions.shape, -1, dtype=np.int64)
    for s in np.unique(sequences).tolist():
        span = spans[s] if 0 <= s < len(spans) else None
        if span is None:
            continue
        starts, ends = span
        rows = np.flatnonzero(sequences == s)
        q = positions[rows]
        i = np.searchsorted(starts, q, side="right") - 1  # steps tile the kept positions in order
        ok = i >= 0
        ok[ok] &= q[ok] < ends[i[ok]]
        draft[rows[ok]] = q[ok] - starts[i[ok]]
        step[rows[ok]] = i[ok]
    return draft, step


def draft_indices(
    steps: list[list[Step]], sequences: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of (``sequences``, ``positions``): its draft index and its verify step's index in its sequence's
    ``steps``; -1 for a row no step keeps (a prompt row, a sequence without steps)."""
    return _draft_of(_spans(steps), sequences, positions)


# --------------------------------------------------------------------------- acceptance


def _window(steps: list[list[Step]], limits: dict[int, int] | None) -> list[list[Step]]:
    """Each sequence's steps whose chosen tokens all lie below its limit (``limits`` None: every step; a sequence
    the limits leave out, such as one with another prompt, has none)."""
    if limits is None:
        return steps
    return [[st for st in seq if st.kept_end < limits[s]] if s in limits else [] for s, seq in enumerate(steps)]


def acceptance(side: str, m: Manifest, limits: dict[int, int] | None = None) -> Acceptance:
    """``side``'s acceptance over its steps (only those before each sequence's limit, when ``limits`` are given)."""
    spec = m.extra[SPECULATIVE_KEY]
    steps = _window(steps_of(m.extra) or [], limits)
    flat = [st for seq in steps for st in seq]
    k = spec.get("num_speculative_tokens")
    top = k if isinstance(k, int) else max((st.proposed for st in flat), default=0)
    rates = []
    for i in range(1, top + 1):
        n = sum(st.proposed >= i for st in flat)
        a = sum(st.accepted >= i for st in flat)
        rates.append((i, n, a, a / n if n else None))
    return Acceptance(
        side=side,
        setting=spec.get("setting"),
        num_speculative_tokens=k,
        steps=len(flat),
        mean_accepted=float(np.mean([st.accepted for st in flat])) if flat else None,
        acceptance_length=float(np.mean([st.accepted + 1 for st in flat])) if flat else None,
        per_sequence=tuple(tuple(st.accepted for st in seq) for seq in steps),
        proposed=tuple(tuple(st.proposed for st in seq) for seq in steps),
        rates=tuple(rates),
    )


def _first_rejection(base: list[list[Step]], target: list[list[Step]]) -> FirstRejection | None:
    """The first position (lowest sequence, then position) where the baseline kept a draft (draft index >= 1) and
    the target kept none: the target's step before that position either rejected the draft there or proposed none."""
    for s in range(min(len(base), len(target))):
        b, t = base[s], target[s]
        ends = {st.kept_end: i for i, st in enumerate(t)}
        for bi, st in enumerate(b):
            for q in range(st.position + 1, st.kept_end):
                if q in ends:  # a target step's kept rows end before q: it kept no draft at q
                    prev = t[ends[q]]
                    return FirstRejection(
                        sequence=s,
                        step=ends[q],
                        position=q,
                        draft_index=q - prev.position,
                        rejected=prev.proposed > prev.accepted,
                        baseline_step=bi,
                        baseline_draft_index=q - st.position,
                    )
    return None


def compare_acceptance(
    bm: Manifest, tm: Manifest, plan: DecodePlan | None, fd: FirstDivergence | None, tolerance: float
) -> AcceptanceCheck:
    """The acceptance of two speculative sides over the steps both fed alike (:func:`_window`, cut at each
    sequence's decode fork), and whether the target's acceptance length falls short of the baseline's by more
    than ``tolerance``."""
    limits = dict(plan.limits) if plan is not None else None
    base, targ = acceptance("baseline", bm, limits), acceptance("target", tm, limits)
    drop = None
    if base.acceptance_length and targ.acceptance_length is not None:
        drop = 1.0 - targ.acceptance_length / base.acceptance_length
    first = None
    if drop is not None and drop > tolerance:
        first = _first_rejection(_window(steps_of(bm.extra) or [], limits), _window(steps_of(tm.extra) or [], limits))
    forked = tuple(sorted({f[0] for f in plan.forks})) if plan is not None else ()
    return AcceptanceCheck(
        baseline=base,
        target=targ,
        tolerance=tolerance,
        drop=drop,
        first=first,
        layer=None if fd is None else fd.layer,
        forked=forked,
    )


# --------------------------------------------------------------------------- where the first divergence is


def with_draft(fd: FirstDivergence | None, bm: Manifest, tm: Manifest) -> FirstDivergence | None:
    """``fd`` with the verify step and draft index of its first failing row when that is a decode row kept by a
    speculative side's step (the target's when it is speculative, else the baseline's); the forward pass is then
    that step's (a position may also sit in an earlier pass that rejected its draft)."""
    if fd is None or fd.phase != DECODE or fd.token is None or fd.sequence is None:
        return fd
    found = spec_side(bm, tm)
    if found is None:
        return fd
    side, steps = found
    if not 0 <= fd.sequence < len(steps):
        return fd
    hit = step_at(steps[fd.sequence], fd.token)
    if hit is None:
        return fd
    index, st = hit
    # with_phase named the decode side's pass (the target's unless only the baseline decodes): the step's, if this one
    same = side == "target" or not _decodes(tm)
    return replace(
        fd,
        verify_step=index,
        draft_index=fd.token - st.position,
        forward_pass=st.forward_pass if same else fd.forward_pass,
    )


def _decodes(m: Manifest) -> bool:
    """Whether ``m`` holds decode steps (as :mod:`comparator.hidden.decode` reads a side)."""
    return m.extra.get(GENERATED_IDS) is not None and bool(m.extra.get(NEW_TOKENS))


# --------------------------------------------------------------------------- per draft index


class DraftIndexTable:
    """Per draft index, the largest per-token rel_diff of the compared hidden tensors and where it is.

    Fed each comparison with its per-token rel_diff and its rows' (sequence, position) as the
    comparison streams (a row sink of :func:`comparator.hidden.compare.compare_dumps`); holds one
    maximum per index and the set of rows seen, never a tensor.
    """

    def __init__(self, side: str, steps: list[list[Step]], k: int | None) -> None:
        self.side, self.steps, self._spans = side, steps, _spans(steps)
        top = max((st.proposed for seq in steps for st in seq), default=0)
        self.k = max(top, k or 0)
        self._rows: list[set[int]] = [set() for _ in range(self.k + 1)]
        self._values = [0] * (self.k + 1)
        self._max: list[tuple[float, str, int, int] | None] = [None] * (self.k + 1)

    def add(self, t: TensorComparison, token: np.ndarray, keys: RowKeys | None) -> None:
        if keys is None or t.replica_side is not None or token.size == 0:
            return  # a replica rank's rows are the representative's positions again
        seqs, pos = keys
        draft, _ = _draft_of(self._spans, seqs, pos)
        values = np.where(np.isnan(token), np.inf, token)
        for i in np.unique(draft[draft >= 0]).tolist():
            rows = np.flatnonzero(draft == i)
            self._values[i] += rows.size
            self._rows[i].update((seqs[rows] * (1 << 32) + pos[rows]).tolist())
            j = rows[int(np.argmax(values[rows]))]
            best = self._max[i]
            if best is None or values[j] > best[0]:
                self._max[i] = (float(values[j]), t.name, int(seqs[j]), int(pos[j]))

    def finish(self, logprobs: LogprobVerdict | None) -> tuple[DraftIndexRow, ...]:
        """The table, with the largest |Δlogprob| of the tokens predicted from each index's rows (from the logprob
        verdict's per-position values: the token at ``q+1`` is predicted by the row at ``q``)."""
        lp: list[tuple[int, float, int, int] | None] = [None] * (self.k + 1)  # (tokens, max, sequence, position)
        for series in logprobs.series if logprobs is not None else ():
            if not series.request.isdigit() or series.positions.size == 0:
                continue
            s = int(series.request)
            pos = np.asarray(series.positions, dtype=np.int64)
            draft, _ = _draft_of(self._spans, np.full(pos.shape, s, dtype=np.int64), pos - 1)
            delta = np.abs(series.delta)
            delta = np.where(np.isnan(delta), np.inf, delta)
            for i in np.unique(draft[draft >= 0]).tolist():
                rows = np.flatnonzero(draft == i)
                j = rows[int(np.argmax(delta[rows]))]
                prev = lp[i]
                count = rows.size + (prev[0] if prev else 0)
                if prev is None or delta[j] > prev[1]:
                    lp[i] = (count, float(delta[j]), s, int(pos[j]))
                else:
                    lp[i] = (count, *prev[1:])
        out = []
        for i in range(self.k + 1):
            m, p = self._max[i], lp[i]
            out.append(
                DraftIndexRow(
                    draft_index=i,
                    rows=len(self._rows[i]),
                    values=self._values[i],
                    max_token_rel_diff=None if m is None else m[0],
                    tensor=None if m is None else m[1],
                    sequence=None if m is None else m[2],
                    position=None if m is None else m[3],
                    tokens=0 if p is None else p[0],
                    max_abs_logprob_diff=None if p is None else p[1],
                    logprob_sequence=None if p is None else p[2],
                    logprob_position=None if p is None else p[3],
                )
            )
        return tuple(out)


def speculative_comparison(
    table: DraftIndexTable,
    bm: Manifest,
    tm: Manifest,
    logprobs: LogprobVerdict | None,
    plan: DecodePlan | None,
    fd: FirstDivergence | None,
    tolerance: float,
) -> SpeculativeComparison:
    """What :func:`comparator.hidden.compare.compare_dumps` reports of a comparison with a speculative side."""
    sides = {side: m for side, m in zip(SIDES, (bm, tm), strict=True) if steps_of(m.extra) is not None}
    both = len(sides) == 2
    return SpeculativeComparison(
        draft_side=table.side,
        acceptance={side: acceptance(side, m) for side, m in sides.items()},
        draft_index=table.finish(logprobs),
        comparison=compare_acceptance(bm, tm, plan, fd, tolerance) if both else None,
    )


def draft_table(bm: Manifest, tm: Manifest) -> DraftIndexTable | None:
    """The per-draft-index table to fill during a comparison (None: neither side is speculative)."""
    found = spec_side(bm, tm)
    if found is None:
        return None
    side, steps = found
    k = (tm if side == "target" else bm).extra[SPECULATIVE_KEY].get("num_speculative_tokens")
    return DraftIndexTable(side, steps, k if isinstance(k, int) else None)
