"""Alignment plans from hand-built manifests, and executing them on rows that say what they mean.

Each side's layout is written as the (sequence, position) of every row; the records' run-length
metadata is derived from it here, and every row's data encodes its own (sequence, position,
column). A plan is right when every pair of rows it brings together holds the same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from comparator.hidden.align import (
    LogicalTensor,
    column_pieces,
    fallback_pairs,
    logical_tensors,
    match_rows,
    positions_of,
    split_by_mode,
)
from dumper.errors import NotComparableError
from dumper.format import FORMAT_VERSION, PAD_SEQUENCE, Manifest, TensorRecord

H = 4
"""Hidden size of the whole tensors."""
PAD = (PAD_SEQUENCE, 0)


def _rle(values: list[int], step: int) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][0] + step * runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


class Side:
    """One dump's records, built from row layouts, with each record's data alongside."""

    def __init__(self) -> None:
        self.records: list[TensorRecord] = []
        self.data: dict[str, np.ndarray] = {}

    def add(
        self,
        rows: list[tuple[int, int]],
        *,
        forward_pass: int = 0,
        rank: int = 0,
        name: str = "t",
        cols: tuple[int, int] = (0, H),
        positions: bool = True,
    ) -> Side:
        """A record of ``rows`` (sequence, position); ``cols``: the slice of the hidden dim it holds (a shard)."""
        key = f"{name}/p{forward_pass}/r{rank}"
        lo, hi = cols
        self.records.append(
            TensorRecord(
                name=name,
                file=f"r{rank}-p{forward_pass}.safetensors",
                key=key,
                shape=(len(rows), hi - lo),
                dtype="F32",
                forward_pass=forward_pass,
                rank=rank,
                layer=0,
                positions=_rle([p for _, p in rows], 1) if positions else None,
                sequence_ids=_rle([s for s, _ in rows], 0) if positions else None,
                shard_dim=None if cols == (0, H) else 1,
            )
        )
        self.data[key] = np.array(
            [
                [-1.0] * (hi - lo) if s == PAD_SEQUENCE else [1e4 * s + 10 * p + c for c in range(lo, hi)]
                for s, p in rows
            ]
        )
        return self

    @property
    def manifest(self) -> Manifest:
        return Manifest(
            format_version=FORMAT_VERSION,
            created_at="",
            model={},
            capture_signature={},
            environment={},
            files={},
            tensors=tuple(self.records),
        )

    def logical(self) -> dict:
        m = self.manifest
        return logical_tensors(m, {r.name for r in m.tensors}, "side")


def seq(s: int, start: int, stop: int) -> list[tuple[int, int]]:
    return [(s, p) for p in range(start, stop)]


def execute(base: Side, target: Side, lb: LogicalTensor, lt: LogicalTensor) -> list[int]:
    """Bring the planned rows together; assert each pair holds the same values; the positions compared."""
    pieces = column_pieces(lb, lt)
    assert sum(p.width for p in pieces) == H
    for p in pieces:
        for run in match_rows(lb.segments(p.base_rank), lt.segments(p.target_rank), "test"):
            x = base.data[run.base.rec.key][run.base_row : run.base_row + run.count, p.base_col : p.base_col + p.width]
            y = target.data[run.target.rec.key][
                run.target_row : run.target_row + run.count, p.target_col : p.target_col + p.width
            ]
            assert x.shape == y.shape == (run.count, p.width) and (x == y).all() and (x >= 0).all()
    return positions_of(lb.segments(pieces[0].base_rank)).tolist()


def plan(base: Side, target: Side) -> dict:
    """Every logical tensor both sides hold, executed: key -> positions compared."""
    by_rows, _ = split_by_mode(base.manifest, target.manifest)
    assert by_rows == {"t"}
    lb, lt = base.logical(), target.logical()
    assert lb.keys() == lt.keys()
    return {k: execute(base, target, lb[k], lt[k]) for k in sorted(lb)}


def test_same_layout():
    base, target = Side().add(seq(0, 0, 10)), Side().add(seq(0, 0, 10))
    assert plan(base, target) == {("t", 0, 0): list(range(10))}
    runs = match_rows(base.logical()["t", 0, 0].rows, target.logical()["t", 0, 0].rows, "w")
    assert [(r.base_row, r.target_row, r.pos, r.count) for r in runs] == [(0, 0, 0, 10)]


def test_chunked_against_one_pass():
    base = Side().add(seq(0, 0, 10))
    target = (
        Side().add(seq(0, 0, 4), forward_pass=0).add(seq(0, 4, 7), forward_pass=1).add(seq(0, 7, 10), forward_pass=2)
    )
    assert plan(base, target) == {("t", 0, 0): list(range(10))}
    runs = match_rows(base.logical()["t", 0, 0].rows, target.logical()["t", 0, 0].rows, "w")
    assert [(r.target.rec.forward_pass, r.base_row, r.target_row, r.count) for r in runs] == [
        (0, 0, 0, 4),
        (1, 4, 0, 3),
        (2, 7, 0, 3),
    ]
    assert plan(target, base) == {("t", 0, 0): list(range(10))}  # either side may be the chunked one


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_batch_against_one_prompt_per_pass(padding):
    base = Side().add(seq(0, 0, 6), forward_pass=0).add(seq(1, 0, 4), forward_pass=1)
    short = seq(1, 0, 4) + [PAD] * 2 if padding == "right" else [PAD] * 2 + seq(1, 0, 4)
    target = Side().add(seq(0, 0, 6) + short)  # a [2, 6] batch seen as 12 rows
    assert plan(base, target) == {("t", 0, 0): list(range(6)), ("t", 0, 1): list(range(4))}
    rows = target.logical()["t", 0, 1].rows
    assert [(s.row, s.pos, s.count) for s in rows] == [(6 if padding == "right" else 8, 0, 4)]


def test_a_missing_position_cannot_be_aligned():
    base = Side().add(seq(0, 0, 10))
    target = Side().add(seq(0, 0, 4), forward_pass=0).add(seq(0, 5, 10), forward_pass=1)  # position 4 lost
    with pytest.raises(
        NotComparableError,
        match=r"positions 0\.\.9 \(10 tokens\) in the baseline but "
        r"0\.\.9 \(9 tokens\) in the target; cannot align",
    ):
        match_rows(base.logical()["t", 0, 0].rows, target.logical()["t", 0, 0].rows, "t (sequence 0)")


def test_a_position_held_twice_cannot_be_aligned():
    side = Side().add(seq(0, 0, 4), forward_pass=0).add(seq(0, 3, 6), forward_pass=1)
    with pytest.raises(NotComparableError, match="holds token position 3 twice on rank 0 .passes 0 and 1."):
        side.logical()


def test_tensor_parallel_shards_are_joined_by_columns():
    base = Side().add(seq(0, 0, 5))
    target = Side().add(seq(0, 0, 5), rank=0, cols=(0, 2)).add(seq(0, 0, 5), rank=1, cols=(2, H))
    assert plan(base, target) == {("t", 0, 0): list(range(5))}
    pieces = column_pieces(base.logical()["t", 0, 0], target.logical()["t", 0, 0])
    assert [(p.target_rank, p.base_col, p.target_col, p.width) for p in pieces] == [(0, 0, 0, 2), (1, 2, 0, 2)]


def test_replicated_ranks_contribute_one_copy_and_are_queued_for_the_identity_check():
    target = Side().add(seq(0, 0, 5), rank=0).add(seq(0, 0, 5), rank=1)
    lt = target.logical()["t", 0, 0]
    assert [(s.rec.rank, s.pos, s.count) for s in lt.rows] == [(0, 0, 5)]
    assert [(a.rec.rank, b.rec.rank, a.pos, a.count) for a, b in lt.replicas] == [(0, 1, 0, 5)]
    assert plan(Side().add(seq(0, 0, 5)), target) == {("t", 0, 0): list(range(5))}


def test_tensors_without_positions_fall_back_to_pass_and_rank():
    base = Side().add(seq(0, 0, 3), positions=False).add(seq(0, 0, 3), forward_pass=1, positions=False)
    target = Side().add(seq(0, 0, 3), positions=False).add(seq(0, 0, 3), rank=1, positions=False)
    by_rows, by_pass = split_by_mode(base.manifest, target.manifest)
    assert (by_rows, by_pass) == (set(), {"t"})
    pairs, only_b, only_t = fallback_pairs(base.manifest, target.manifest, by_pass)
    assert [(b.key, t.key) for b, t in pairs] == [("t/p0/r0", "t/p0/r0")]
    assert (only_b, only_t) == ([("t", 1, 0, 0)], [("t", 0, 1, 0)])


def test_a_name_without_positions_on_one_side_falls_back_on_both():
    base, target = Side().add(seq(0, 0, 3)), Side().add(seq(0, 0, 3), positions=False)
    assert split_by_mode(base.manifest, target.manifest) == (set(), {"t"})
