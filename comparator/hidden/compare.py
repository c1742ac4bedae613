"""Compare two dumps: align rows, stream metrics piece by piece, find the first divergence.

Example::

    from comparator import compare_dumps, CompareConfig
    report = compare_dumps("dumps/one-pass", "dumps/chunked", CompareConfig(threshold=1e-3))
    print(report.passed, report.first_divergent)

Tensors whose rows carry positions are compared per (name, sequence) after reassembling
chunks, batches and ranks (see :mod:`comparator.hidden.align`); others per (name, pass, rank).
A rank whose tensor-parallel replica rows differ from its representative's is compared too
(:mod:`comparator.hidden.replicas`), so the first divergence is the lowest over all ranks.
Only the tensors being compared are touched (memory-mapped; at a URL, read by their byte ranges
into a bounded cache: :mod:`dumper.format.remote_read`), so memory stays bounded whatever the dump
size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from comparator.config import CompareConfig
from comparator.hidden.align import (
    LogicalKey,
    LogicalTensor,
    Segment,
    column_pieces,
    fallback_pairs,
    logical_tensors,
    match_rows,
    positions_of,
    split_by_mode,
)
from comparator.hidden.decode import (
    DecodePlan,
    decode_plan,
    fork_noise,
    judge_forks,
    phase_noise_warnings,
    with_cache_phase,
    with_phase,
)
from comparator.hidden.heatmap import token_heatmap
from comparator.hidden.judge import judge_tensor
from comparator.hidden.kv_cache import judge_fp8, kv_verdict
from comparator.hidden.localize import FailingTokens, first_divergence, layer_amplification, locate_onset
from comparator.hidden.metrics import PairStats, StatsAccumulator, pair_stats
from comparator.hidden.notes import dtype_note, noise_notes, replay_notes, with_row_cover
from comparator.hidden.onset import rounding_floor
from comparator.hidden.pipeline import in_order
from comparator.hidden.replicas import ReplicaView, as_rank, check_replicas
from comparator.hidden.sketch import HiddenReader, is_sketched, record_sketch_stats, sketch_readers, sketch_stats
from comparator.hidden.speculative import draft_table, speculative_comparison, with_draft
from comparator.hidden.subset import SUBSET_NOTE, relabel_sequences, subset_baseline
from comparator.hidden.types import FirstDivergence, Report, TensorComparison
from comparator.hidden.verdicts import has_logprobs, logprob_verdict, routing_verdict
from comparator.judging.identity import check_distinct, check_identity
from comparator.judging.reldiff import rel_diff_of
from comparator.judging.row_noise import RowKeys, row_keys
from dumper.errors import NotComparableError
from dumper.format import LOGITS_POINT, LOGPROB_POINT, ROUTER_CHOICE_POINT, DumpReader, Manifest, TensorRecord

__all__ = ["compare_dumps"]

ProgressFn = Callable[[int, int], None]
Tokens = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]
"""One comparison's per-token rel_diff, with the rows' positions and sequence ids (None: not recorded)."""
TokenSink = Callable[[TensorComparison, np.ndarray, "np.ndarray | None"], None]
"""Receives every comparison with its per-token rel_diff and which of its rows are decode rows (None: the
comparison holds no decode part); calibration collects them."""
RowSink = Callable[[TensorComparison, np.ndarray, "RowKeys | None"], None]
"""Receives every comparison with its per-token rel_diff and each row's (sequence, position) (None: its rows
carry no position); calibration keeps each row's noise."""


def _chunk_note(pos: int, segs: list[Segment], side: str) -> str | None:
    """Where ``pos`` sits in a side's passes, when that side split the sequence over several."""
    passes = sorted({s.rec.forward_pass for s in segs})
    if len(passes) < 2:
        return None
    for s in segs:
        if s.pos <= pos < s.pos + s.count:
            k = passes.index(s.rec.forward_pass) + 1
            where = "start" if pos == s.pos else f"inside (chunk starts at {s.pos})"
            return f"token {pos} = {where} of chunk {k}/{len(passes)} of the {side} (pass {s.rec.forward_pass})"
    return None


def _logical_stats(
    base: LogicalTensor, target: LogicalTensor, br: HiddenReader, tr: HiddenReader, config: CompareConfig
) -> tuple[PairStats, np.ndarray, int]:
    """Reassemble one (name, sequence) on both sides and stream its metrics row by row, piece by piece.

    Returns the metrics, the aligned positions and the target rank whose shard differs most.
    """
    what = f"{tr.directory}: {target.describe()}"
    pieces = column_pieces(base, target)
    positions = positions_of(base.segments(pieces[0].base_rank))
    acc = StatsAccumulator(positions.size, threads=config.threads)
    items, owners = [], []
    norms = np.zeros((positions.size, 2)) if is_sketched(base.rows[0].rec) else None  # exact ||x||^2, ||y||^2
    for p in pieces:
        for run in match_rows(base.segments(p.base_rank), target.segments(p.target_rank), what):
            idx = int(np.searchsorted(positions, run.pos))
            if idx + run.count > positions.size or positions[idx] != run.pos:
                raise NotComparableError(f"{what}: shards hold different token positions; cannot align")
            if norms is not None:  # a sketch is never a column piece: one piece, each row once
                norms[idx : idx + run.count, 0] = br.sq_norms(run.base.rec)[run.base_row : run.base_row + run.count]
                norms[idx : idx + run.count, 1] = tr.sq_norms(run.target.rec)[
                    run.target_row : run.target_row + run.count
                ]
            x = br.rows(run.base.rec)[run.base_row : run.base_row + run.count, p.base_col : p.base_col + p.width]
            y = tr.rows(run.target.rec)[
                run.target_row : run.target_row + run.count, p.target_col : p.target_col + p.width
            ]
            items.append((idx, x, y, run.base.rec.dtype, run.target.rec.dtype))
            owners.append(p.target_rank)
    per_rank: dict[int, list[float]] = {}
    sharded = len(pieces) > 1
    for rank, (dd, norm) in zip(owners, acc.add_many(items, exclusive=not sharded, piece_sums=sharded), strict=True):
        err = per_rank.setdefault(rank, [0.0, 0.0])
        err[0] += dd
        err[1] += norm
    # name the target rank whose shard differs most (all ranks are one piece when unsharded)
    rank = max(per_rank, key=lambda r: rel_diff_of(per_rank[r][0], per_rank[r][1]))
    if rank < 0:
        rank = target.rows[0].rec.rank
    return (acc.finish() if norms is None else sketch_stats(acc, norms[:, 0], norms[:, 1])), positions, rank


def _compare_logical(
    base: LogicalTensor,
    target: LogicalTensor,
    br: HiddenReader,
    tr: HiddenReader,
    config: CompareConfig,
    decode: DecodePlan | None,
) -> tuple[TensorComparison, Tokens]:
    """Compare one (name, sequence) reassembled on both sides; also its per-token rel_diff and positions."""
    stats, positions, rank = _logical_stats(base, target, br, tr, config)
    pieces = column_pieces(base, target)
    first = base.segments(pieces[0].base_rank)[0].rec
    width = sum(p.width for p in pieces)

    def notes(pos: int) -> str | None:
        return _chunk_note(pos, target.segments(pieces[0].target_rank), "target") or _chunk_note(
            pos, base.segments(pieces[0].base_rank), "baseline"
        )

    return judge_tensor(
        stats,
        config,
        name=base.name,
        layer=base.layer,
        forward_pass=first.forward_pass,
        rank=rank,
        shape=(int(positions.size), width),
        positions=positions,
        sequences=None,
        sequence=base.sequence,
        notes=notes,
        point=first.point,
        decode_rows=None if decode is None else decode.decode_rows(positions, None, base.sequence),
    ), (stats.token_rel_diff, positions, None)


def _compare_records(
    b: TensorRecord,
    t: TensorRecord,
    br: HiddenReader,
    tr: HiddenReader,
    config: CompareConfig,
    decode: DecodePlan | None,
) -> tuple[TensorComparison, Tokens]:
    """Compare one pair of tensors matched by (name, pass, rank, call); also its per-token values."""
    if b.shape != t.shape:
        raise NotComparableError(
            f"{tr.directory / t.file}: tensor {t.name!r} (pass {t.forward_pass}) has shape {list(t.shape)} "
            f"but the baseline {br.directory / b.file} has {list(b.shape)}; these dumps cannot be aligned"
        )
    stats = (
        record_sketch_stats(b, t, br, tr, config.threads)
        if is_sketched(b)
        else pair_stats(br.array(b), tr.array(t), b.dtype, t.dtype, threads=config.threads)
    )
    sequences, positions = b.row_sequence_ids(), b.row_positions()
    return judge_tensor(
        stats,
        config,
        name=b.name,
        layer=b.layer,
        forward_pass=b.forward_pass,
        rank=b.rank,
        shape=b.shape,
        positions=positions,
        sequences=sequences,
        sequence=None,
        point=b.point,
        decode_rows=None if decode is None else decode.decode_rows(positions, sequences, None),
    ), (stats.token_rel_diff, positions, sequences)


@dataclass
class _Plan:
    """What meets what, from the manifests alone: logical tensors, fallback pairs, the rest (the
    unmatched lists grow by the logprob parts one side lacks)."""

    base: dict[LogicalKey, LogicalTensor]
    target: dict[LogicalKey, LogicalTensor]
    logical: list[LogicalKey]
    """Keys on both sides, in the baseline's file order."""
    pairs: list[tuple[TensorRecord, TensorRecord]]
    unmatched_baseline: list[str]
    unmatched_target: list[str]
    empty: list[str]

    @property
    def total(self) -> int:
        return len(self.logical) + len(self.pairs)


def compare_dumps(
    baseline: str | os.PathLike[str],
    target: str | os.PathLike[str],
    config: CompareConfig | None = None,
    *,
    progress: ProgressFn | None = None,
    token_sink: TokenSink | None = None,
    row_sink: RowSink | None = None,
) -> Report:
    """Compare the dump ``target`` against the dump ``baseline``.

    Raises :class:`~dumper.errors.DumpError` for a missing, incomplete or corrupt dump and
    :class:`~dumper.errors.NotComparableError` when nothing matches or rows cannot be
    aligned; a divergence is not an exception but ``report.passed == False``.
    """
    config = config or CompareConfig()
    br, tr, notes, config = _open(baseline, target, config)
    replay = replay_notes(tr.manifest)
    decode = decode_plan(br.manifest, tr.manifest, (str(br.directory), str(tr.directory)))
    verdict, parts_b, parts_t, base_logprobs = logprob_verdict(br, tr, config, decode)
    router = routing_verdict(br, tr, config)
    br, tr, sketch = sketch_readers(br, tr)  # either side a sketch: both read as sketches (comparator.hidden.sketch)
    (bm, empty_b), (tm, empty_t) = _hidden(br.manifest), _hidden(tr.manifest)
    plan = _plan(bm, tm, br, tr, sorted(set(empty_b) | set(empty_t)))
    if decode is not None:  # nothing from a fork on; a coverage hole: the rows both hold (comparator.hidden.decode)
        plan.base, plan.target = decode.cut(plan.base, plan.target)
    if config.subset:  # judge the target's rows only (comparator.hidden.subset)
        plan.base, plan.unmatched_baseline = subset_baseline(
            plan.base, plan.target, plan.unmatched_baseline, _logical_label
        )
    plan.unmatched_baseline.extend(parts_b)  # logits rows or top-k lists on one side only: not computed
    plan.unmatched_target.extend(parts_t)
    if verdict is None:  # logprobs recorded on one side only were not compared either
        plan.unmatched_baseline.extend([LOGPROB_POINT] if has_logprobs(br.manifest) else [])
        plan.unmatched_target.extend([LOGPROB_POINT] if has_logprobs(tr.manifest) else [])
    _check_plan(plan, br, tr, config, hidden=verdict is None or bool(bm.tensors or tm.tensors))
    (replicas_b, views_b), (replicas_t, views_t) = (
        check_replicas("baseline", br, plan.base, config),
        check_replicas("target", tr, plan.target, config),
    )
    matched = set(plan.logical)
    views = [v for v in (*views_b, *views_t) if v.key in matched]  # ranks that differ: judged too
    drafts = draft_table(bm, tm)  # a speculative side: per draft index, fed as the comparisons stream
    rows = row_sink if drafts is None else _both_sinks(row_sink, drafts.add)
    results, kept = _compare_all(plan, views, br, tr, config, decode, progress, token_sink, rows)
    kv = kv_verdict(bm.extra, tm.extra)
    if kv is not None and kv.fp8_side is not None and sketch is None:  # fp8 against auto: judged by fp8 rounding
        layout = (bm if kv.fp8_side == "baseline" else tm).extra["kv_cache"]
        results, table = judge_fp8(results, plan.base, plan.target, plan.logical, br, tr, kv.fp8_side, layout)
        kv = replace(kv, fp8=table)
    fd = _first_divergent(results, kept, config, bm, tm, decode)
    # the heatmap follows the rank the divergence is on
    base_lts, targ_lts = as_rank(plan.base, plan.target, views, fd.replica_side if fd else None, fd.rank if fd else 0)
    heatmap = token_heatmap(fd, base_lts, targ_lts, lambda b, t: _logical_stats(b, t, br, tr, config)[:2])
    return Report(
        baseline=str(br.directory),
        target=str(tr.directory),
        threshold=config.threshold,
        token_threshold=config.token_threshold,
        tensors=tuple(results),
        unmatched_baseline=tuple(plan.unmatched_baseline),
        unmatched_target=tuple(plan.unmatched_target),
        first_divergent=fd,
        replica_mismatches=(*replicas_b, *replicas_t),
        logprobs=verdict,
        environment={"baseline": bm.environment, "target": tm.environment},
        heatmap=heatmap,
        notes=(
            *notes,
            *replay,
            *noise_notes(config, results, tm),
            *([sketch.note()] if sketch else []),
            *dtype_note(config, bm, tm),
        ),
        empty_tensors=tuple(plan.empty),
        sketch=sketch.to_json() if sketch else None,
        warnings=(
            *config.noise_warnings(sorted({t.name for t in results})),
            *phase_noise_warnings(decode, config, sorted({t.name for t in results})),
            *filter(None, [config.noise.sketch_warning(sketch.spec if sketch else None)] if config.noise else []),
            *(verdict.noise.warnings if verdict is not None and verdict.noise is not None else ()),
            *(router.warnings if router is not None else ()),
        ),
        noise=config.noise.source if config.noise is not None else None,
        noise_factor=config.noise_factor if config.noise is not None else None,
        noise_floor=config.noise_floor if config.noise is not None else None,
        amplification=() if replay else tuple(layer_amplification(results, config)),  # a replay has no growth
        router=router,
        decode=None
        if decode is None
        else decode.summary(judge_forks(decode, base_logprobs, fork_noise(verdict, config))),
        kv_cache=kv,
        speculative=None
        if drafts is None
        else speculative_comparison(drafts, bm, tm, verdict, decode, fd, config.acceptance_tolerance),
    )


def _both_sinks(first: RowSink | None, second: RowSink) -> RowSink:
    """One row sink calling ``first`` (if any), then ``second``."""

    def sink(t: TensorComparison, token: np.ndarray, keys: RowKeys | None) -> None:
        if first is not None:
            first(t, token, keys)
        second(t, token, keys)

    return sink


def _first_divergent(
    results: list[TensorComparison],
    kept: FailingTokens,
    config: CompareConfig,
    bm: Manifest,
    tm: Manifest,
    decode: DecodePlan | None,
) -> FirstDivergence | None:
    """The first divergence with its onset (under the dumps' rounding floor) and, in a decode comparison, its phase
    (and in a speculative one, its verify step and draft index)."""
    fd = locate_onset(
        first_divergence(results),
        results,
        kept.get,
        config,
        rounding_floor({r.dtype for m in (bm, tm) for r in m.tensors}),
    )
    fd = with_draft(with_phase(fd, bm, tm), bm, tm) if decode is not None else fd
    return with_cache_phase(fd, bm, tm)


def _open(
    baseline: str | os.PathLike[str], target: str | os.PathLike[str], config: CompareConfig
) -> tuple[DumpReader, DumpReader, list[str], CompareConfig]:
    """Both dumps' readers, refused when they cannot be compared; the model-identity notes; ``config`` with the rows
    its row noise covers in these dumps."""
    check_distinct(baseline, target)
    br, tr = DumpReader(baseline), DumpReader(target)
    if config.sequence_map:  # the target ran some of the baseline's prompts (comparator.hidden.subset)
        tr = relabel_sequences(tr, config.sequence_map)
    for reader in (br, tr):
        if not reader.manifest.tensors:
            raise NotComparableError(f"{reader.directory}: the dump captured no tensors")
    notes = check_identity(
        br.manifest,
        tr.manifest,
        allow_mismatch=config.allow_model_mismatch,
        where=f"{tr.directory} vs baseline {br.directory}",
    )
    if config.noise is not None:
        config.noise.check_baseline(br.manifest, f"the baseline {br.directory}")
    return br, tr, [*notes, *([SUBSET_NOTE] if config.subset else [])], with_row_cover(config, br.manifest, tr.manifest)


def _plan(bm: Manifest, tm: Manifest, br: HiddenReader, tr: HiddenReader, empty: list[str]) -> _Plan:
    """Match the hidden tensors of two manifests (no data read): by rows where both record positions."""
    by_rows, by_pass = split_by_mode(bm, tm)
    base_lts = logical_tensors(bm, by_rows, str(br.directory))
    targ_lts = logical_tensors(tm, by_rows, str(tr.directory))
    logical = sorted(
        base_lts.keys() & targ_lts.keys(), key=lambda k: (base_lts[k].rows[0].rec.file, base_lts[k].rows[0].rec.key, k)
    )
    pairs, only_b, only_t = fallback_pairs(bm, tm, by_pass)
    return _Plan(
        base=base_lts,
        target=targ_lts,
        logical=logical,
        pairs=sorted(pairs, key=lambda p: (p[0].file, p[0].key)),
        unmatched_baseline=sorted(
            [_logical_label(k) for k in base_lts.keys() - targ_lts.keys()] + [_label(k) for k in only_b]
        ),
        unmatched_target=sorted(
            [_logical_label(k) for k in targ_lts.keys() - base_lts.keys()] + [_label(k) for k in only_t]
        ),
        empty=empty,
    )  # no elements, nothing to compare: said, never counted as matched


def _check_plan(plan: _Plan, br: HiddenReader, tr: HiddenReader, config: CompareConfig, *, hidden: bool) -> None:
    """Refuse a plan that matches nothing (``hidden``: hidden tensors were expected, not only
    logprobs), or that leaves tensors out under ``require_all``."""
    ub, ut = plan.unmatched_baseline, plan.unmatched_target
    if not plan.total and hidden:
        raise NotComparableError(
            f"{tr.directory}: zero tensors match the baseline {br.directory} "
            f"({len(ub)} baseline-only, {len(ut)} target-only, {len(plan.empty)} empty"
            f"{f', e.g. {ub[:1]} vs {ut[:1]}' if ub or ut else ''})"
        )
    if config.require_all and (ub or ut):
        raise NotComparableError(
            f"{tr.directory}: {len(ub)} tensors only in the baseline {br.directory} "
            f"(e.g. {', '.join(ub[:3]) or '-'}), {len(ut)} only in the target "
            f"(e.g. {', '.join(ut[:3]) or '-'}); --require-all needs every tensor on both sides"
        )


def _compare_replica(
    view: ReplicaView, plan: _Plan, br: HiddenReader, tr: HiddenReader, config: CompareConfig, decode: DecodePlan | None
) -> tuple[TensorComparison, Tokens]:
    """Compare one rank's differing replica rows of one side against the other side."""
    base = view.tensor if view.side == "baseline" else plan.base[view.key]
    target = view.tensor if view.side == "target" else plan.target[view.key]
    comparison, tokens = _compare_logical(base, target, br, tr, config, decode)
    return replace(comparison, rank=view.rank, replica_side=view.side), tokens


def _compare_all(
    plan: _Plan,
    views: list[ReplicaView],
    br: HiddenReader,
    tr: HiddenReader,
    config: CompareConfig,
    decode: DecodePlan | None,
    progress: ProgressFn | None,
    token_sink: TokenSink | None,
    row_sink: RowSink | None = None,
) -> tuple[list[TensorComparison], FailingTokens]:
    """Compare every planned pair and replica view, a few at once (:mod:`comparator.hidden.pipeline`); the
    results in layer order and the failing tokens kept."""
    results: list[TensorComparison] = []
    kept = FailingTokens()
    configs = {n: replace(config, threads=n) for n in {1, config.threads}}  # a job's kernel threads
    jobs = [
        lambda n, key=key: _compare_logical(plan.base[key], plan.target[key], br, tr, configs[n], decode)
        for key in plan.logical
    ]
    jobs += [lambda n, v=v: _compare_replica(v, plan, br, tr, configs[n], decode) for v in views]
    jobs += [lambda n, b=b, t=t: _compare_records(b, t, br, tr, configs[n], decode) for b, t in plan.pairs]
    for comparison, tokens in in_order(jobs, config.threads):
        results.append(comparison)
        kept.add(comparison, tokens)
        if token_sink is not None:
            token_sink(
                comparison,
                tokens[0],
                None if decode is None else decode.decode_rows(tokens[1], tokens[2], comparison.sequence),
            )
        if row_sink is not None:
            row_sink(comparison, tokens[0], row_keys(tokens[1], tokens[2], comparison.sequence))
        if progress is not None:
            progress(len(results), len(jobs))
    results.sort(
        key=lambda r: (
            r.layer is None,
            r.layer if r.layer is not None else 0,
            r.name,
            r.sequence if r.sequence is not None else -1,
            r.forward_pass,
            r.replica_side is not None,
            r.replica_side or "",
            r.rank,
        )
    )
    return results, kept


def _hidden(manifest: Manifest) -> tuple[Manifest, list[str]]:
    """The manifest without its logprob, logits and routing-choice rows (they get verdicts of their own) and without
    tensors of no elements, which are returned as labels (``name[pass=P,rank=R]``)."""
    keep, empty = [], []
    for r in manifest.tensors:
        if r.point in (LOGPROB_POINT, LOGITS_POINT, ROUTER_CHOICE_POINT):
            continue
        if math.prod(r.shape) == 0:
            empty.append(_label((r.name, r.forward_pass, r.rank, r.call)))
        else:
            keep.append(r)
    return (manifest if len(keep) == len(manifest.tensors) else replace(manifest, tensors=tuple(keep))), empty


def _logical_label(key: LogicalKey) -> str:
    name, call, seq = key
    return f"{name}#{call}[sequence={seq}]" if call else f"{name}[sequence={seq}]"


def _label(key: tuple[str, int, int, int]) -> str:
    name, fp, rank, call = key
    return f"{name}{f'#{call}' if call else ''}[pass={fp},rank={rank}]"
