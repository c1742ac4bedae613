"""Compare two dumps: align tensors, stream metrics pair by pair, find the first divergence.

Example::

    from comparator import compare_dumps, CompareConfig
    report = compare_dumps("dumps/eager", "dumps/sdpa", CompareConfig(threshold=1e-3))
    print(report.passed, report.first_divergent)

Only one pair of tensors is mapped at a time, so memory stays bounded by the largest tensor
whatever the dump size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dumper.errors import NotComparableError
from dumper.format import DumpReader, Manifest, TensorRecord

from .config import CompareConfig
from .metrics import PairStats, pair_stats
from .report import FirstDivergence, Report, TensorComparison

__all__ = ["compare_dumps", "align", "PairKey"]

PairKey = tuple[str, int, int, int]
"""(name, forward_pass, rank, call): how a tensor is matched across dumps."""

ProgressFn = Callable[[int, int], None]


def _key(rec: TensorRecord) -> PairKey:
    return (rec.name, rec.forward_pass, rec.rank, rec.call)


def _label(key: PairKey) -> str:
    name, fp, rank, call = key
    suffix = f"#{call}" if call else ""
    return f"{name}{suffix}[pass={fp},rank={rank}]"


def align(baseline: Manifest, target: Manifest) -> tuple[list[tuple[TensorRecord, TensorRecord]], list[str], list[str]]:
    """Match tensors by (name, forward pass, rank, call); return pairs and unmatched labels of each side."""
    base = {_key(r): r for r in baseline.tensors}
    targ = {_key(r): r for r in target.tensors}
    pairs = [(base[k], targ[k]) for k in base if k in targ]
    pairs.sort(key=lambda p: (p[0].file, p[0].key))  # read files in order
    unmatched_b = sorted(_label(k) for k in base if k not in targ)
    unmatched_t = sorted(_label(k) for k in targ if k not in base)
    return pairs, unmatched_b, unmatched_t


def _check_pair(b: TensorRecord, t: TensorRecord, base_dir: Path, targ_dir: Path) -> None:
    if b.shape != t.shape:
        raise NotComparableError(
            f"{targ_dir / t.file}: tensor {t.name!r} (pass {t.forward_pass}) has shape {list(t.shape)} "
            f"but the baseline {base_dir / b.file} has {list(b.shape)}; these dumps cannot be aligned")


def _compare_pair(b: TensorRecord, t: TensorRecord, stats: PairStats, config: CompareConfig) -> TensorComparison:
    token = stats.token_rel_diff
    fails = ~(token <= config.token_threshold)  # NaN counts as failing
    positions = b.row_positions()
    sequences = b.row_sequence_ids()
    failing_rows = np.flatnonzero(fails)
    first_row = worst_row = None
    first_tok = worst_tok = first_seq = None
    if failing_rows.size:
        if positions is not None:
            first_row = int(failing_rows[np.argmin(positions[failing_rows])])
        else:
            first_row = int(failing_rows[0])
    if token.size:
        worst_row = int(np.argmax(np.where(np.isnan(token), np.inf, token)))
    if positions is not None:
        first_tok = None if first_row is None else int(positions[first_row])
        worst_tok = None if worst_row is None else int(positions[worst_row])
    if sequences is not None and first_row is not None:
        first_seq = int(sequences[first_row])
    max_tok = float(np.max(token)) if token.size else 0.0
    passed = bool(stats.rel_diff <= config.threshold) and not failing_rows.size
    return TensorComparison(
        name=b.name, layer=b.layer, forward_pass=b.forward_pass, rank=b.rank, shape=b.shape,
        rel_diff=stats.rel_diff, max_token_rel_diff=max_tok, max_abs_diff=stats.max_abs_diff,
        mean_abs_diff=stats.mean_abs_diff, cosine=stats.cosine, nan_baseline=stats.nan_x,
        inf_baseline=stats.inf_x, nan_target=stats.nan_y, inf_target=stats.inf_y,
        nonfinite_mismatches=stats.nonfinite_mismatches, failing_tokens=int(failing_rows.size),
        first_failing_token=first_tok, first_failing_row=first_row, first_failing_sequence=first_seq,
        worst_token=worst_tok, worst_row=worst_row, passed=passed,
    )


def _first_divergence(tensors: list[TensorComparison]) -> FirstDivergence | None:
    failed = [t for t in tensors if not t.passed]
    if not failed:
        return None
    layered = [t for t in failed if t.layer is not None]
    pool = layered if layered else failed
    low = min(t.layer for t in pool) if layered else None
    in_layer = [t for t in pool if t.layer == low]

    def order(t: TensorComparison) -> tuple:
        tok = t.first_failing_token
        return (tok is None, tok if tok is not None else 0, t.forward_pass, t.rank, t.name)

    first = min(in_layer, key=order)
    worst = max(in_layer, key=lambda t: t.max_token_rel_diff)
    return FirstDivergence(
        name=first.name, layer=low, rel_diff=max(t.rel_diff for t in in_layer), token=first.first_failing_token,
        worst_token=worst.worst_token, sequence=first.first_failing_sequence,
        forward_pass=first.forward_pass, rank=first.rank)


def compare_dumps(baseline: str | os.PathLike[str], target: str | os.PathLike[str],
                  config: CompareConfig | None = None, *, progress: ProgressFn | None = None) -> Report:
    """Compare the dump ``target`` against the dump ``baseline``.

    Raises :class:`~dumper.errors.DumpError` for a missing, incomplete or corrupt dump and
    :class:`~dumper.errors.NotComparableError` when nothing matches or shapes differ; a
    divergence is not an exception but ``report.passed == False``.
    """
    config = config or CompareConfig()
    base_dir, targ_dir = Path(baseline), Path(target)
    base_reader, targ_reader = DumpReader(base_dir), DumpReader(targ_dir)
    bm, tm = base_reader.manifest, targ_reader.manifest
    for d, m in ((base_dir, bm), (targ_dir, tm)):
        if not m.tensors:
            raise NotComparableError(f"{d}: the dump captured no tensors")
    pairs, unmatched_b, unmatched_t = align(bm, tm)
    if not pairs:
        raise NotComparableError(
            f"{targ_dir}: zero tensors match the baseline {base_dir} "
            f"({len(unmatched_b)} baseline-only, {len(unmatched_t)} target-only names, "
            f"e.g. {unmatched_b[0]!r} vs {unmatched_t[0]!r})")
    for b, t in pairs:
        _check_pair(b, t, base_dir, targ_dir)
    results: list[TensorComparison] = []
    for i, (b, t) in enumerate(pairs):
        stats = pair_stats(base_reader.array(b), targ_reader.array(t), b.dtype, t.dtype, threads=config.threads)
        results.append(_compare_pair(b, t, stats, config))
        if progress is not None:
            progress(i + 1, len(pairs))
    results.sort(key=lambda r: (r.layer is None, r.layer if r.layer is not None else 0,
                                r.forward_pass, r.rank, r.name))
    return Report(
        baseline=str(base_dir), target=str(targ_dir), threshold=config.threshold,
        token_threshold=config.token_threshold, tensors=tuple(results),
        unmatched_baseline=tuple(unmatched_b), unmatched_target=tuple(unmatched_t),
        first_divergent=_first_divergence(results),
        environment={"baseline": bm.environment, "target": tm.environment},
    )

