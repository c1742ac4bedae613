"""One compared tensor's verdict: its streamed statistics judged against its limits.

:func:`judge_tensor` turns a :class:`~comparator.hidden.metrics.PairStats` into a
:class:`~comparator.hidden.types.TensorComparison`: which tokens fail (a NaN always does), the
first and the worst of them, the failing position ranges, and the ratios to the calibrated noise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from comparator.config import CompareConfig
from comparator.hidden.metrics import PairStats
from comparator.hidden.types import TensorComparison
from comparator.judging.row_noise import row_keys
from dumper.format import encode_runs

__all__ = ["judge_tensor", "MAX_RANGES"]

MAX_RANGES = 32
"""How many failing position ranges a comparison lists."""


def _ranges(values: np.ndarray) -> list[list[int]]:
    """Sorted integers as inclusive ``[first, last]`` ranges, at most :data:`MAX_RANGES`."""
    return [[start, start + count - 1] for start, count in encode_runs(values, step=1)[:MAX_RANGES]]


def judge_tensor(
    stats: PairStats,
    config: CompareConfig,
    *,
    name: str,
    layer: int | None,
    forward_pass: int,
    rank: int,
    shape: tuple[int, ...],
    positions: np.ndarray | None,
    sequences: np.ndarray | None,
    sequence: int | None,
    notes: Callable[[int], str | None] | None = None,
    decode_rows: np.ndarray | None = None,
    point: str | None = None,
) -> TensorComparison:
    """``decode_rows``: which rows are decode rows (None: no decode part), for noise measured per phase."""
    token = stats.token_rel_diff
    limits = config.noise_limits_of(name)
    keys = row_keys(positions, sequences, sequence) if limits.rows is not None else None
    own = limits.own_noise(keys)
    failing = np.flatnonzero(~(token <= limits.token_thresholds(decode_rows, keys)))  # NaN counts as failing
    first_row = worst_row = first_tok = worst_tok = first_seq = None
    note = None
    ranges: list[list[int]] = []
    if failing.size:
        first_row = int(failing[np.argmin(positions[failing])]) if positions is not None else int(failing[0])
    if token.size:
        worst_row = int(np.argmax(np.where(np.isnan(token), np.inf, token)))
    if positions is not None:
        first_tok = None if first_row is None else int(positions[first_row])
        worst_tok = None if worst_row is None else int(positions[worst_row])
        ranges = _ranges(np.unique(positions[failing]))
    if first_row is not None:
        first_seq = int(sequences[first_row]) if sequences is not None else sequence
        if notes is not None and first_tok is not None:
            note = notes(first_tok)
    noise_ratio, token_noise_ratio = limits.ratios(stats.rel_diff, token, decode_rows, keys)
    return TensorComparison(
        name=name,
        layer=layer,
        forward_pass=forward_pass,
        rank=rank,
        shape=shape,
        sequence=sequence,
        metrics=dict(stats.metrics),
        nan_baseline=stats.nan_x,
        inf_baseline=stats.inf_x,
        nan_target=stats.nan_y,
        inf_target=stats.inf_y,
        nonfinite_mismatches=stats.nonfinite_mismatches,
        failing_tokens=int(failing.size),
        first_failing_token=first_tok,
        first_failing_row=first_row,
        first_failing_sequence=first_seq,
        failing_ranges=ranges,
        worst_token=worst_tok,
        worst_row=worst_row,
        note=note,
        passed=bool(stats.rel_diff <= limits.threshold) and not failing.size,
        threshold=limits.threshold,
        token_threshold=limits.token_threshold,
        decode_token_threshold=limits.decode_token_threshold if decode_rows is not None else None,
        noise_ratio=noise_ratio,
        token_noise_ratio=token_noise_ratio,
        point=point,
        own_noise_rows=None if own is None else int(np.count_nonzero(~np.isnan(own))),
    )
