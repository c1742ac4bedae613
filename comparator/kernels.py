"""Per-row difference statistics of two raw blocks: the hot loop of the comparator.

:func:`row_stats` hands C-contiguous ``[rows, cols]`` blocks in their raw storage dtype
(safetensors ``F64``/``F32``/``F16``/``BF16``; bfloat16 as ``uint16`` bits) to the C
extension :mod:`comparator._kernels`, split over a few threads (the kernel releases the
GIL). Without the extension it falls back to :func:`row_stats_reference`, a plain numpy
float64 version of the same semantics that the tests also use as the oracle.

Semantics: ``a``, ``b`` are the elements widened to float64 and ``d = a - b``. Finite pairs
feed ``row[r] = (sum d^2, sum a^2, sum b^2, sum a*b, ·)`` and the block's ``max |d|`` and
``sum |d|``. A pair where either side is NaN/Inf is left out of the sums: NaN/NaN and
equal infinities count as equal, anything else adds 1 to ``row[r, 4]`` (mismatches).

Example::

    import numpy as np
    from comparator.kernels import row_stats
    x = np.ones((2, 3), np.float32)
    row_stats(x, x, "F32").row[:, 0]   # array([0., 0.])
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dumper.format import to_float64

try:
    from . import _kernels
except ImportError:  # optional extension not built: numpy fallback
    _kernels = None

__all__ = ["BlockStats", "HAVE_EXTENSION", "UNIT_BYTES", "row_stats", "row_stats_many", "row_stats_reference"]

HAVE_EXTENSION: bool = _kernels is not None
"""Whether the C extension is importable (else :func:`row_stats` uses the numpy fallback)."""

_STORAGE: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
}
"""Native-order numpy storage dtype the kernel reads for each safetensors dtype."""

UNIT_BYTES = 1 << 20
"""Bytes of one side per unit of work handed to a thread: small enough to balance two cores
over a few blocks, big enough that the per-unit cost is noise."""

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


@dataclass(frozen=True)
class BlockStats:
    """Statistics of one ``[rows, cols]`` block pair (see the module docstring)."""

    row: np.ndarray  # [rows, 5] float64: sum d^2, sum a^2, sum b^2, sum a*b, mismatches
    max_abs: float  # max |d| over finite pairs (0.0 if none)
    sum_abs: float  # sum |d| over finite pairs
    nan_x: int
    inf_x: int
    nan_y: int
    inf_y: int


def _executor(workers: int) -> ThreadPoolExecutor:
    """Shared pool with at least ``workers`` threads, created lazily.

    Its tasks are leaf kernel calls only, so nested or concurrent callers cannot deadlock
    it. A smaller old pool is dropped, not shut down: a caller may still be submitting to it.
    """
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            _pool, _pool_size = ThreadPoolExecutor(workers, "driftscope-kernels"), workers
        return _pool


def _checked(a: np.ndarray, name: str, dtype: str) -> np.ndarray:
    """``a`` as the kernel's storage dtype, C-contiguous and aligned (copying only if not)."""
    want = _STORAGE[dtype]
    if a.dtype == want and a.ndim == 2 and a.flags.c_contiguous and a.flags.aligned:
        return a  # the common case, checked cheaply: it runs once per block
    if a.dtype.newbyteorder("=") != want:
        raise TypeError(f"{name} has dtype {a.dtype}, expected {want} for {dtype}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    return np.require(a, want, ["C_CONTIGUOUS", "ALIGNED"])


def row_stats(x: np.ndarray, y: np.ndarray, dtype: str, *, threads: int = 2) -> BlockStats:
    """Per-row and block statistics of two same-shape 2-D blocks of raw dtype ``dtype``.

    Uses the C kernel on row ranges in parallel (up to ``threads``), or the numpy reference
    when the extension is not built.
    """
    return row_stats_many([(x, y, dtype)], threads=threads)[0]


def row_stats_many(blocks: Sequence[tuple[np.ndarray, np.ndarray, str]], *, threads: int = 2,
                   outs: Sequence[np.ndarray] | None = None) -> list[BlockStats]:
    """:func:`row_stats` of several block pairs at once, spread over ``threads`` together.

    Blocks are cut into row ranges of about :data:`UNIT_BYTES` that the caller and
    ``threads - 1`` pool workers pull from one shared counter, so many small blocks (the
    chunks of a chunked prefill) keep both cores busy with one hand-off per call, not one
    per block. ``outs`` (C-contiguous float64 [rows, 5], one per block) receive the per-row
    sums directly, saving a copy when the caller accumulates them anyway.
    """
    checked = []
    for x, y, dtype in blocks:
        if dtype not in _STORAGE:
            raise ValueError(f"unsupported dtype {dtype!r} (want one of {sorted(_STORAGE)})")
        if x.shape != y.shape:
            raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
        checked.append((_checked(x, "x", dtype), _checked(y, "y", dtype), dtype))
    if _kernels is None:
        ref = [row_stats_reference(x, y, dtype) for x, y, dtype in checked]
        for o, r in zip(outs or (), ref, strict=False):
            o[...] = r.row
        return ref
    if outs is None:
        outs = [np.empty((x.shape[0], 5), dtype=np.float64) for x, _, _ in checked]
    elif len(outs) != len(checked) or any(o.shape != (x.shape[0], 5) or o.dtype != np.float64
                                          or not o.flags.c_contiguous for o, (x, _, _) in zip(outs, checked, strict=False)):
        raise ValueError("outs must be one C-contiguous float64 [rows, 5] array per block")
    units: list[tuple[int, int, int]] = []  # (block, first row, end row)
    for b, (x, _, _) in enumerate(checked):
        rows = x.shape[0]
        parts = max(1, min(rows, -(-x.nbytes // UNIT_BYTES)))
        units.extend((b, rows * i // parts, rows * (i + 1) // parts) for i in range(parts))
    results: list[tuple[float, float, int, int, int, int] | None] = [None] * len(units)
    counter = itertools.count()

    def work() -> None:
        while (i := next(counter)) < len(units):  # next() on a count is atomic under the GIL
            b, lo, hi = units[i]
            x, y, dtype = checked[b]
            if lo == 0 and hi == x.shape[0]:
                results[i] = _kernels.row_stats(x, y, dtype, hi, x.shape[1], outs[b])
            else:
                results[i] = _kernels.row_stats(x[lo:hi], y[lo:hi], dtype, hi - lo, x.shape[1], outs[b][lo:hi])

    helpers = min(threads, len(units)) - 1
    futures = [_executor(helpers).submit(work) for _ in range(helpers)] if helpers > 0 else []
    work()
    for f in futures:
        f.result()
    if len(units) == len(checked):  # one unit per block: nothing to merge
        return [BlockStats(out, r[0], r[1], r[2], r[3], r[4], r[5]) for out, r in zip(outs, results, strict=True)]
    merged: list[list] = [[] for _ in checked]
    for (b, _, _), r in zip(units, results, strict=True):
        merged[b].append(r)
    return [
        BlockStats(row=out, max_abs=max(r[0] for r in rs), sum_abs=float(sum(r[1] for r in rs)),
                   nan_x=sum(r[2] for r in rs), inf_x=sum(r[3] for r in rs),
                   nan_y=sum(r[4] for r in rs), inf_y=sum(r[5] for r in rs))
        for out, rs in zip(outs, merged, strict=True)
    ]


def row_stats_reference(x: np.ndarray, y: np.ndarray, dtype: str) -> BlockStats:
    """Straightforward numpy float64 version of :func:`row_stats` (oracle and fallback)."""
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"need two same-shape 2-D arrays, got {x.shape} and {y.shape}")
    wa, wb = to_float64(x, dtype), to_float64(y, dtype)
    nan_a, nan_b = np.isnan(wa), np.isnan(wb)
    finite = np.isfinite(wa) & np.isfinite(wb)
    # inf - inf only in pairs masked out anyway; huge F64 values may overflow like in C
    with np.errstate(invalid="ignore", over="ignore"):
        equal = (nan_a & nan_b) | (wa == wb)
        d = np.where(finite, wa - wb, 0.0)
        a, b = np.where(finite, wa, 0.0), np.where(finite, wb, 0.0)
        row = np.stack([(d * d).sum(1), (a * a).sum(1), (b * b).sum(1), (a * b).sum(1),
                        (~finite & ~equal).sum(1).astype(np.float64)], axis=1)
    e = np.abs(d)
    return BlockStats(
        row=np.ascontiguousarray(row, dtype=np.float64).reshape(x.shape[0], 5),
        max_abs=float(e.max(initial=0.0)),
        sum_abs=float(e.sum()),
        nan_x=int(nan_a.sum()),
        inf_x=int(np.isinf(wa).sum()),
        nan_y=int(nan_b.sum()),
        inf_y=int(np.isinf(wb).sum()),
    )
