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

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dumper.format import to_float64

try:
    from . import _kernels
except ImportError:  # optional extension not built: numpy fallback
    _kernels = None

__all__ = ["BlockStats", "HAVE_EXTENSION", "row_stats", "row_stats_reference"]

HAVE_EXTENSION: bool = _kernels is not None
"""Whether the C extension is importable (else :func:`row_stats` uses the numpy fallback)."""

_STORAGE: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
}
"""Native-order numpy storage dtype the kernel reads for each safetensors dtype."""

_MIN_ELEMS_PER_THREAD = 1 << 16
"""Smaller blocks are not split: a thread hand-off costs more than the work."""

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
    if a.dtype.newbyteorder("=") != want:
        raise TypeError(f"{name} has dtype {a.dtype}, expected {want} for {dtype}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    return np.require(a, want, ["C_CONTIGUOUS", "ALIGNED"])


def row_stats(x: np.ndarray, y: np.ndarray, dtype: str, *, threads: int = 2) -> BlockStats:
    """Per-row and block statistics of two same-shape 2-D blocks of raw dtype ``dtype``.

    Uses the C kernel on up to ``threads`` row ranges in parallel, or the numpy reference
    when the extension is not built.
    """
    if dtype not in _STORAGE:
        raise ValueError(f"unsupported dtype {dtype!r} (want one of {sorted(_STORAGE)})")
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    x, y = _checked(x, "x", dtype), _checked(y, "y", dtype)
    if _kernels is None:
        return row_stats_reference(x, y, dtype)
    rows, cols = x.shape
    out = np.empty((rows, 5), dtype=np.float64)
    parts = max(1, min(threads, rows, rows * cols // _MIN_ELEMS_PER_THREAD))
    bounds = [rows * i // parts for i in range(parts + 1)]

    def run(i: int) -> tuple[float, float, int, int, int, int]:
        lo, hi = bounds[i], bounds[i + 1]
        return _kernels.row_stats(x[lo:hi], y[lo:hi], dtype, hi - lo, cols, out[lo:hi])

    if parts == 1:
        results = [run(0)]
    else:  # the caller runs part 0 itself while the pool runs the rest
        futures = [_executor(parts - 1).submit(run, i) for i in range(1, parts)]
        results = [run(0)] + [f.result() for f in futures]
    return BlockStats(
        row=out,
        max_abs=max(r[0] for r in results),
        sum_abs=float(sum(r[1] for r in results)),
        nan_x=sum(r[2] for r in results),
        inf_x=sum(r[3] for r in results),
        nan_y=sum(r[4] for r in results),
        inf_y=sum(r[5] for r in results),
    )


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
