"""The decode path in a comparison: which phase a divergence is in, decode coverage, and forks.

A ``--new-tokens`` dump (:mod:`dumper.format.decode`) meets either its prefill counterpart
(``--tokens-from``: the same tokens, so every row has a partner) or another decode run. Three
things differ from a prefill comparison:

- **Phase.** The first divergent row is named with its phase (``first_divergent.phase``,
  ``decode_step``): a row at or past its prompt's length is a decode row, whatever engine wrote it.
- **Coverage.** A dump that claims N decode steps must hold each step's rows at every hidden
  tensor it recorded for that sequence; a missing step is a failure naming it, never a pass on
  fewer rows.
- **Forks.** Two decode runs feed back what they generated; once a sequence's generated tokens
  differ, its later rows see different inputs. Rows and logprobs from the fork's position on
  are not compared (nor counted as failures); the fork is reported with both tokens and whether
  it is a near-tie: the baseline's logprob gap between its token and the target's at that step,
  within :data:`NEAR_TIE` times the logprob noise (the largest |Δlogprob| measured on
  the positions both fed alike, or the calibrated noise when larger).

Nothing here reads tensor data: cuts act on the plan and on the logprob sequences.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from comparator.config import CompareConfig
from comparator.hidden.align import LogicalKey, LogicalTensor
from comparator.hidden.subset import Interval, coverage, cut_tensor
from comparator.hidden.types import DecodeComparison, DecodeFork, FirstDivergence
from dumper.errors import NotComparableError
from dumper.format import LOGITS_POINT, LOGPROB_POINT, ROUTER_CHOICE_POINT, Manifest
from dumper.format.decode import (
    CACHE_HIT,
    DECODE,
    GENERATED_IDS,
    NEW_TOKENS,
    NEXT_IDS,
    PREFILL,
    PROMPT_LENGTHS,
    generated_ids,
    prompt_lengths,
    record_phase,
)
from dumper.format.points import CACHE_POINTS
from dumper.format.speculative import SPECULATIVE_KEY, rejected_ranges

if TYPE_CHECKING:
    from comparator.logprobs.sources.source import LogprobSource
    from comparator.logprobs.types import LogprobVerdict, SequenceLogprobs

__all__ = [
    "NEAR_TIE",
    "DecodePlan",
    "decode_plan",
    "with_phase",
    "with_cache_phase",
    "cut_plan",
    "cut_to_common",
    "cut_logprobs",
    "fork_noise",
    "judge_forks",
    "phase_noise_warnings",
]

NEAR_TIE = 10.0
"""A fork is a near-tie when the baseline's logprob gap between the two tokens is within this many times the noise."""

_NOT_HIDDEN = (LOGPROB_POINT, LOGITS_POINT, ROUTER_CHOICE_POINT)


class DecodePlan:
    """What the decode path means for one comparison, from the two manifests alone.

    ``limits``: per sequence, the first position not compared (a fork, or the end of the shorter
    decode); ``forks``: (sequence, step, position, baseline token, target token) per fork;
    ``missing``: coverage failures of either side; ``lengths``/``steps``: where each sequence's
    decode part begins and how many decode steps (fed tokens) each side recorded.
    """

    def __init__(self) -> None:
        self.limits: dict[int, int] = {}
        self.forks: list[tuple[int, int, int, int, int]] = []
        self.missing: list[str] = []
        self.lengths: dict[int, int] = {}
        self.steps: dict[int, int] = {}

    def cut(
        self, base: dict[LogicalKey, LogicalTensor], target: dict[LogicalKey, LogicalTensor]
    ) -> tuple[dict[LogicalKey, LogicalTensor], dict[LogicalKey, LogicalTensor]]:
        """Both sides' tensors cut to what is compared: positions below each sequence's limit, and where a
        coverage failure left a hole, the positions both sides hold."""
        if self.limits:
            base, target = cut_plan(base, self.limits), cut_plan(target, self.limits)
        return cut_to_common(base, target) if self.missing else (base, target)

    def decode_rows(
        self, positions: np.ndarray | None, sequences: np.ndarray | None, sequence: int | None
    ) -> np.ndarray | None:
        """Which of a comparison's rows are decode rows: at or past their sequence's prompt length (the rule of
        :func:`coverage_failures`); ``sequences`` per row, else every row is of ``sequence``. None without positions."""
        if positions is None:
            return None
        if sequences is None:
            start = self.lengths.get(sequence) if sequence is not None else None
            return np.zeros(positions.shape, dtype=bool) if start is None else positions >= start
        starts = np.full(sequences.shape, -1, dtype=np.int64)  # -1: a sequence without a decode part
        for s, n in self.lengths.items():
            starts[sequences == s] = n
        return (starts >= 0) & (positions >= starts)

    def summary(self, forks: tuple[DecodeFork, ...]) -> DecodeComparison:
        compared = sum(
            min(self.steps[s], max(self.limits.get(s, self.lengths[s] + self.steps[s]) - self.lengths[s], 0))
            for s in self.steps
        )
        return DecodeComparison(sequences=len(self.steps), steps=compared, forks=forks, missing=tuple(self.missing))


def _is_decode(m: Manifest) -> bool:
    return m.extra.get(GENERATED_IDS) is not None and bool(m.extra.get(NEW_TOKENS))


def decode_plan(bm: Manifest, tm: Manifest, where: tuple[str, str]) -> DecodePlan | None:
    """The decode plan of a comparison (None when neither side holds a decode part).

    Raises NotComparableError when a ``--tokens-from`` side was not made from the other side's tokens.
    """
    sides = [(m, w) for m, w in zip((bm, tm), where, strict=True) if _is_decode(m)]
    if not sides:
        return None
    plan = DecodePlan()
    for m, w in sides:
        plan.missing += coverage_failures(m, w)
    if len(sides) == 2:
        _forks(plan, bm, tm)
    else:
        decode, other = (bm, tm) if sides[0][0] is bm else (tm, bm)
        _check_counterpart(decode, other, where[1] if other is tm else where[0], sides[0][1])
        scores_last = other.extra.get(NEXT_IDS) is not None  # else an engine that scores no token past its input
        for s, (n, g) in enumerate(
            zip(prompt_lengths(decode.extra) or [], generated_ids(decode.extra) or [], strict=True)
        ):
            plan.lengths[s], plan.steps[s] = n, max(len(g) - 1, 0)
            if not scores_last and other.extra.get(PROMPT_LENGTHS) is not None and g:
                plan.limits[s] = n + len(g) - 1  # the last generated token's logprob has no counterpart
    return plan


def _check_counterpart(decode: Manifest, other: Manifest, where: str, decode_where: str) -> None:
    """A prefill side must have fed the decode side's prompts and generated tokens (what ``--tokens-from`` does);
    a prefill of the prompts alone, which holds none of the decode rows, is refused with the command that makes one.
    A prefill of longer inputs of its own (or none recorded) is left to the rows and logprobs to judge."""
    inputs = other.extra.get("input_ids")
    if inputs is None:
        return
    prompts, generated = decode.extra.get("input_ids") or [], generated_ids(decode.extra) or []
    fed = [list(p) + list(g[:-1]) for p, g in zip(prompts, generated, strict=True)]
    if other.extra.get(PROMPT_LENGTHS) is None:
        if any(len(b) < len(a) for a, b in zip(fed, inputs, strict=False)):
            raise NotComparableError(
                f"{where}: holds no rows of the decode steps of {decode_where} (a prefill of the "
                "prompts only); make the prefill counterpart with python -m dumper run "
                f"--tokens-from {decode_where} ..."
            )
        return
    for s, (a, b) in enumerate(zip(fed, inputs, strict=False)):
        if list(a) != list(b):
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            raise NotComparableError(
                f"{where}: sequence {s} differs at position {i} from the tokens the decode "
                "dump fed back: it was not made with --tokens-from that dump"
            )


def _forks(plan: DecodePlan, bm: Manifest, tm: Manifest) -> None:
    """Per sequence of two decode dumps: the first step whose generated tokens differ, and where comparing stops."""
    pb, pt = bm.extra.get("input_ids") or [], tm.extra.get("input_ids") or []
    gb, gt = generated_ids(bm.extra) or [], generated_ids(tm.extra) or []
    for s in range(min(len(gb), len(gt))):
        if list(pb[s]) != list(pt[s]):
            continue  # different prompts: the prefill rows say so
        n = min(len(gb[s]), len(gt[s]))
        fork = next((i for i in range(n) if gb[s][i] != gt[s][i]), None)
        plan.lengths[s], plan.steps[s] = len(pb[s]), max(n - 1, 0)
        plan.limits[s] = len(pb[s]) + (n if fork is None else fork)
        if fork is not None:
            plan.forks.append((s, fork, len(pb[s]) + fork, gb[s][fork], gt[s][fork]))


def coverage_failures(m: Manifest, where: str) -> list[str]:
    """Each (tensor, sequence) of a decode dump that lacks rows of a decode step, named by its first missing step;
    first, a record whose ``decode_step`` label disagrees with its rows' positions.

    A row is a decode row when its position is at or past its prompt's length (decode step
    ``position - len(prompt)``): engines that mix prefill and decode rows in one pass (vLLM) label
    no record, and the rule is the same for every engine. In a speculative dump only kept rows count
    (a rejected draft's row does not cover its position) and a verify pass's label is not checked
    against its rows, which span its drafts: the rows are checked against ``extra.speculative.steps`` on load.
    """
    lengths, generated = prompt_lengths(m.extra) or [], generated_ids(m.extra) or []
    rejected = rejected_ranges(m.extra)
    speculative = m.extra.get(SPECULATIVE_KEY) is not None
    have: dict[tuple[str, int], set[int]] = defaultdict(set)  # (name, sequence) -> decode positions
    names: dict[int, set[str]] = defaultdict(set)
    wrong: list[str] = []
    for rec in m.tensors:
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        if rec.point in _NOT_HIDDEN or rec.layer is None or pos is None or seq is None:
            continue
        phase, step = record_phase(rec.meta)
        for s in np.unique(seq[(seq >= 0) & (seq < len(lengths))]).tolist():
            names[s].add(rec.name)
            at = pos[seq == s]
            cut = rejected.get((rec.forward_pass, s))
            if cut is not None:
                at = at[(at < cut[0]) | (at >= cut[1])]
            if phase == DECODE and step is not None and not speculative and not np.all(at == lengths[s] + step):
                wrong.append(
                    f"{where}: {rec.name} labels rows of sequence {s} at positions {sorted(set(at.tolist()))} "
                    f"decode step {step}, which feeds position {lengths[s] + step}"
                )
            have[rec.name, s].update(at[at >= lengths[s]].tolist())
    out = wrong[:1]
    for s, name_set in sorted(names.items()):
        want = range(lengths[s], lengths[s] + max(len(generated[s]) - 1, 0)) if s < len(generated) else range(0)
        for name in sorted(name_set):
            lacking = [p for p in want if p not in have[name, s]]
            if lacking:
                out.append(
                    f"{where}: decode step {lacking[0] - lengths[s]} of sequence {s} (position {lacking[0]}) "
                    f"has no rows at {name}" + (f" ({len(lacking)} steps missing)" if len(lacking) > 1 else "")
                )
    return out


def with_phase(fd: FirstDivergence | None, bm: Manifest, tm: Manifest) -> FirstDivergence | None:
    """``fd`` with the phase (and decode step) of its first failing row: decode when its position is at or past its
    prompt's length on either side (:func:`coverage_failures` says why by position); the note then names the step,
    and ``forward_pass`` the decode side's pass that wrote the row."""
    if fd is None or fd.token is None or fd.sequence is None:
        return fd
    lengths = prompt_lengths(tm.extra) or prompt_lengths(bm.extra) or []
    if fd.sequence < len(lengths) and fd.token >= lengths[fd.sequence]:
        step = fd.token - lengths[fd.sequence]
        side, m = ("target", tm) if _is_decode(tm) or not _is_decode(bm) else ("baseline", bm)
        found = _pass_of(m, fd.name, fd.rank, fd.sequence, fd.token)
        return replace(
            fd,
            phase=DECODE,
            decode_step=step,
            forward_pass=fd.forward_pass if found is None else found,
            note=f"token {fd.token} = decode step {step} of the {side}",
        )
    return replace(fd, phase=PREFILL)


def _pass_of(m: Manifest, name: str, rank: int, sequence: int, position: int) -> int | None:
    """The forward pass of ``m`` that wrote ``name``'s row at (``sequence``, ``position``) on ``rank``."""
    for rec in m.tensors:
        if rec.name != name or rec.rank != rank:
            continue
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        if pos is not None and seq is not None and bool(np.any((pos == position) & (seq == sequence))):
            return rec.forward_pass
    return None


def cut_plan(tensors: dict[LogicalKey, LogicalTensor], limits: dict[int, int]) -> dict[LogicalKey, LogicalTensor]:
    """``tensors`` with each sequence cut to positions below its limit (a fork, the shorter decode)."""
    return {k: cut_tensor(t, [(0, limits[k[2]])]) if k[2] in limits else t for k, t in tensors.items()}


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out = []
    i = 0
    j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def cut_to_common(
    base: dict[LogicalKey, LogicalTensor], target: dict[LogicalKey, LogicalTensor]
) -> tuple[dict[LogicalKey, LogicalTensor], dict[LogicalKey, LogicalTensor]]:
    """Both sides with each tensor they share cut to the positions both hold: a decode dump that lacks a
    step already fails by its coverage, and the rows it has are still compared."""
    b, t = dict(base), dict(target)
    for k in base.keys() & target.keys():
        cb, ct = coverage(base[k].rows), coverage(target[k].rows)
        if cb != ct:
            common = _intersect(cb, ct)
            b[k], t[k] = cut_tensor(base[k], common), cut_tensor(target[k], common)
    return b, t


def _cut_sequence(s: SequenceLogprobs, n: int) -> SequenceLogprobs:
    return replace(
        s,
        token_ids=s.token_ids[:n],
        logprobs=s.logprobs[:n],
        top=None if s.top is None else s.top[:n],
        token_texts=None if s.token_texts is None else s.token_texts[:n],
    )


def cut_logprobs(src: LogprobSource, limits: dict[int, int]) -> LogprobSource:
    """``src`` with each sequence's logprobs (and logits rows) cut to positions below its limit."""

    def limit(request: str) -> int | None:
        return limits.get(int(request)) if request.isdigit() else None

    seqs = tuple(s if limit(s.request) is None else _cut_sequence(s, limit(s.request)) for s in src.sequences)
    logits = src.logits
    if logits is not None:
        logits = {}
        for req, (pos, rows) in src.logits.items():
            n = limit(req)
            keep = np.flatnonzero(pos < n) if n is not None else None
            logits[req] = (pos, rows) if keep is None else (pos[keep], rows[keep])
    return replace(src, sequences=seqs, logits=logits)


def fork_noise(verdict: LogprobVerdict | None, config: CompareConfig) -> float | None:
    """The logprob noise a fork is judged against: the largest |Δlogprob| measured on the positions both sides
    fed alike, or the calibrated one when a noise file gives a larger one (None: no logprobs)."""
    if verdict is None:
        return None
    values = [verdict.max_abs_err.value]
    if config.noise is not None and config.noise.logprobs is not None:
        values.append(config.noise.logprobs.metrics.get("max_abs_err"))
    known = [v for v in values if v is not None and math.isfinite(v)]
    return max(known) if known else None


def judge_forks(plan: DecodePlan, base: LogprobSource | None, noise: float | None) -> tuple[DecodeFork, ...]:
    """Each fork with the baseline's logprob gap between its token and the target's, and whether that is a near-tie.

    ``base`` is the baseline's logprobs before any cut (its top-k at the fork's position gives the
    gap); ``noise`` is :func:`fork_noise`'s.
    """
    seqs = {s.request: s for s in base.sequences} if base is not None else {}
    out = []
    for s, step, pos, b_tok, t_tok in plan.forks:
        seq = seqs.get(str(s))
        top = seq.top[pos] if seq is not None and seq.top is not None and pos < len(seq.top) else None
        gap: float | None = None
        in_top = False
        if top is not None and len(top) >= 2:
            lp = dict(top)
            in_top = t_tok in lp and b_tok in lp
            gap = (lp[b_tok] - lp[t_tok]) if in_top else (top[0][1] - top[-1][1])
        near = None if gap is None or noise is None else bool(in_top and gap <= NEAR_TIE * noise)
        out.append(
            DecodeFork(
                sequence=s,
                step=step,
                position=pos,
                baseline_token=b_tok,
                target_token=t_tok,
                gap=gap,
                gap_is_bound=gap is not None and not in_top,
                noise=noise,
                near_tie=near,
                factor=NEAR_TIE,
            )
        )
    return tuple(out)


def phase_noise_warnings(plan: DecodePlan | None, config: CompareConfig, names: list[str]) -> tuple[str, ...]:
    """The warning of a comparison with decode rows judged by noise that measured none (one value for every row)."""
    if plan is None or config.noise is None or not any(plan.steps.values()):
        return ()
    entries = [e for e in map(config.noise.tensor, names) if e is not None]
    covered, blind = len(entries), [e.name for e in entries if not e.phases]
    if not blind:
        return ()
    return (
        f"{config.noise.source or 'the noise'}: calibrated without decode rows ({len(blind)} of {covered} "
        f"calibrated tensors, e.g. {blind[0]}): their decode rows are judged by noise measured on prompt rows, "
        "and decode runs kernels of its own; calibrate with decode dumps (--new-tokens) for noise per phase",
    )


def with_cache_phase(fd: FirstDivergence | None, bm: Manifest, tm: Manifest) -> FirstDivergence | None:
    """``fd`` in phase :data:`CACHE_HIT` when it is a ``k_cache``/``v_cache`` row at a position below the number of
    positions the prefix cache served its sequence on either side (that row was read from the cache, not written by
    the run); the note says which side's cache served it."""
    if fd is None or fd.point not in CACHE_POINTS or fd.token is None or fd.sequence is None:
        return fd
    for side, m in (("target", tm), ("baseline", bm)):
        hits = m.extra.get("prefix_cache_hits")
        if isinstance(hits, list) and fd.sequence < len(hits) and type(hits[fd.sequence]) is int:
            if fd.token < hits[fd.sequence]:
                note = f"the {side}'s prefix cache served positions 0..{hits[fd.sequence] - 1}"
                return replace(fd, phase=CACHE_HIT, note=note if fd.note is None else f"{fd.note}; {note}")
    return fd
