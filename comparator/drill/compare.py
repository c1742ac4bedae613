"""Two drills of one half, op by op: the first module path whose outputs differ beyond both builds' rounding.

Each log (:mod:`dumper.format.drill`) already judges its own ops against float64; this compares
the two builds against each other. Ops meet by module path and slot (:mod:`comparator.drill.align`),
and a pair is measured on the rows both logs stored at their common tokens::

    ratio(row) = rms(a - b) / (rms(bound_a) + rms(bound_b)),  bound_x = (u(dtype_x) + u(acc_x) * sqrt(K_x)) * |x|

with ``u`` the unit roundoff of the op's output dtype (float64 2^-53, float32 2^-24, bfloat16 2^-8,
float16 2^-11), ``acc`` float32 (float64 for a float64 op) and ``K`` the op's reduction length
(``OpEntry.size``): the rounding model of :mod:`dumper.hooks.drill.rounding`, applied to both
sides. Two rows with the same bits are 0; a NaN or infinity on one side only is infinite, so a NaN
never passes; integer outputs must be equal. A pair without rows counts 0 when the hashes of the
whole outputs agree and is not measured otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from comparator.drill.align import PathPlan, align_ops
from comparator.drill.types import (
    Basis,
    DrillComparison,
    DrillSide,
    OpBrief,
    PairComparison,
    Pairing,
    PathComparison,
    PathStatus,
)
from dumper.errors import NotComparableError, UsageError
from dumper.format.drill import DRILL_NAME, HALF_NAMES, DrillLog, OpEntry, load_drill
from dumper.format.dtypes import unit_roundoff

__all__ = ["compare_drills", "row_ratios", "bound_scale"]


def bound_scale(op: OpEntry) -> float:
    """``u(out) + u(acc) * sqrt(K)``: the rounding of ``op``'s output per unit of its magnitude."""
    dtype = op.outputs[0].dtype if op.outputs else "-"
    u = unit_roundoff(dtype)
    if u == 0.0:
        return 0.0
    acc = unit_roundoff("float64" if dtype == "float64" else "float32")
    return u + acc * math.sqrt(op.size)


def row_ratios(a: np.ndarray, b: np.ndarray, scale_a: float, scale_b: float) -> np.ndarray:
    """Per row of ``a`` and ``b`` (float64 [n, m]): ``rms(a - b) / (scale_a * rms(a) + scale_b * rms(b))``.

    Equal elements (the same infinity, NaN on both sides) count as exact; a row with any other
    non-finite difference is infinite; a row with a zero bound is 0 when exact, else infinite.
    The rows are scaled by their largest finite magnitude first (the ratio does not change), so
    float64 extremes do not overflow.
    """
    n = a.shape[0]
    if a.shape[1] == 0:
        return np.zeros(n)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, a - b)
        bad = ~np.isfinite(diff)
        mag_a = np.where(np.isfinite(a), np.abs(a), 0.0)
        mag_b = np.where(np.isfinite(b), np.abs(b), 0.0)
        diff = np.where(bad, 0.0, np.abs(diff))
        top = np.maximum(np.maximum(mag_a.max(1), mag_b.max(1)), diff.max(1))[:, None]
        top = np.where(top > 0, top, 1.0)
        num = np.sqrt(np.mean(np.square(diff / top), axis=1))
        den = scale_a * np.sqrt(np.mean(np.square(mag_a / top), axis=1))
        den = den + scale_b * np.sqrt(np.mean(np.square(mag_b / top), axis=1))
        ratio = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, math.inf, 0.0))
    return np.where(bad.any(1), math.inf, ratio)


class _Side:
    """One log and the rows of its ops at the common tokens, read once each."""

    def __init__(self, log: DrillLog, common: list[int]) -> None:
        self.log = log
        first = {}
        for i, t in enumerate(log.tokens):
            first.setdefault(t, i)
        self.picks = np.array([first[t] for t in common], dtype=np.int64)
        self._rows: dict[int, np.ndarray] = {}

    def rows(self, op: OpEntry) -> np.ndarray:
        """``op``'s rows at the common tokens, one flat float64 row per token ([len(common), elements])."""
        if op.index not in self._rows:
            rows = self.log.rows(op)
            assert rows is not None  # only called for an op with rows
            picked = np.asarray(rows)[self.picks]
            self._rows[op.index] = picked.reshape(len(self.picks), -1).astype(np.float64)
        return self._rows[op.index]


def _pair(oa: OpEntry, ob: OpEntry, a: _Side, b: _Side, common: list[int]) -> PairComparison:
    """``oa`` against ``ob``: measured on their rows at the common tokens, else by their hashes."""
    if oa.rows is not None and ob.rows is not None and common:
        ra, rb = a.rows(oa), b.rows(ob)
        if ra.shape[1] != rb.shape[1]:
            shapes = f"{list(oa.outputs[0].shape)} vs {list(ob.outputs[0].shape)}"
            note = f"{ra.shape[1]} vs {rb.shape[1]} elements per token ({shapes})"
            return PairComparison(oa.index, ob.index, Basis.NOT_COMPARABLE, None, None, note)
        ratios = row_ratios(ra, rb, bound_scale(oa), bound_scale(ob))
        worst = int(np.argmax(ratios))
        ratio = float(ratios[worst])
        return PairComparison(oa.index, ob.index, Basis.ROWS, ratio, common[worst] if ratio > 0 else None)
    if oa.hash is not None and oa.hash == ob.hash:
        return PairComparison(oa.index, ob.index, Basis.HASH, 0.0, None)
    why = "no common token" if oa.rows is not None and ob.rows is not None else "no rows stored"
    what = "no hash" if oa.hash is None or ob.hash is None else "the hashes differ"
    return PairComparison(oa.index, ob.index, Basis.UNKNOWN, None, None, f"{why} and {what}")


def _brief(op: OpEntry) -> OpBrief:
    out = op.outputs[0] if op.outputs else None
    return OpBrief(
        index=op.index,
        op=op.short_name,
        path=op.path,
        slot=op.slot,
        shape=() if out is None else out.shape,
        dtype="-" if out is None else out.dtype,
        rows=op.rows is not None,
    )


def _path(plan: PathPlan, a: _Side, b: _Side, common: list[int], factor: float) -> PathComparison:
    pairs = tuple(_pair(oa, ob, a, b, common) for oa, ob in plan.pairs)
    measured = [p.ratio for p in pairs if p.ratio is not None]
    if any(not r <= factor for r in measured):
        status = PathStatus.FAIL
    else:
        status = PathStatus.PASS if measured else PathStatus.NOT_COMPARED
    ops_a, ops_b = tuple(map(_brief, plan.ops_a)), tuple(map(_brief, plan.ops_b))
    return PathComparison(plan.path, ops_a, ops_b, plan.pairing, pairs, status)


def _side(log: DrillLog) -> DrillSide:
    bad = log.first_beyond()
    text = lambda k: None if log.header.get(k) is None else str(log.header[k])  # noqa: E731
    return DrillSide(
        path=str(log.path),
        layer=log.layer,
        half=log.half,
        engine=text("engine"),
        dtype=text("dtype"),
        model=text("model"),
        factor=log.factor,
        ops=len(log.ops),
        first_beyond=None if bad is None else _brief(bad),
        first_beyond_ratio=None if bad is None else bad.ratio,
        first_beyond_token=None if bad is None else bad.ratio_token,
        summary=log.summary(),
    )


def _names(ops: tuple[OpBrief, ...]) -> str:
    names = [o.op for o in ops]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _notes(paths: list[PathComparison], log_a: DrillLog, log_b: DrillLog, common: list[int]) -> list[str]:
    notes = []
    if list(log_a.tokens) != list(log_b.tokens):
        tokens = f"A stores tokens {list(log_a.tokens)}, B {list(log_b.tokens)}"
        notes.append(
            f"{tokens}: compared at the common positions {common}"
            if common
            else f"{tokens}: no common position, compared by hashes of the whole outputs only"
        )
    for side, mine in (("A", lambda p: p.ops_a and not p.ops_b), ("B", lambda p: p.ops_b and not p.ops_a)):
        only = [p.path for p in paths if mine(p)]
        if only:
            notes.append(f"only in {side}: {', '.join(only)}")
    for p in paths:
        if p.pairing is Pairing.OUTPUT:
            pa, pb = p.op_a(p.pairs[0].index_a), p.op_b(p.pairs[0].index_b)
            notes.append(
                f"{p.path}: A dispatched {_names(p.ops_a)}; B {_names(p.ops_b)}: compared the module's output "
                f"(A's {pa.op}, B's {pb.op})"
            )
        elif p.pairing is Pairing.NONE and p.ops_a and p.ops_b:
            notes.append(f"{p.path}: no output to pair (neither rows nor a hash on one side)")
        unmeasured = [q for q in p.pairs if q.ratio is None]
        if unmeasured:
            kind = unmeasured[0].basis.value
            notes.append(
                f"{p.path}: {len(unmeasured)} of {len(p.pairs)} pairs not measured ({kind}: {unmeasured[0].note})"
            )
    return notes


def _load(x: DrillLog | str | Path) -> DrillLog:
    return x if isinstance(x, DrillLog) else load_drill(x)


def compare_drills(
    a: DrillLog | str | Path, b: DrillLog | str | Path, *, factor: float | None = None
) -> DrillComparison:
    """Compare drill ``a`` (the baseline build) with drill ``b`` (the candidate) path by path.

    ``factor``: a pair differs beyond noise above this many times the two sides' rounding (default:
    the larger of the two logs' own factors). Raises :class:`~dumper.errors.DumpError` for a log that
    cannot be read, :class:`~dumper.errors.NotComparableError` for logs of different layers or halves,
    or when no op aligns (no pair measured on rows nor matched by hash).
    """
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        raise UsageError(f"factor {factor!r} is not a positive number")
    log_a, log_b = _load(a), _load(b)
    if (log_a.layer, log_a.half) != (log_b.layer, log_b.half):
        where = lambda log: f"{log.path / DRILL_NAME} is layer {log.layer} {HALF_NAMES[log.half]}"  # noqa: E731
        raise NotComparableError(f"{where(log_a)}, {where(log_b)}: only drills of the same layer and half compare")
    limit = max(log_a.factor, log_b.factor) if factor is None else float(factor)
    in_b = set(log_b.tokens)
    common = list(dict.fromkeys(t for t in log_a.tokens if t in in_b))
    side_a, side_b = _Side(log_a, common), _Side(log_b, common)
    paths = [_path(plan, side_a, side_b, common, limit) for plan in align_ops(log_a.ops, log_b.ops)]
    if not any(q.ratio is not None for p in paths for q in p.pairs):
        raise NotComparableError(
            f"no op aligned between A ({log_a.path}) and B ({log_b.path}): no module path holds rows or equal "
            "hashes on both sides"
        )
    return DrillComparison(
        a=_side(log_a),
        b=_side(log_b),
        factor=limit,
        paths=tuple(paths),
        notes=tuple(_notes(paths, log_a, log_b, common)),
    )
