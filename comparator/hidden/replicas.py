"""Tensor-parallel replicas: rows that several ranks of one side hold and that must be bit-identical.

A whole (unsharded) tensor recorded on several ranks, such as the hidden state entering
self-attention under tensor parallelism, is compared against the other side through one
representative, its lowest rank (:func:`comparator.hidden.align.logical_tensors`). The other
ranks' rows are checked against it bit for bit (:func:`check_replicas`); each rank whose rows
differ is then also compared against the other side, through a :class:`ReplicaView`, so a bug
on one rank is located at the layer where it starts, not at the later one where an all-reduce
carries it to the representative. A rank bit-identical to the representative would give the
same numbers, so it is not compared again.

Example::

    mismatches, views = check_replicas("target", reader, logical, CompareConfig())
    [(v.key, v.rank) for v in views]   # [(("model.layers.3.self_attn.input", 0, 0), 1), ...]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from comparator.config import CompareConfig
from comparator.hidden.align import LogicalKey, LogicalTensor, replica_view
from comparator.hidden.metrics import pair_stats
from comparator.hidden.sketch import HiddenReader
from comparator.hidden.types import ReplicaMismatch

__all__ = ["ReplicaView", "check_replicas", "as_rank"]


@dataclass(frozen=True)
class ReplicaView:
    """One side's logical tensor ``key`` as rank ``rank`` holds it (rows it replicates differently)."""

    side: str
    """``"baseline"`` or ``"target"``."""
    key: LogicalKey
    rank: int
    tensor: LogicalTensor
    """The representative's logical tensor with this rank's replica rows in its place."""


def _first_differences(reader: HiddenReader, lt: LogicalTensor, config: CompareConfig) -> dict[int, tuple[int, float]]:
    """Per rank whose replica rows differ from the representative's: (first differing position,
    largest per-token rel_diff). Reads one replica segment pair at a time."""
    worst: dict[int, tuple[int, float]] = {}
    for ref, other in lt.replicas:
        x = reader.rows(ref.rec)[ref.row : ref.row + ref.count]
        y = reader.rows(other.rec)[other.row : other.row + other.count]
        stats = pair_stats(x, y, ref.rec.dtype, other.rec.dtype, threads=config.threads)
        bad = np.flatnonzero(~(stats.token_rel_diff == 0))  # NaN counts as different
        if bad.size:
            pos, rd = ref.pos + int(bad[0]), stats.max_token_rel_diff
            prev = worst.get(other.rec.rank)
            worst[other.rec.rank] = (min(pos, prev[0]), max(rd, prev[1])) if prev else (pos, rd)
    return worst


def check_replicas(
    side: str, reader: HiddenReader, lts: Mapping[LogicalKey, LogicalTensor], config: CompareConfig
) -> tuple[list[ReplicaMismatch], list[ReplicaView]]:
    """Rows that several ranks of ``side`` hold must be bit-identical: the mismatches (sorted by
    layer, rank, token), and a view of each (logical tensor, rank) that differs, to compare it too."""
    found: list[ReplicaMismatch] = []
    views: list[ReplicaView] = []
    for key, lt in lts.items():
        for rank, (pos, rd) in sorted(_first_differences(reader, lt, config).items()):
            found.append(
                ReplicaMismatch(
                    side=side,
                    name=lt.name,
                    layer=lt.layer,
                    sequence=lt.sequence,
                    rank=rank,
                    reference_rank=lt.rows[0].rec.rank if lt.rows else 0,
                    first_token=pos,
                    max_token_rel_diff=rd,
                )
            )
            views.append(ReplicaView(side=side, key=key, rank=rank, tensor=replica_view(lt, rank)))
    found.sort(key=lambda m: (m.layer is None, m.layer or 0, m.rank, m.first_token))
    return found, views


def as_rank(
    base: Mapping[LogicalKey, LogicalTensor],
    target: Mapping[LogicalKey, LogicalTensor],
    views: Iterable[ReplicaView],
    side: str | None,
    rank: int,
) -> tuple[Mapping[LogicalKey, LogicalTensor], Mapping[LogicalKey, LogicalTensor]]:
    """Both sides' logical tensors with ``side``'s as rank ``rank`` holds them (its views in place of the
    representatives where it has one); unchanged for ``side`` None (the heatmap of a divergence there)."""
    mine = {v.key: v.tensor for v in views if v.side == side and v.rank == rank}
    if not mine:
        return base, target
    return ({**base, **mine}, target) if side == "baseline" else (base, {**target, **mine})
