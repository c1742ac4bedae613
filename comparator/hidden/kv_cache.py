"""The KV cache in a comparison: each dump's read-back check, and fp8 against a cache of the model's dtype.

Each dump that recorded the cache points (:mod:`dumper.hooks.kv_cache`) says in ``extra.kv_cache``
whether every row its queries read was the row written there; a failure on either side fails the
comparison, naming the sequence, the query's position, the position read and whose row it was.

When one side's cache is fp8 and the other's is not, their ``k_cache``/``v_cache`` rows differ by
design. Those points are then judged against what fp8 rounding of the other side's row
predicts (:func:`fp8_rounding`: the row quantized with a scale that puts its largest element at
the format's largest, the best any scale can do): a row whose error is more than
:data:`FP8_FACTOR` times that is a failure (a wrong scale, saturation, a cache write that lost
bits), and the table says, per layer and point, the worst ratio, its token and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dumper.format.points import CACHE_POINTS

__all__ = [
    "FP8_FACTOR",
    "FP8_DTYPES",
    "fp8_rounding",
    "Fp8Row",
    "KvCacheVerdict",
    "readback_of",
    "fp8_sides",
]

FP8_FACTOR = 4.0
"""A cache row fails when its error is more than this many times what fp8 rounding of the row predicts
(``bench/bench_kv_cache.py`` measures the benign ratio on the real checkpoint)."""
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_TINY = 1e-30


def fp8_rounding(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row of ``rows`` ``[n, width]``: the rel_diff that rounding it to ``dtype`` (fp8) predicts, with the row's
    own best scale (its absmax at the format's largest value): ``|x - q(x)|^2 / (|x|^2 + |q(x)|^2)``."""
    x = rows.to(torch.float64)
    top = float(torch.finfo(dtype).max)
    scale = (x.abs().amax(dim=1, keepdim=True) / top).clamp_min(_TINY)
    q = (x / scale).to(torch.float32).to(dtype).to(torch.float64) * scale
    num = (x - q).square().sum(dim=1)
    den = x.square().sum(dim=1) + q.square().sum(dim=1)
    return torch.where(den > 0, num / den.clamp_min(_TINY), torch.zeros_like(num))


@dataclass(frozen=True)
class Fp8Row:
    """One layer and cache point of an fp8-vs-auto comparison: its worst row against fp8 rounding."""

    name: str
    layer: int | None
    point: str
    ratio: float  # the largest error / predicted rounding over the rows (nan: a NaN row)
    rel_diff: float  # that row's rel_diff
    predicted: float  # what fp8 rounding of that row predicts
    token: int | None
    sequence: int | None
    head: int | None  # the kv head whose columns differ most in that row
    rows_over: int  # rows beyond FP8_FACTOR x their rounding
    rows: int

    @property
    def passed(self) -> bool:
        return bool(self.ratio <= FP8_FACTOR)  # NaN fails

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "point": self.point,
            "ratio": None if np.isnan(self.ratio) else self.ratio,
            "rel_diff": None if np.isnan(self.rel_diff) else self.rel_diff,
            "predicted": self.predicted,
            "token": self.token,
            "sequence": self.sequence,
            "head": self.head,
            "rows_over": self.rows_over,
            "rows": self.rows,
            "passed": self.passed,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fp8Row:
        nan = float("nan")
        return cls(
            name=str(d["name"]),
            layer=d.get("layer"),
            point=str(d["point"]),
            ratio=nan if d.get("ratio") is None else float(d["ratio"]),
            rel_diff=nan if d.get("rel_diff") is None else float(d["rel_diff"]),
            predicted=float(d.get("predicted") or 0.0),
            token=d.get("token"),
            sequence=d.get("sequence"),
            head=d.get("head"),
            rows_over=int(d.get("rows_over", 0)),
            rows=int(d.get("rows", 0)),
        )


@dataclass(frozen=True)
class KvCacheVerdict:
    """The cache part of a report: each side's read-back check and, fp8 against auto, the per-layer table."""

    readback: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> extra.kv_cache.readback
    fp8: tuple[Fp8Row, ...] = ()
    fp8_side: str | None = None  # the side whose cache is fp8 (None: no fp8-vs-auto judgement)
    dtypes: dict[str, str] = field(default_factory=dict)  # side -> its cache dtype

    @property
    def passed(self) -> bool:
        return all(int(r.get("failed", 0)) == 0 for r in self.readback.values()) and all(r.passed for r in self.fp8)

    def sentences(self) -> list[str]:
        """What the verdict says of the cache: read-back failures first, then fp8 rows beyond rounding."""
        out = []
        for side, r in sorted(self.readback.items()):
            fails = r.get("failures") or []
            if int(r.get("failed", 0)) and fails:
                f = fails[0]
                found = (
                    f"the row written for sequence {f['written_by']['sequence']} position {f['written_by']['position']}"
                    if f.get("written_by")
                    else "a row no recorded token wrote"
                )
                out.append(
                    f"KV cache read-back failed on the {side}: sequence {f['sequence']}'s query at position "
                    f"{f['query_position']} read {found} as its position {f['read_position']} (layer {f['layer']} "
                    f"{f['point']}{', rank ' + str(f['rank']) if 'rank' in f else ''}); {r['failed']} of "
                    f"{r['checked']} rows read were not the rows written there"
                )
        bad = [r for r in self.fp8 if not r.passed]
        if bad:
            w = bad[0]
            ratio = "NaN" if np.isnan(w.ratio) else f"{w.ratio:.1f}x"
            out.append(
                f"the {self.fp8_side}'s fp8 KV cache at layer {w.layer}'s {w.point} is {ratio} what fp8 rounding "
                f"predicts at token {w.token} of sequence {w.sequence} (kv head {w.head}; {w.rows_over} of "
                f"{w.rows} rows beyond {FP8_FACTOR:g}x): the cache write or its scale is wrong"
                + (f"; also {', '.join(f'layer {r.layer} {r.point}' for r in bad[1:4])}" if len(bad) > 1 else "")
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "readback": self.readback,
            "fp8_side": self.fp8_side,
            "dtypes": self.dtypes,
            "fp8": [r.to_json() for r in self.fp8],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KvCacheVerdict:
        return cls(
            readback=dict(d.get("readback") or {}),
            fp8=tuple(Fp8Row.from_json(r) for r in d.get("fp8") or ()),
            fp8_side=d.get("fp8_side"),
            dtypes=dict(d.get("dtypes") or {}),
        )


def readback_of(extra: dict[str, Any]) -> dict[str, Any] | None:
    """A dump's read-back check (``extra.kv_cache.readback``), None when it recorded no cache points."""
    kv = extra.get("kv_cache")
    return kv.get("readback") if isinstance(kv, dict) and isinstance(kv.get("readback"), dict) else None


def fp8_sides(base_extra: dict[str, Any], target_extra: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(the side whose cache alone is fp8, else None; each side's cache dtype)."""
    dtypes = {
        side: str(e["kv_cache"].get("dtype"))
        for side, e in (("baseline", base_extra), ("target", target_extra))
        if isinstance(e.get("kv_cache"), dict)
    }
    fp8 = [s for s, d in dtypes.items() if d in FP8_DTYPES]
    other = [s for s in dtypes if s not in fp8]
    return (fp8[0] if len(fp8) == 1 and len(other) == 1 else None), dtypes


def is_cache_point(point: str | None) -> bool:
    return point in CACHE_POINTS
