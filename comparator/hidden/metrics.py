"""Tensor-pair metrics, streamed over row blocks with float64 accumulation.

rel_diff = ||x - y||^2 / (||x||^2 + ||y||^2) is computed in the difference form, which stays
exact for bit-level differences (``1 - 2<x,y>/(...)`` loses its last digits there); 0/0 for two
all-zero tensors is 0. The per-token rel_diff is the same formula over each row (the hidden
dim). A row where one side is NaN/Inf and the other differs gets an infinite rel_diff: a NaN
never passes a threshold (the ratio and these two rules: :func:`comparator.judging.reldiff.rel_diff_of`).

The metrics themselves are small functions over those sums, registered by name in
:mod:`comparator.hidden.registry`; this module streams the sums and evaluates them.

Every metric is right for any finite inputs, float64 ones near its limits included (1e300
or 1e-300, whose squares leave float64's range): the sums are kept as scaled sums of squares
(see :mod:`comparator.hidden.kernels`) and combined at a common power of two, so a ratio is lost
only where float64 could not hold the ratio itself (below about 1e-300).

Example::

    import numpy as np
    from comparator.hidden.metrics import rel_diff
    rel_diff(np.ones(4, np.float32), np.ones(4, np.float32))   # 0.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from comparator.hidden.kernels import MIN_SCALE_EXP, col_exps, row_stats_many, sum_scaled
from comparator.hidden.registry import BuiltinMetrics, RowSums, evaluate
from comparator.judging.reldiff import rel_diff_of
from dumper.format import to_float64
from dumper.format.dtypes import FLOAT_CODES, STORAGE_DTYPES

__all__ = ["PairStats", "StatsAccumulator", "pair_stats", "rel_diff", "row_sums_of", "stats_of", "BLOCK_BYTES"]

BLOCK_BYTES = 32 << 20
"""Bytes of one side handed to the kernels per call: big enough to amortize Python, small
enough to keep the working set bounded."""


@dataclass(frozen=True)
class PairStats(BuiltinMetrics):
    """Whole-tensor metrics, by name (:mod:`comparator.hidden.registry`), plus the per-token
    (per-row) rel_diff and the NaN/Inf counts of each side."""

    metrics: Mapping[str, float]
    token_rel_diff: np.ndarray  # [rows] float64; inf where a row has a NaN/Inf mismatch
    nan_x: int
    inf_x: int
    nan_y: int
    inf_y: int
    nonfinite_mismatches: int


def _as_2d(a: np.ndarray) -> np.ndarray:
    """View as [rows, last dim]; a 0-d or 1-d tensor is one row (rows spelled out: -1 fails for a 0 last dim)."""
    if a.ndim <= 1:
        return a.reshape(1, -1)
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


class StatsAccumulator:
    """Accumulates per-row sums over pieces of a logical tensor, then finishes the metrics.

    Rows may arrive in any order and in column pieces (tensor-parallel shards): the row sums
    of ||x-y||^2, ||x||^2, ||y||^2 and <x,y> add up, at the larger of the two scales
    (``sums`` holds them scaled by ``exps``, as :class:`~comparator.hidden.kernels.BlockStats`).
    """

    def __init__(self, rows: int, *, threads: int = 2, block_bytes: int = BLOCK_BYTES) -> None:
        self.sums = np.zeros((rows, 5), dtype=np.float64)
        self.exps = np.zeros((rows, 2), dtype=np.int32)  # all-zero sums set no scale (see _add_rows)
        self.scaled = False  # whether any exps may be nonzero (else the plain, faster formulas apply)
        self.threads = threads
        self.block_bytes = block_bytes
        self.max_abs = 0.0
        self.sum_abs = (0.0, 0)  # (s, e): sum |d| = s * 2**e
        self.counts = [0, 0, 0, 0]  # nan_x, inf_x, nan_y, inf_y
        self.elements = 0

    def add(
        self, row: int, x: np.ndarray, y: np.ndarray, dtype: str, dtype_y: str | None = None
    ) -> tuple[float, float]:
        """Add two same-shape 2-D blocks (raw storage dtypes) whose rows start at ``row``.

        ``dtype_y`` (default: ``dtype``) lets a float32 reference meet a bfloat16 target; then
        each block is widened to float64 on the fly. Returns this piece's (sum d^2, sum x^2 + y^2)
        (both times one power of two where they would leave float64's range, as in :meth:`add_many`).
        """
        return self.add_many([(row, x, y, dtype, dtype_y or dtype)], piece_sums=True)[0]

    def add_many(
        self,
        items: list[tuple[int, np.ndarray, np.ndarray, str, str]],
        *,
        exclusive: bool = False,
        piece_sums: bool = False,
    ) -> list[tuple[float, float]]:
        """:meth:`add` for several pieces ``(row, x, y, dtype, dtype_y)``, run on the threads together.

        Pieces are cut into blocks of at most ``block_bytes`` and handed to the kernels in
        batches of about ``block_bytes``, which bounds the float64 copies of mixed dtypes.
        ``exclusive``: every row is covered once (no column pieces), so the kernels write the
        row sums in place. ``piece_sums``: also return each piece's (sum d^2, sum x^2 + y^2);
        otherwise zeros (it costs a reduction per block). Where those would leave float64's range
        (float64 inputs near its limits), all of them are multiplied by one power of two, which
        keeps the ratios between them exact (a value below 2**-1022 of the largest reads as 0).
        """
        per_item: list[list[tuple[float, int]]] = [[(0.0, 0), (0.0, 0)] for _ in items]  # (s, e): s * 2**e
        batch: list[tuple[int, int, np.ndarray, np.ndarray, str, str]] = []
        batch_bytes = 0
        for k, (row, x, y, dtype, dtype_y) in enumerate(items):
            if x.shape != y.shape:
                raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
            kdtype = "F64" if dtype != dtype_y or dtype not in FLOAT_CODES else dtype
            rows, cols = x.shape
            row_bytes = max(1, cols * STORAGE_DTYPES[kdtype].itemsize)
            block = max(1, self.block_bytes // row_bytes)
            for start in range(0, rows, block):
                stop = min(rows, start + block)
                batch.append((k, row + start, x[start:stop], y[start:stop], dtype, dtype_y))
                batch_bytes += (stop - start) * row_bytes
                if batch_bytes >= self.block_bytes:
                    self._run(batch, per_item, exclusive, piece_sums)
                    batch, batch_bytes = [], 0
            self.elements += rows * cols
        if batch:
            self._run(batch, per_item, exclusive, piece_sums)
        return _common_scale(per_item)

    def _run(
        self,
        batch: list[tuple[int, int, np.ndarray, np.ndarray, str, str]],
        per_item: list[list[tuple[float, int]]],
        exclusive: bool,
        piece_sums: bool,
    ) -> None:
        blocks = []
        for _, _, xb, yb, dtype, dtype_y in batch:
            if dtype != dtype_y or dtype not in FLOAT_CODES:  # integers, bools, mixed floats: compare in float64
                blocks.append((to_float64(xb, dtype), to_float64(yb, dtype_y), "F64"))
            else:
                blocks.append((xb, yb, dtype))
        outs = exps = None
        if exclusive:
            outs = [self.sums[row : row + xb.shape[0]] for _, row, xb, _, _, _ in batch]
            exps = [self.exps[row : row + xb.shape[0]] for _, row, xb, _, _, _ in batch]
        stats = row_stats_many(blocks, threads=self.threads, outs=outs, exps=exps, scaled=True)
        for (k, row, xb, _, _, _), s in zip(batch, stats, strict=True):
            rows = slice(row, row + xb.shape[0])
            if not exclusive:
                _add_rows(self.sums[rows], self.exps[rows], s.row, s.exps, scaled=self.scaled or s.scaled_rows > 0)
            self.scaled = self.scaled or s.scaled_rows > 0
            if piece_sums:
                dd, xx, yy = _column_totals(s.row, s.exps if s.scaled_rows else None, 3)
                per_item[k][0] = sum_scaled([per_item[k][0], dd])
                per_item[k][1] = sum_scaled([per_item[k][1], sum_scaled([xx, yy])])
            self.max_abs = max(self.max_abs, s.max_abs)
            total = self.sum_abs[0] + s.sum_abs
            if self.sum_abs[1] == s.sum_abs_exp == 0 and total < math.inf:  # the common case, cheaply
                self.sum_abs = (total, 0)
            else:
                self.sum_abs = sum_scaled([self.sum_abs, (s.sum_abs, s.sum_abs_exp)])
            for i, v in enumerate((s.nan_x, s.inf_x, s.nan_y, s.inf_y)):
                self.counts[i] += v

    def finish(self) -> PairStats:
        c = self.counts
        return _finish(
            self.sums,
            self.exps if self.scaled else None,
            self.max_abs,
            self.sum_abs,
            (c[0], c[1], c[2], c[3]),
            self.elements,
        )


def _add_rows(sums: np.ndarray, exps: np.ndarray, row: np.ndarray, row_exps: np.ndarray, *, scaled: bool) -> None:
    """``sums += row`` in place for scaled row sums: both go to the larger scale, per row.

    ``scaled``: whether either side's exps may be nonzero (else a plain add).
    """
    if not scaled:  # the common case
        sums += row
        return
    # a side with all-zero x (y) sets no scale for x (y): only the sums that exist do
    new = np.maximum(
        np.where(sums[:, 1:3] == 0, MIN_SCALE_EXP, exps), np.where(row[:, 1:3] == 0, MIN_SCALE_EXP, row_exps)
    )
    target = col_exps(new)
    sums[:, :4] = np.ldexp(sums[:, :4], col_exps(exps) - target) + np.ldexp(row[:, :4], col_exps(row_exps) - target)
    sums[:, 4] += row[:, 4]
    exps[...] = new


def _column_totals(sums: np.ndarray, exps: np.ndarray | None, cols: int = 4) -> list[tuple[float, int]]:
    """Whole-tensor sum of each of the first ``cols`` sum columns, as (s, e) with sum = s * 2**e.

    ``exps`` None: nothing is scaled.
    """
    if exps is None:  # one column at a time: much faster than sum(axis=0) over a [rows, 5] array
        return [(float(sums[:, j].sum()), 0) for j in range(cols)]
    ce = np.where(sums[:, :4] != 0, col_exps(exps), 2 * MIN_SCALE_EXP)  # a zero sets no scale
    top = ce.max(axis=0, initial=2 * MIN_SCALE_EXP)
    return [(float(np.ldexp(sums[:, j], ce[:, j] - top[j]).sum()), int(top[j])) for j in range(cols)]


def _common_scale(pairs: list[list[tuple[float, int]]]) -> list[tuple[float, float]]:
    """``(a, b)`` pairs of sums ``s * 2**e`` as floats, all scaled by one power of two if needed.

    Unscaled (every ``e == 0``): the sums themselves. Otherwise every value is divided by
    2**(largest exponent), so none overflows and the ratios between them stay exact (but for
    values below 2**-1022 of the largest, which underflow).
    """
    if all(e == 0 for pair in pairs for _, e in pair):
        return [(a, b) for (a, _), (b, _) in pairs]
    top = max((e for pair in pairs for v, e in pair if v != 0.0), default=0)
    return [(math.ldexp(a, ea - top), math.ldexp(b, eb - top)) for (a, ea), (b, eb) in pairs]


def pair_stats(
    x: np.ndarray,
    y: np.ndarray,
    dtype: str,
    dtype_y: str | None = None,
    *,
    threads: int = 2,
    block_bytes: int = BLOCK_BYTES,
) -> PairStats:
    """Metrics of two same-shape arrays in raw storage dtype ``dtype`` (e.g. memory-mapped).

    Viewed as ``[rows, last dim]``; streams over blocks of rows so that only one block of each
    side is touched at a time.
    """
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    x2, y2 = _as_2d(x), _as_2d(y)
    acc = StatsAccumulator(x2.shape[0], threads=threads, block_bytes=block_bytes)
    acc.add_many([(0, x2, y2, dtype, dtype_y or dtype)], exclusive=True)  # every row once
    return acc.finish()


def _finish(
    sums: np.ndarray,
    exps: np.ndarray | None,
    max_abs: float,
    sum_abs: tuple[float, int],
    counts: tuple[int, int, int, int],
    n: int,
) -> PairStats:
    """The registered metrics of row sums scaled by ``exps`` (None: not scaled) over ``n`` elements."""
    return stats_of(row_sums_of(sums, exps, max_abs, sum_abs, n), counts)


def row_sums_of(
    sums: np.ndarray, exps: np.ndarray | None, max_abs: float, sum_abs: tuple[float, int], n: int
) -> RowSums:
    """The accumulated sums as the metrics see them, with the per-token rel_diff derived."""
    dd = sums[:, 0]
    xx = sums[:, 1]
    yy = sums[:, 2]
    bad = sums[:, 4]
    if exps is not None:  # bring ||x||^2 and ||y||^2 to the scale of ||x-y||^2, per row
        ce = col_exps(exps)
        xx, yy = np.ldexp(xx, ce[:, 1] - ce[:, 0]), np.ldexp(yy, ce[:, 2] - ce[:, 0])
    token = rel_diff_of(dd, xx + yy, mismatched=bad > 0)
    tdd, txx, tyy, txy = _column_totals(sums, exps)
    return RowSums(
        rows=sums,
        exps=exps,
        token=token,
        dd=tdd,
        xx=txx,
        yy=tyy,
        xy=txy,
        max_abs=max_abs,
        sum_abs=sum_abs,
        elements=n,
        mismatches=int(bad.sum()),
    )


def stats_of(s: RowSums, counts: tuple[int, int, int, int], *, from_norms: bool = False) -> PairStats:
    """The result of sums ``s`` and NaN/Inf ``counts``: every registered metric (``from_norms``: only those a
    sketch can estimate, :func:`comparator.hidden.registry.evaluate`)."""
    return PairStats(
        metrics=evaluate(s, from_norms=from_norms),
        token_rel_diff=s.token,
        nan_x=counts[0],
        inf_x=counts[1],
        nan_y=counts[2],
        inf_y=counts[3],
        nonfinite_mismatches=s.mismatches,
    )


def rel_diff(x: np.ndarray, y: np.ndarray) -> float:
    """rel_diff of two float arrays of the same shape (any float dtype), in float64."""
    x = np.asarray(x)
    y = np.asarray(y)
    # numpy's own float dtypes (bfloat16's storage is its uint16 bits, which this is not)
    dtype = next((c for c in FLOAT_CODES if c != "BF16" and STORAGE_DTYPES[c] == x.dtype), None)
    if dtype is None or y.dtype != x.dtype:
        x, y, dtype = x.astype(np.float64), y.astype(np.float64), "F64"
    return pair_stats(np.ascontiguousarray(x), np.ascontiguousarray(y), dtype).rel_diff
