"""From the first failing tensor to where its divergence starts: onset token and onset layer.

:mod:`comparator.hidden.onset` holds the estimators; this module feeds them a comparison's results
(see docs/localize.md, "Onset: where a divergence starts"). Per-token values are kept only for failing tensors of the
lowest failing layer seen so far, so memory stays bounded by one layer's positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from comparator.config import CompareConfig
from comparator.hidden.onset import Amplification, amplification, layer_onset, point_of, token_onset
from comparator.hidden.types import FirstDivergence, TensorComparison
from comparator.judging.noise_thresholds import NoiseLimits, noise_limits
from comparator.judging.row_noise import row_keys
from dumper.format.points import CACHE_POINTS, INPUT, RESIDUAL, order_in_layer

__all__ = ["FailingTokens", "first_divergence", "locate_onset", "layer_amplification"]

Tokens = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]


class FailingTokens:
    """Per-token rel_diff of the failing comparisons in the lowest failing layer so far."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[TensorComparison, Tokens]] = {}
        self._low: int | None = None

    def add(self, t: TensorComparison, tokens: Tokens) -> None:
        if t.passed:
            return
        if t.layer is not None:
            if self._low is not None and t.layer > self._low:
                return
            if self._low is None or t.layer < self._low:
                self._low = t.layer
                self._kept = {k: v for k, v in self._kept.items() if v[0].layer is None}
        self._kept[id(t)] = (t, tokens)

    def get(self, t: TensorComparison) -> Tokens | None:
        hit = self._kept.get(id(t))
        return hit[1] if hit is not None else None


def _noise_only(config: CompareConfig, name: str) -> NoiseLimits | None:
    """The tensor's thresholds from its noise alone (no fixed ones on top), or None without noise."""
    entry = config.noise.tensor(name) if config.noise is not None else None
    if entry is None:
        return None
    rows = config.noise.rows.tensors.get(name) if config.noise.rows is not None and config.row_cover else None
    return noise_limits(entry, config.noise_factor, config.noise_floor, None, rows, config.row_cover or ())


def _departs(t: TensorComparison, config: CompareConfig) -> bool | None:
    """Whether ``t`` departs from its calibrated noise (None: no noise for it); judged row by row, in units of each
    row's own noise, where it had row noise."""
    lim = _noise_only(config, t.name)
    if lim is None:
        return None
    if t.own_noise_rows:  # the ratios were taken against each row's own noise
        return not (
            t.noise_ratio is not None
            and t.noise_ratio <= config.noise_factor
            and t.token_noise_ratio is not None
            and t.token_noise_ratio <= config.noise_factor
        )
    return not (
        t.rel_diff <= lim.threshold
        and t.max_token_rel_diff <= max(lim.token_threshold, lim.decode_token_threshold or 0.0)
    )


def _onset_token(t: TensorComparison, tokens: Tokens, config: CompareConfig, floor: float) -> tuple[int | None, str]:
    token, positions, sequences = tokens
    rows = np.arange(token.size)
    if sequences is not None and t.first_failing_sequence is not None:  # rows of several sequences: the first's
        rows = np.flatnonzero(sequences == t.first_failing_sequence)
    assert t.first_failing_row is not None
    local_first = int(np.flatnonzero(rows == t.first_failing_row)[0])
    pos = positions[rows] if positions is not None else None
    lim = _noise_only(config, t.name)
    noise: float | np.ndarray | None = None
    if lim is not None:  # each covered row against its own noise, the others the larger phase's pooled threshold
        noise = max(lim.token_threshold, lim.decode_token_threshold or 0.0)
        own = lim.own_noise(row_keys(positions, sequences, t.sequence))
        if own is not None:
            noise = np.where(np.isnan(own), noise, np.maximum(lim.floor, lim.factor * own))[rows]
    row, method = token_onset(token[rows], pos, local_first, noise, floor)
    return (int(pos[row]) if pos is not None else None), method


def _onset_layer(
    fd: FirstDivergence, results: Sequence[TensorComparison], config: CompareConfig, floor: float
) -> tuple[int, str]:
    assert fd.layer is not None
    layers: dict[int, tuple[float, bool | None]] = {}
    for t in results:
        if t.layer is None or t.layer > fd.layer:
            continue
        value, departs = layers.get(t.layer, (0.0, None))
        out = _departs(t, config)
        if out is not None:
            departs = bool(departs) or out
        layers[t.layer] = (max(value, t.rel_diff) if t.rel_diff == t.rel_diff else float("inf"), departs)
    return layer_onset([(k, v, d) for k, (v, d) in layers.items()], fd.layer, floor)


def first_divergence(tensors: list[TensorComparison]) -> tuple[FirstDivergence, TensorComparison] | None:
    """The first divergence, and the tensor whose first failing token it names (None: nothing failed).

    It is in the lowest layer with a failing tensor (tensors without a layer only when no layered
    one failed); within it, at the earliest failing point in data-flow order
    (:data:`dumper.format.points.ORDER`: residual, attention input and output, MLP input and
    output), the tensor with the earliest first failing token names the token, ties going to the
    lower sequence, pass, rank, then name; ``worst_token`` is that layer's worst, ``agreeing`` the
    layer's earlier points where every tensor passes. The comparisons of replica ranks count like any
    other, so the layer is the lowest over all ranks, and a representative failing at the same
    token wins over its replica.
    """
    failed = [t for t in tensors if not t.passed]
    if not failed:
        return None
    layered = [t for t in failed if t.layer is not None]
    pool = layered if layered else failed
    low = min(t.layer for t in pool) if layered else None
    in_layer = [t for t in pool if t.layer == low]

    def order(t: TensorComparison) -> tuple:
        tok = t.first_failing_token
        return (
            order_in_layer(t.point),
            tok is None,
            tok if tok is not None else 0,
            t.sequence if t.sequence is not None else -1,
            t.forward_pass,
            t.replica_side is not None,
            t.rank,
            t.name,
        )

    first = min(in_layer, key=order)
    before = {
        t.point
        for t in tensors
        if t.layer == low and t.point is not None and order_in_layer(t.point) < order_in_layer(first.point)
    }
    agreeing = sorted(before - {t.point for t in in_layer}, key=order_in_layer)
    cached = any(t.point in CACHE_POINTS for t in tensors if t.layer == low)
    finding = None
    if first.point in CACHE_POINTS:
        finding = "cache" if {INPUT, RESIDUAL} & set(agreeing) else "unknown"
    elif cached and first.point in (INPUT, RESIDUAL):
        finding = "upstream"
    worst = max(in_layer, key=lambda t: t.max_token_rel_diff)
    sequences = sorted({t.first_failing_sequence for t in in_layer if t.first_failing_sequence is not None})
    return FirstDivergence(
        name=first.name,
        layer=low,
        rel_diff=max(t.rel_diff for t in in_layer),
        token=first.first_failing_token,
        worst_token=worst.worst_token,
        sequence=first.first_failing_sequence,
        forward_pass=first.forward_pass,
        rank=first.rank,
        failing_sequences=sequences,
        failing_ranges=first.failing_ranges,
        note=first.note,
        replica_side=first.replica_side,
        point=first.point,
        agreeing=agreeing,
        finding=finding,
    ), first


def locate_onset(
    found: tuple[FirstDivergence, TensorComparison] | None,
    results: Sequence[TensorComparison],
    tokens_of: Callable[[TensorComparison], Tokens | None],
    config: CompareConfig,
    floor: float = 0.0,
) -> FirstDivergence | None:
    """The first divergence (of ``found``: it and its first failing tensor) with its onset token and
    onset layer (see :mod:`comparator.hidden.onset`); ``floor``: the dumps' rounding floor
    (:func:`~comparator.hidden.onset.rounding_floor`), under which an uncalibrated estimate sees no step."""
    if found is None:
        return None
    fd, first = found
    onset, method = fd.token, "threshold"
    tokens = tokens_of(first)
    if tokens is not None and first.first_failing_row is not None and fd.token is not None:
        onset, method = _onset_token(first, tokens, config, floor)
    onset_layer, layer_method = (
        (fd.layer, "threshold") if fd.layer is None else _onset_layer(fd, results, config, floor)
    )
    return replace(fd, onset=onset, onset_method=method, onset_layer=onset_layer, onset_layer_method=layer_method)


def layer_amplification(
    results: Sequence[TensorComparison],
    config: CompareConfig | None = None,
) -> list[Amplification]:
    """Per-layer amplification at each capture point (see :func:`comparator.hidden.onset.amplification`).

    With calibrated noise, a layer introduces error only when what it hands on (the next layer's
    value) departs from that layer's noise: benign bf16 rounding that turns layer 0's exact
    embedding into noise is growth, not a bug.
    """
    layered = [t for t in results if t.layer is not None]
    departs: dict[tuple[int, str], bool] = {}
    for t in layered:
        out = _departs(t, config) if config is not None else None
        if out is not None:
            key = (t.layer, point_of(t.name))
            departs[key] = departs.get(key, False) or out
    return amplification(
        [(t.layer, point_of(t.name), t.rel_diff) for t in layered],
        departs=departs,
        order={point_of(t.name): order_in_layer(t.point) for t in layered},
    )
