"""Tensor-pair metrics, streamed over row blocks with float64 accumulation.

rel_diff = ||x - y||^2 / (||x||^2 + ||y||^2) is computed in the difference form, which stays
exact for bit-level differences (``1 - 2<x,y>/(...)`` loses its last digits there); 0/0 for two
all-zero tensors is 0. The per-token rel_diff is the same formula over each row (the hidden
dim). A row where one side is NaN/Inf and the other differs gets an infinite rel_diff: a NaN
never passes a threshold.

Example::

    import numpy as np
    from comparator.metrics import rel_diff
    rel_diff(np.ones(4, np.float32), np.ones(4, np.float32))   # 0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dumper.format import STORAGE_DTYPES, to_float64

from .kernels import row_stats_many

__all__ = ["PairStats", "StatsAccumulator", "pair_stats", "rel_diff", "BLOCK_BYTES"]

BLOCK_BYTES = 32 << 20
"""Bytes of one side handed to the kernels per call: big enough to amortize Python, small
enough to keep the working set bounded."""

_FLOAT = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class PairStats:
    """Whole-tensor metrics plus the per-token (per-row) rel_diff."""

    rel_diff: float
    token_rel_diff: np.ndarray  # [rows] float64; inf where a row has a NaN/Inf mismatch
    max_abs_diff: float
    mean_abs_diff: float
    cosine: float
    nan_x: int
    inf_x: int
    nan_y: int
    inf_y: int
    nonfinite_mismatches: int


def _as_2d(a: np.ndarray) -> np.ndarray:
    """View as [rows, last dim]; a 0-d or 1-d tensor is one row."""
    if a.ndim <= 1:
        return a.reshape(1, -1)
    return a.reshape(-1, a.shape[-1])


class StatsAccumulator:
    """Accumulates per-row sums over pieces of a logical tensor, then finishes the metrics.

    Rows may arrive in any order and in column pieces (tensor-parallel shards): the row sums
    of ||x-y||^2, ||x||^2, ||y||^2 and <x,y> simply add up.
    """

    def __init__(self, rows: int, *, threads: int = 2, block_bytes: int = BLOCK_BYTES) -> None:
        self.sums = np.zeros((rows, 5), dtype=np.float64)
        self.threads = threads
        self.block_bytes = block_bytes
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.counts = [0, 0, 0, 0]  # nan_x, inf_x, nan_y, inf_y
        self.elements = 0

    def add(self, row: int, x: np.ndarray, y: np.ndarray, dtype: str, dtype_y: str | None = None) -> tuple[float, float]:
        """Add two same-shape 2-D blocks (raw storage dtypes) whose rows start at ``row``.

        ``dtype_y`` (default: ``dtype``) lets a float32 reference meet a bfloat16 target; then
        each block is widened to float64 on the fly. Returns this piece's (sum d^2, sum x^2 + y^2).
        """
        return self.add_many([(row, x, y, dtype, dtype_y or dtype)], piece_sums=True)[0]

    def add_many(self, items: list[tuple[int, np.ndarray, np.ndarray, str, str]], *, exclusive: bool = False,
                 piece_sums: bool = False) -> list[tuple[float, float]]:
        """:meth:`add` for several pieces ``(row, x, y, dtype, dtype_y)``, run on the threads together.

        Pieces are cut into blocks of at most ``block_bytes`` and handed to the kernels in
        batches of about ``block_bytes``, which bounds the float64 copies of mixed dtypes.
        ``exclusive``: every row is covered once (no column pieces), so the kernels write the
        row sums in place. ``piece_sums``: also return each piece's (sum d^2, sum x^2 + y^2);
        otherwise zeros (it costs a reduction per block).
        """
        per_item = [[0.0, 0.0] for _ in items]
        batch: list[tuple[int, int, np.ndarray, np.ndarray, str, str]] = []
        batch_bytes = 0
        for k, (row, x, y, dtype, dtype_y) in enumerate(items):
            if x.shape != y.shape:
                raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
            kdtype = "F64" if dtype != dtype_y or dtype not in _FLOAT else dtype
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
        return [(dd, norm) for dd, norm in per_item]

    def _run(self, batch: list[tuple[int, int, np.ndarray, np.ndarray, str, str]], per_item: list[list[float]],
             exclusive: bool, piece_sums: bool) -> None:
        blocks = []
        for _, _, xb, yb, dtype, dtype_y in batch:
            if dtype != dtype_y or dtype not in _FLOAT:  # integers, bools, mixed floats: compare in float64
                blocks.append((to_float64(xb, dtype), to_float64(yb, dtype_y), "F64"))
            else:
                blocks.append((xb, yb, dtype))
        outs = [self.sums[row:row + xb.shape[0]] for _, row, xb, _, _, _ in batch] if exclusive else None
        for (k, row, xb, _, _, _), s in zip(batch, row_stats_many(blocks, threads=self.threads, outs=outs),
                                             strict=True):
            if not exclusive:
                self.sums[row:row + xb.shape[0]] += s.row
            if piece_sums:
                dd, xx, yy = s.row[:, :3].sum(axis=0).tolist()
                per_item[k][0] += dd
                per_item[k][1] += xx + yy
            self.max_abs = max(self.max_abs, s.max_abs)
            self.sum_abs += s.sum_abs
            for i, v in enumerate((s.nan_x, s.inf_x, s.nan_y, s.inf_y)):
                self.counts[i] += v

    def finish(self) -> PairStats:
        c = self.counts
        return _finish(self.sums, self.max_abs, self.sum_abs, (c[0], c[1], c[2], c[3]), self.elements)


def pair_stats(x: np.ndarray, y: np.ndarray, dtype: str, dtype_y: str | None = None, *, threads: int = 2,
               block_bytes: int = BLOCK_BYTES) -> PairStats:
    """Metrics of two same-shape arrays in raw storage dtype ``dtype`` (e.g. memory-mapped).

    Viewed as ``[rows, last dim]``; streams over blocks of rows so that only one block of each
    side is touched at a time.
    """
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    x2, y2 = _as_2d(x), _as_2d(y)
    acc = StatsAccumulator(x2.shape[0], threads=threads, block_bytes=block_bytes)
    acc.add(0, x2, y2, dtype, dtype_y)
    return acc.finish()


def _finish(sums: np.ndarray, max_abs: float, sum_abs: float, counts: tuple[int, int, int, int],
            n: int) -> PairStats:
    dd, xx, yy, xy, bad = (sums[:, i] for i in range(5))
    denom = xx + yy
    with np.errstate(divide="ignore", invalid="ignore"):
        token = np.where(denom > 0, dd / np.where(denom > 0, denom, 1.0), 0.0)
    token[bad > 0] = np.inf
    mismatches = int(bad.sum())
    tdd, txx, tyy, txy = float(dd.sum()), float(xx.sum()), float(yy.sum()), float(xy.sum())
    if mismatches:
        rel, max_abs = math.inf, math.inf
    else:
        rel = tdd / (txx + tyy) if txx + tyy > 0 else 0.0
    if txx > 0 and tyy > 0:
        cosine = txy / math.sqrt(txx * tyy)
    else:
        cosine = 1.0 if txx == tyy else 0.0
    compared = max(1, n - mismatches)
    return PairStats(rel_diff=rel, token_rel_diff=token, max_abs_diff=max_abs, mean_abs_diff=sum_abs / compared,
                     cosine=cosine, nan_x=counts[0], inf_x=counts[1], nan_y=counts[2], inf_y=counts[3],
                     nonfinite_mismatches=mismatches)


def rel_diff(x: np.ndarray, y: np.ndarray) -> float:
    """rel_diff of two float arrays of the same shape (any float dtype), in float64."""
    x = np.asarray(x)
    y = np.asarray(y)
    dtype = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(x.dtype)
    if dtype is None or y.dtype != x.dtype:
        x, y, dtype = x.astype(np.float64), y.astype(np.float64), "F64"
    return pair_stats(np.ascontiguousarray(x), np.ascontiguousarray(y), dtype).rel_diff
