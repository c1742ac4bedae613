"""Comparing sketch dumps (:mod:`dumper.format.sketch`): any mix of full and sketched sides.

When either dump is a sketch, both are read through a :class:`SketchView`: a sketched record is
read as stored (its ``F32`` projection and ``F64`` squared norms); a full hidden-state record of
the other side is projected on the fly with the sketched side's recorded spec (in float64, a
block of rows at a time, never whole) and its norms are summed from its rows. The rows then align
and stream as any others (:mod:`comparator.hidden.compare`); :func:`sketch_stats` turns the
streamed sums of the projections into the estimates: ``||R(x-y)||^2`` over the exact
``||x||^2 + ||y||^2`` per token and over the tensor. Only metrics that are functions of those
(``Metric.from_norms``) are given; max |diff| and cosine need the whole rows and are left out.

Two sketches compare only under the same projection; anything else is a one-line
:class:`~dumper.errors.NotComparableError` naming both dumps (exit 2).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from comparator.hidden.kernels import col_exps
from comparator.hidden.metrics import PairStats, StatsAccumulator, row_sums_of, stats_of
from dumper.errors import CorruptDumpError, NotComparableError
from dumper.format import DumpReader, Manifest, TensorRecord, to_float64
from dumper.format.dtypes import FLOAT_CODES
from dumper.format.sketch import NORM_SUFFIX, SKETCHED_POINTS, SketchSpec, project

__all__ = [
    "HiddenReader",
    "SketchInfo",
    "SketchView",
    "sketch_readers",
    "sketch_stats",
    "is_sketched",
    "record_sketch_stats",
]

PROJECT_BYTES = 64 << 20
"""Bytes of float64 rows projected at once (bounds the comparator's memory whatever a record's size)."""
_CACHE = 4
"""Projected records kept: a chunked layout reads one record for several runs in a row."""


@dataclass(frozen=True)
class SketchInfo:
    """Which sides of a comparison were sketched, and under which projection."""

    spec: SketchSpec
    baseline: bool
    target: bool

    @property
    def sides(self) -> str:
        return "both sides" if self.baseline and self.target else "the baseline" if self.baseline else "the target"

    def note(self) -> str:
        projected = (
            ""
            if self.baseline and self.target
            else f"; the {'target' if self.baseline else 'baseline'}'s full rows were projected with the same matrix"
        )
        return (
            f"sketch comparison ({self.sides} sketched, {self.spec.describe()}{projected}): rel_diff values are "
            f"estimates with a relative spread of about {self.spec.spread:.1%} (sqrt(2/K)); "
            "max |diff| and cosine need the full tensors and are not available"
        )

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), "baseline": self.baseline, "target": self.target, "spread": self.spec.spread}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SketchInfo:
        return cls(SketchSpec.from_json(d), baseline=bool(d["baseline"]), target=bool(d["target"]))


def _spec(reader: DumpReader) -> SketchSpec | None:
    raw = reader.manifest.capture_signature.get("sketch")
    return None if raw is None else SketchSpec.from_json(raw)  # checked when the manifest was loaded


def is_sketched(rec: TensorRecord) -> bool:
    return rec.sketch is not None


def _projectable(rec: TensorRecord, spec: SketchSpec) -> bool:
    """A full record of a hidden-state point the other side sketched (its rows wide enough to project)."""
    return (
        rec.sketch is None
        and rec.point in SKETCHED_POINTS
        and rec.shard_dim is None
        and rec.dtype in FLOAT_CODES
        and len(rec.shape) >= 1
        and rec.shape[-1] >= spec.k
    )


class SketchView:
    """A dump as a sketch under ``spec``: its hidden-state records projected where they are full.

    Offers what the comparison reads of a :class:`DumpReader`: ``directory``, ``manifest``,
    ``array``, ``rows`` and ``sq_norms`` (``F64 [rows]``).
    """

    def __init__(self, reader: DumpReader, spec: SketchSpec) -> None:
        self.reader, self.spec, self.directory = reader, spec, reader.directory
        self._full: dict[tuple[str, str], TensorRecord] = {}
        records = []
        for rec in reader.manifest.tensors:
            if _projectable(rec, spec):
                self._full[(rec.file, rec.key)] = rec
                rec = replace(
                    rec,
                    shape=(*rec.shape[:-1], spec.k),
                    dtype="F64",
                    sketch={"hidden": rec.shape[-1], "dtype": rec.dtype},
                )
            records.append(rec)
        self.manifest: Manifest = replace(reader.manifest, tensors=tuple(records))
        self._cache: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()  # jobs on several threads share the cache (comparator.hidden.pipeline)

    def _projected(self, rec: TensorRecord) -> tuple[np.ndarray, np.ndarray]:
        """(projection ``[rows, k]``, squared norms ``[rows]``) of a full record, computed once."""
        key = (rec.file, rec.key)
        with self._lock:
            hit = self._cache.get(key)
        if hit is None:  # two threads may both project a record; the numbers are the same
            full = self._full[key]
            rows = self.reader.rows(full)
            block = max(1, PROJECT_BYTES // max(1, 8 * rows.shape[1]))
            proj = np.empty((rows.shape[0], self.spec.k), dtype=np.float64)
            norms = np.empty(rows.shape[0], dtype=np.float64)
            for start in range(0, rows.shape[0], block):
                x = to_float64(rows[start : start + block], full.dtype)
                proj[start : start + block] = project(x, self.spec)
                norms[start : start + block] = np.einsum("ij,ij->i", x, x)
            with self._lock:
                if len(self._cache) >= _CACHE:
                    self._cache.pop(next(iter(self._cache)))
                hit = self._cache[key] = (proj, norms)
        return hit

    def rows(self, rec: TensorRecord) -> np.ndarray:
        return self._projected(rec)[0] if (rec.file, rec.key) in self._full else self.reader.rows(rec)

    def array(self, rec: TensorRecord) -> np.ndarray:
        if (rec.file, rec.key) in self._full:
            return self._projected(rec)[0].reshape(rec.shape)
        return self.reader.array(rec)

    def held(self, rec: TensorRecord) -> str:
        """How the dump holds ``rec``: ``"full"`` (projected here) or ``"sketched"``."""
        return "full" if (rec.file, rec.key) in self._full else "sketched"

    def sq_norms(self, rec: TensorRecord) -> np.ndarray:
        if (rec.file, rec.key) in self._full:
            return self._projected(rec)[1]
        norms = self.reader.sq_norms(rec)
        if (norms < 0).any():  # NaN compares False: a NaN norm is not refused here but fails its row (sketch_stats)
            row = int(np.flatnonzero(norms < 0)[0])
            raise CorruptDumpError(
                f"{self.directory / rec.file}: {rec.key}{NORM_SUFFIX} row {row} is "
                f"{float(norms[row])!r}; a squared norm is >= 0"
            )
        return norms


HiddenReader = DumpReader | SketchView
"""What the hidden-state comparison reads a dump through: the dump itself, or its :class:`SketchView`."""


def sketch_readers(br: DumpReader, tr: DumpReader) -> tuple[HiddenReader, HiddenReader, SketchInfo | None]:
    """Both dumps as the comparison reads them: unchanged when neither is a sketch, else two :class:`SketchView`.

    Raises :class:`NotComparableError` naming both dumps when both are sketches of different projections.
    """
    sb, st = _spec(br), _spec(tr)
    if sb is None and st is None:
        return br, tr, None
    if sb is not None and st is not None and sb != st:
        raise NotComparableError(
            f"{tr.directory}: sketched with {st.describe()} but the baseline {br.directory} with {sb.describe()}; "
            "two sketches compare only under the same projection (dump both with the same --sketch and --sketch-seed)"
        )
    spec = sb or st
    assert spec is not None
    vb, vt = SketchView(br, spec), SketchView(tr, spec)
    _check_widths(vb, vt)
    return vb, vt, SketchInfo(spec, sb is not None, st is not None)


def _check_widths(vb: SketchView, vt: SketchView) -> None:
    """Refuse a hidden state whose rows are one width on one side and another on the other (a sketched record's
    ``sketch.hidden``, a full record's last dim): projections of different widths estimate nothing."""
    wide = {r.name: (r.sketch["hidden"], vb.held(r)) for r in vb.manifest.tensors if r.sketch is not None}
    for r in vt.manifest.tensors:
        if r.sketch is not None and r.name in wide and wide[r.name][0] != r.sketch["hidden"]:
            raise NotComparableError(
                f"{vt.directory}: {r.name} rows are {r.sketch['hidden']} wide ({vt.held(r)}) but the baseline "
                f"{vb.directory}'s are {wide[r.name][0]} ({wide[r.name][1]}); different hidden sizes do not compare"
            )


def sketch_stats(acc: StatsAccumulator, norms_x: np.ndarray, norms_y: np.ndarray) -> PairStats:
    """The estimates from an accumulator that streamed two sides' projections, with their exact squared norms.

    Per row: ``||R(x-y)||^2`` (the streamed ``sum d^2``) over ``||x||^2 + ||y||^2``; a row whose
    projections disagree on NaN/Inf is inf, as in a full comparison. Only the metrics registered
    with ``from_norms`` are given.
    """
    sums = acc.sums.copy()
    if acc.scaled:  # float64 projections near float64's limits: back to true sums (inf past them)
        with np.errstate(over="ignore"):
            sums[:, :4] = np.ldexp(sums[:, :4], col_exps(acc.exps))
    sums[:, 1], sums[:, 2] = norms_x, norms_y
    # a NaN or Inf norm (a hidden state that held one) fails its row, as a NaN/Inf mismatch does: never a pass
    sums[:, 4] += ~(np.isfinite(norms_x) & np.isfinite(norms_y))
    sums[:, 3] = (norms_x + norms_y - sums[:, 0]) / 2  # <x, y> as estimated (no metric given reads it)
    c = acc.counts
    return stats_of(
        row_sums_of(sums, None, math.nan, (math.nan, 0), acc.elements), (c[0], c[1], c[2], c[3]), from_norms=True
    )


def record_sketch_stats(
    b: TensorRecord, t: TensorRecord, br: HiddenReader, tr: HiddenReader, threads: int
) -> PairStats:
    """:func:`sketch_stats` of one pair of sketched records matched by pass (no row positions), of the same shape
    (the caller refuses others)."""
    x, y = br.rows(b), tr.rows(t)
    acc = StatsAccumulator(x.shape[0], threads=threads)
    acc.add_many([(0, x, y, b.dtype, t.dtype)], exclusive=True)
    return sketch_stats(acc, np.asarray(br.sq_norms(b), dtype=np.float64), np.asarray(tr.sq_norms(t), dtype=np.float64))
