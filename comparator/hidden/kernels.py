"""Per-row difference statistics of two raw blocks: the hot loop of the comparator.

:func:`row_stats` hands C-contiguous ``[rows, cols]`` blocks in their raw storage dtype
(safetensors ``F64``/``F32``/``F16``/``BF16``; bfloat16 as ``uint16`` bits) to the C
extension :mod:`comparator._kernels`, which splits them over a few threads of its own (with the
GIL released). Without the extension it falls back to :func:`row_stats_reference`, a plain numpy
float64 version of the same semantics that the tests also use as the oracle.

Semantics: ``a``, ``b`` are the elements widened to float64 and ``d = a - b``. Finite pairs
feed ``row[r] = (sum d^2, sum a^2, sum b^2, sum a*b, ·)`` and the block's ``max |d|`` and
``sum |d|``. A pair where either side is NaN/Inf is left out of the sums: NaN/NaN and
equal infinities count as equal, anything else adds 1 to ``row[r, 4]`` (mismatches).

Range: finite float64 values can square past float64's range (1e300) or below it (1e-300).
With ``scaled=True`` the statistics come as a scaled sum of squares: ``exps[r] = (kx, ky)``
says the true sums are ``row[r, :4] * (4**max(kx, ky), 4**kx, 4**ky, 2**(kx + ky))`` and
the true ``sum |d|`` is ``sum_abs * 2**sum_abs_exp`` (see :func:`col_exps`). Only F64 rows
whose sums leave a safe range are scaled (F32/F16/BF16 squares always fit), so exponents
are almost always 0. Without ``scaled`` the true sums are returned, rounded to float64.

Example::

    import numpy as np
    from comparator.hidden.kernels import row_stats
    x = np.ones((2, 3), np.float32)
    row_stats(x, x, "F32").row[:, 0]   # array([0., 0.])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dumper.format import to_float64
from dumper.format.dtypes import FLOAT_CODES, STORAGE_DTYPES

try:
    from comparator import _kernels
except ImportError:  # optional extension not built: numpy fallback
    _kernels = None

__all__ = [
    "BlockStats",
    "HAVE_EXTENSION",
    "MIN_SCALE_EXP",
    "UNIT_BYTES",
    "col_exps",
    "ldexp_or_inf",
    "row_stats",
    "row_stats_many",
    "row_stats_reference",
    "sum_scaled",
]

HAVE_EXTENSION: bool = _kernels is not None
"""Whether the C extension is importable (else :func:`row_stats` uses the numpy fallback)."""

_STORAGE: dict[str, np.dtype] = {code: STORAGE_DTYPES[code].newbyteorder("=") for code in sorted(FLOAT_CODES)}
"""Native-order numpy storage dtype the kernel reads for each float dtype (from the one dtype table)."""

MIN_SCALE_EXP = -1021
"""Smallest row scale exponent (2**1021 is still a float64); the one of an all-zero side."""

UNIT_BYTES = 1 << 20
"""Bytes of one side per unit of work handed to a thread: small enough to balance two cores
over a few blocks, big enough that the per-unit cost is noise."""


@dataclass(frozen=True)
class BlockStats:
    """Statistics of one ``[rows, cols]`` block pair (see the module docstring)."""

    row: np.ndarray  # [rows, 5] float64: sum d^2, sum a^2, sum b^2, sum a*b, mismatches
    max_abs: float  # max |d| over finite pairs (0.0 if none; inf only past float64's range)
    sum_abs: float  # sum |d| over finite pairs, times 2**-sum_abs_exp
    nan_x: int
    inf_x: int
    nan_y: int
    inf_y: int
    exps: np.ndarray | None = None  # [rows, 2] int32 (kx, ky) when ``row`` is scaled; None: true sums
    sum_abs_exp: int = 0
    scaled_rows: int = 0  # rows whose exps may be nonzero (0: all are (0, 0), nothing to rescale)

    def unscaled(self) -> BlockStats:
        """The same statistics with true sums, rounded to float64 (inf where they exceed it)."""
        if self.exps is None:
            return self
        row = self.row
        if self.scaled_rows:
            row = row.copy()
            with np.errstate(over="ignore"):
                row[:, :4] = np.ldexp(row[:, :4], col_exps(self.exps))
        return BlockStats(
            row,
            self.max_abs,
            ldexp_or_inf(self.sum_abs, self.sum_abs_exp),
            self.nan_x,
            self.inf_x,
            self.nan_y,
            self.inf_y,
        )


def ldexp_or_inf(v: float, e: int) -> float:
    """``v * 2**e`` rounded to float64: +-inf past its range (math.ldexp raises there)."""
    try:
        return math.ldexp(v, e)
    except OverflowError:
        return math.copysign(math.inf, v)


def col_exps(exps: np.ndarray) -> np.ndarray:
    """Binary exponent of each sum column: [rows, 4] int32 (2 max(kx, ky), 2 kx, 2 ky, kx + ky)."""
    kx, ky = exps[:, 0], exps[:, 1]
    return np.stack([2 * np.maximum(kx, ky), 2 * kx, 2 * ky, kx + ky], axis=1)


def sum_scaled(parts: Iterable[tuple[float, int]]) -> tuple[float, int]:
    """Sum of finite ``v * 2**e`` over ``(v, e)`` parts, as ``(s, E)`` meaning ``s * 2**E``.

    Unscaled parts (all ``e == 0``, the common case) are simply added if that stays finite.
    Otherwise each part is written as ``m * 2**e`` with ``|m| < 1`` and all are scaled to the
    largest exponent, so nothing overflows; what that drops (a part below 2**-1074 of the
    largest) float64 could not hold in the sum anyway.
    """
    parts = list(parts)
    if all(e == 0 for _, e in parts):
        total = sum(v for v, _ in parts)
        if math.isfinite(total):
            return float(total), 0
    live = []
    for v, e in parts:
        if v != 0.0:
            m, k = math.frexp(v)
            live.append((m, e + k))
    if not live:
        return 0.0, 0
    top = max(e for _, e in live)
    m, k = math.frexp(math.fsum(math.ldexp(v, e - top) for v, e in live))
    return m, top + k


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


def row_stats(x: np.ndarray, y: np.ndarray, dtype: str, *, threads: int = 2, scaled: bool = False) -> BlockStats:
    """Per-row and block statistics of two same-shape 2-D blocks of raw dtype ``dtype``.

    Uses the C kernel on row ranges in parallel (up to ``threads``), or the numpy reference
    when the extension is not built. ``scaled``: see the module docstring.
    """
    return row_stats_many([(x, y, dtype)], threads=threads, scaled=scaled)[0]


def _check_outs(outs: Sequence[np.ndarray], checked: list, cols: int, dtype: type, what: str) -> None:
    """Raise unless ``outs`` holds one C-contiguous ``dtype`` [rows, cols] array per block."""
    ok = len(outs) == len(checked)
    for o, (x, _, _) in zip(outs, checked, strict=False):
        ok = ok and o.dtype == dtype and o.shape == (x.shape[0], cols) and o.flags.c_contiguous
    if not ok:
        raise ValueError(f"{what} must be one C-contiguous {np.dtype(dtype).name} [rows, {cols}] array per block")


def row_stats_many(
    blocks: Sequence[tuple[np.ndarray, np.ndarray, str]],
    *,
    threads: int = 2,
    outs: Sequence[np.ndarray] | None = None,
    exps: Sequence[np.ndarray] | None = None,
    scaled: bool = False,
) -> list[BlockStats]:
    """:func:`row_stats` of several block pairs at once, spread over ``threads`` together.

    Blocks are cut into row ranges of about :data:`UNIT_BYTES` that ``threads`` threads of the
    extension pull from one shared counter, so many small blocks (the chunks of a chunked
    prefill) keep both cores busy with one call, not one per block (more than the extension's
    ``MAX_THREADS`` are clamped to it). ``outs`` (C-contiguous float64 [rows, 5], one per block)
    receive the per-row sums directly, saving a copy when the caller accumulates them anyway;
    ``exps`` (int32 [rows, 2], only with ``scaled``) likewise receive the row scales. ``scaled``:
    return the sums as scaled sums of squares (module docstring), which no finite input can overflow.
    """
    checked = []
    for x, y, dtype in blocks:
        if dtype not in _STORAGE:
            raise ValueError(f"unsupported dtype {dtype!r} (want one of {sorted(_STORAGE)})")
        if x.shape != y.shape:
            raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
        checked.append((_checked(x, "x", dtype), _checked(y, "y", dtype), dtype))
    if exps is not None and not scaled:
        raise ValueError("exps needs scaled=True")
    if _kernels is None:
        ref = [row_stats_reference(x, y, dtype, scaled=scaled) for x, y, dtype in checked]
        for o, r in zip(outs or (), ref, strict=False):
            o[...] = r.row
        for e, r in zip(exps or (), ref, strict=False):
            e[...] = r.exps
        return ref
    if outs is None:
        outs = [np.empty((x.shape[0], 5), dtype=np.float64) for x, _, _ in checked]
    else:
        _check_outs(outs, checked, 5, np.float64, "outs")
    if exps is not None:
        _check_outs(exps, checked, 2, np.int32, "exps")
    elif scaled:
        exps = [np.empty((x.shape[0], 2), dtype=np.int32) for x, _, _ in checked]
    results = _run_units(checked, outs, exps, threads)
    return [
        _merge_units(out, None if exps is None else exps[b], rs)
        for b, (out, rs) in enumerate(zip(outs, results, strict=True))
    ]


def _run_units(
    checked: list[tuple[np.ndarray, np.ndarray, str]],
    outs: Sequence[np.ndarray],
    exps: Sequence[np.ndarray] | None,
    threads: int,
) -> list[list[tuple]]:
    """Run the kernel on row ranges of about UNIT_BYTES; each block's list of kernel results.

    One ``_kernels.row_stats_many`` call runs them all on the extension's own threads: no
    Python thread wakes per tensor, and the GIL stays free for the whole call.
    """
    units: list[tuple] = []
    owners: list[int] = []
    for b, (x, y, dtype) in enumerate(checked):
        rows, cols = x.shape
        parts = max(1, min(rows, -(-x.nbytes // UNIT_BYTES)))
        for i in range(parts):
            lo, hi = rows * i // parts, rows * (i + 1) // parts
            args = (
                (x, y, dtype, rows, cols, outs[b])
                if parts == 1
                else (x[lo:hi], y[lo:hi], dtype, hi - lo, cols, outs[b][lo:hi])
            )
            if exps is not None:
                args += (exps[b] if parts == 1 else exps[b][lo:hi],)
            units.append(args)
            owners.append(b)
    merged: list[list[tuple]] = [[] for _ in checked]
    for b, r in zip(owners, _kernels.row_stats_many(units, max(1, min(threads, _kernels.MAX_THREADS))), strict=True):
        merged[b].append(r)
    return merged


def _merge_units(out: np.ndarray, exps: np.ndarray | None, rs: list[tuple]) -> BlockStats:
    """One block's BlockStats from the kernel results of its row ranges."""
    if len(rs) == 1:
        r = rs[0]
        return BlockStats(out, *r[:6], exps, *r[6:])
    if exps is not None:
        sum_abs, sum_exp = sum_scaled((r[1], r[6]) for r in rs)
        scaled_rows = sum(r[7] for r in rs)
    else:
        sum_abs = float(sum(r[1] for r in rs))
        sum_exp = 0
        scaled_rows = 0
    return BlockStats(
        row=out,
        max_abs=max(r[0] for r in rs),
        sum_abs=sum_abs,
        nan_x=sum(r[2] for r in rs),
        inf_x=sum(r[3] for r in rs),
        nan_y=sum(r[4] for r in rs),
        inf_y=sum(r[5] for r in rs),
        exps=exps,
        sum_abs_exp=sum_exp,
        scaled_rows=scaled_rows,
    )


def _row_exps(v: np.ndarray) -> np.ndarray:
    """Per row, the power of two that brings max |v| into [0.5, 1) (the kernel's scale_exp).

    An all-zero row gets the smallest, :data:`MIN_SCALE_EXP`, so that the scale of d (the
    larger of the two sides') follows the other side.
    """
    m = np.abs(v).max(axis=1, initial=0.0)
    e = np.frexp(m)[1]
    return np.clip(np.where(m > 0, e, MIN_SCALE_EXP), MIN_SCALE_EXP, 1023).astype(np.int32)


def row_stats_reference(x: np.ndarray, y: np.ndarray, dtype: str, *, scaled: bool = False) -> BlockStats:
    """Straightforward numpy float64 version of :func:`row_stats` (oracle and fallback).

    F64 rows are always scaled by their largest finite |value| (exact powers of two) before
    squaring; F32/F16/BF16 squares cannot leave float64's range and are not scaled.
    """
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"need two same-shape 2-D arrays, got {x.shape} and {y.shape}")
    wa, wb = to_float64(x, dtype), to_float64(y, dtype)
    nan_a, nan_b = np.isnan(wa), np.isnan(wb)
    finite = np.isfinite(wa) & np.isfinite(wb)
    with np.errstate(invalid="ignore"):  # inf - inf only in pairs masked out anyway
        equal = (nan_a & nan_b) | (wa == wb)
    a, b = np.where(finite, wa, 0.0), np.where(finite, wb, 0.0)
    rows = x.shape[0]
    exps = np.zeros((rows, 2), np.int32)
    if dtype == "F64":
        exps[:, 0], exps[:, 1] = _row_exps(a), _row_exps(b)
    k = np.maximum(exps[:, :1], exps[:, 1:])  # [rows, 1]: the scale of d
    if exps.any():
        d = np.ldexp(a, -k) - np.ldexp(b, -k)
        a, b = np.ldexp(a, -exps[:, :1]), np.ldexp(b, -exps[:, 1:])
    else:
        d = a - b
    row = np.stack(
        [(d * d).sum(1), (a * a).sum(1), (b * b).sum(1), (a * b).sum(1), (~finite & ~equal).sum(1).astype(np.float64)],
        axis=1,
    )
    # |d| unscaled is exact (inf only past float64's range); a row whose sum |d| overflows
    # takes it from the scaled d instead
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.abs(np.where(finite, wa - wb, 0.0) if exps.any() else d)
        row_abs = e.sum(1)
    ok = np.isfinite(row_abs)
    scaled_abs = np.abs(d).sum(1)
    sum_abs, sum_exp = sum_scaled(
        zip(np.where(ok, row_abs, scaled_abs).tolist(), np.where(ok, 0, k[:, 0]).tolist(), strict=True)
    )
    max_abs = float(e.max(initial=0.0))
    stats = BlockStats(
        row=np.ascontiguousarray(row, dtype=np.float64).reshape(rows, 5),
        max_abs=max_abs,
        sum_abs=sum_abs,
        nan_x=int(nan_a.sum()),
        inf_x=int(np.isinf(wa).sum()),
        nan_y=int(nan_b.sum()),
        inf_y=int(np.isinf(wb).sum()),
        exps=exps,
        sum_abs_exp=sum_exp,
        scaled_rows=int(np.count_nonzero(exps.any(axis=1))),
    )
    return stats if scaled else stats.unscaled()
