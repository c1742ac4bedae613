"""Judge a target that recorded part of the baseline's rows: ``CompareConfig(subset=True, sequence_map=...)``.

Some runs record only some of the baseline's rows, by design, and are still directly
comparable with it row for row:

- a run of the baseline's prompts truncated to ``L`` tokens: by causality its rows are the
  baseline's first ``L`` positions (a prompt shorter than ``L`` is left out, so the run's
  sequence ``i`` is the baseline's ``sequence_map[i]``);
- a run whose prefix cache served the first positions of a prompt: only the rows computed on
  top of the reused KV blocks are recorded.

``python -m dumper sweep`` compares such runs against the baseline. With ``subset`` each
target row is judged against the baseline row of the same (sequence, position); baseline
rows and sequences the target does not hold are left out of the comparison (the report says
so in a note) instead of being listed as unmatched. A target position the baseline lacks is
still an error. Nothing here reads tensor data: the plan and the logprob sequences are cut.

Example::

    from comparator import CompareConfig, compare_dumps
    report = compare_dumps("dumps/full", "dumps/first-32-tokens", CompareConfig(subset=True))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from comparator.hidden.align import LogicalKey, LogicalTensor, Segment
from dumper.errors import NotComparableError
from dumper.format import PAD_SEQUENCE, DumpReader

if TYPE_CHECKING:  # a comparison without logprobs never loads them
    from comparator.logprobs.sources.source import LogprobSource
    from comparator.logprobs.types import SequenceLogprobs

__all__ = ["SUBSET_NOTE", "relabel_sequences", "subset_baseline", "subset_logprobs", "cut_tensor", "coverage"]

SUBSET_NOTE = (
    "subset comparison: only the target's rows were judged, each against the baseline's row of the "
    "same sequence and position; the baseline's other rows were not compared"
)

Interval = tuple[int, int]
"""Positions ``[start, end)``."""


def relabel_sequences(reader: DumpReader, sequence_map: Sequence[int]) -> DumpReader:
    """``reader`` with its sequence ``i`` renamed ``sequence_map[i]`` (row metadata and ``extra.input_ids``).

    The target's sequence ids are its prompts' indices; a run of some of the baseline's prompts
    says which baseline prompt each one is. Only the in-memory manifest changes.
    """
    mapping = [int(s) for s in sequence_map]
    if len(set(mapping)) != len(mapping) or any(s < 0 for s in mapping):
        raise NotComparableError(f"{reader.directory}: sequence_map {mapping} must list distinct sequence ids >= 0")

    def renamed(runs: list[list[int]] | None) -> list[list[int]] | None:
        if runs is None:
            return None
        bad = next((v for v, _ in runs if v != PAD_SEQUENCE and not 0 <= v < len(mapping)), None)
        if bad is not None:
            raise NotComparableError(
                f"{reader.directory}: sequence {bad} has no baseline sequence in the "
                f"sequence map ({len(mapping)} entries)"
            )
        return [[v if v == PAD_SEQUENCE else mapping[v], c] for v, c in runs]

    m = reader.manifest
    tensors = tuple(replace(r, sequence_ids=renamed(r.sequence_ids)) for r in m.tensors)
    inputs = list(m.extra.get("input_ids") or [])
    ids: list[list[int]] = [[] for _ in range(max(mapping, default=-1) + 1)]
    for i, s in enumerate(mapping[: len(inputs)]):
        ids[s] = list(inputs[i])
    extra = {**m.extra, "input_ids": ids}
    return DumpReader(reader.directory, replace(m, tensors=tensors, extra=extra), max_open=reader.max_open)


def coverage(segs: Sequence[Segment]) -> list[Interval]:
    """The positions ``segs`` hold, as sorted disjoint ``[start, end)`` intervals."""
    out: list[Interval] = []
    for s in sorted(segs, key=lambda s: s.pos):
        if out and out[-1][1] >= s.pos:
            out[-1] = (out[-1][0], max(out[-1][1], s.pos + s.count))
        else:
            out.append((s.pos, s.pos + s.count))
    return out


def _cut(segs: Sequence[Segment], cover: Sequence[Interval]) -> list[Segment]:
    """The parts of ``segs`` inside the intervals ``cover``."""
    out = []
    for s in segs:
        for a, b in cover:
            lo, hi = max(s.pos, a), min(s.pos + s.count, b)
            if lo < hi:
                out.append(Segment(s.rec, s.row + lo - s.pos, lo, hi - lo))
    return out


def cut_tensor(base: LogicalTensor, cover: Sequence[Interval]) -> LogicalTensor:
    """``base`` with only its rows at positions inside ``cover`` (``[start, end)`` intervals), replicas cut alike."""
    out = LogicalTensor(
        base.name,
        base.call,
        base.sequence,
        base.layer,
        base.sharded,
        by_rank={r: _cut(segs, cover) for r, segs in base.by_rank.items()},
        rows=_cut(base.rows, cover),
    )
    for ref, other in base.replicas:  # both hold the same positions: cut alike
        out.replicas.extend(zip(_cut([ref], cover), _cut([other], cover), strict=True))
    return out


def subset_baseline(
    base: dict[LogicalKey, LogicalTensor],
    target: dict[LogicalKey, LogicalTensor],
    unmatched_baseline: Sequence[str],
    label: Callable[[LogicalKey], str],
) -> tuple[dict[LogicalKey, LogicalTensor], list[str]]:
    """The baseline's logical tensors that the target holds, each cut to the target's positions,
    and ``unmatched_baseline`` without the (``label``-ed) ones the target does not hold."""
    kept = {k: cut_tensor(b, coverage(target[k].rows)) for k, b in base.items() if k in target}
    left_out = {label(k) for k in base.keys() - kept.keys()}
    return kept, [u for u in unmatched_baseline if u not in left_out]


def _cut_sequence(s: SequenceLogprobs, t: SequenceLogprobs) -> SequenceLogprobs:
    """``s`` cut to ``t``'s length, with a logprob only where ``t`` has one."""
    n = len(t.logprobs)
    keep = [v is not None for v in t.logprobs]
    lp = [v if k else None for v, k in zip(s.logprobs[:n], keep, strict=False)]
    top = None if s.top is None else [v if k else None for v, k in zip(s.top[:n], keep, strict=False)]
    return replace(
        s,
        token_ids=s.token_ids[:n],
        logprobs=lp,
        top=top,
        token_texts=None if s.token_texts is None else s.token_texts[:n],
    )


def subset_logprobs(base: LogprobSource, targ: LogprobSource) -> LogprobSource:
    """``base`` cut to what ``targ`` scores: its requests, and in each the positions it has a logprob
    (and, when both hold them, a logits row) for."""
    have = {s.request: s for s in targ.sequences}
    seqs = tuple(_cut_sequence(s, have[s.request]) for s in base.sequences if s.request in have)
    logits = base.logits
    if base.logits is not None and targ.logits is not None:
        logits = {}
        for req, (pos, rows) in base.logits.items():
            if req in targ.logits:
                sel = np.flatnonzero(np.isin(pos, targ.logits[req][0]))
                logits[req] = (pos[sel], rows[sel])
    return replace(base, sequences=seqs, logits=logits)
