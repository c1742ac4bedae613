"""Sketch dumps: each hidden-state row kept as a seeded random projection plus its exact squared norm (no torch).

A full dump costs ``rows x hidden`` values per tensor. A sketch keeps, per row ``x``, ``R x``
(``K`` float32 values, ``R`` a ``K x hidden`` matrix of random signs scaled by ``1/sqrt(K)``) and
``||x||^2`` (float64, exact). Two runs sketched with the same ``R`` give ``R x - R y = R (x - y)``,
and ``||R (x - y)||^2`` estimates ``||x - y||^2`` without bias, with a relative spread of about
``sqrt(2/K)``; with the exact norms that is the per-token ``rel_diff`` the comparator judges.

``R`` is never stored: entry ``(k, j)`` is the top bit of an integer hash of ``(seed, k, j)``
(:func:`sign_bits`), computed with integer operations that give the same bits in numpy here, in
torch on any device (:mod:`dumper.hooks.sketch`) and on any machine. A Gaussian ``R`` would need
transcendental functions, whose last bits differ between libraries and devices.

In a dump: ``capture_signature["sketch"]`` is the :class:`SketchSpec` (``kind``, ``k``, ``seed``);
a sketched record has dtype ``F32``, shape ``[*rows, k]`` and a ``sketch`` field (the width and
dtype of what was projected); its squared norms are the ``F64 [rows]`` tensor under the key
``record.key + NORM_SUFFIX`` in the same data file. The whole-tensor sums the tensor-level
``rel_diff`` needs are sums of those per-row norms.

Example::

    spec = SketchSpec(k=256, seed=0)
    proj = project(rows_float64, spec)   # [rows, 256], what a sketch dump holds for those rows
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from dumper.errors import CorruptDumpError, UsageError
from dumper.format.dtypes import FLOAT_CODES
from dumper.format.points import CACHE_POINTS, INPUT, RESIDUAL, SUBLAYER_POINTS

__all__ = [
    "SKETCH_KINDS",
    "SKETCHED_POINTS",
    "NORM_SUFFIX",
    "MAX_SKETCH_SEED",
    "HASH_MULTIPLIERS",
    "SketchSpec",
    "sign_bits",
    "signs",
    "project",
    "check_spec",
    "check_record_sketch",
    "mix32",
    "hash_keys",
]

SKETCH_KINDS = ("rademacher",)
"""Projection kinds: ``rademacher`` is a dense matrix of random signs (see ``bench/bench_sketch.py`` for why
not a structured transform)."""
SKETCHED_POINTS = (INPUT, RESIDUAL, *CACHE_POINTS, *SUBLAYER_POINTS)
"""The capture points a sketching capture projects: the hidden states (routing, logprobs and explicit records stay
whole, as do tensor-parallel shards, whose columns are not the whole row)."""
NORM_SUFFIX = "/sq_norm"
"""Key suffix of a sketched record's exact squared norms (``F64 [rows]``), in the record's data file."""
MAX_SKETCH_SEED = (1 << 32) - 1
"""Seeds are 32-bit: the hash works on 32-bit lanes so that no product overflows int64 (torch has no uint64)."""
HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
"""The odd multipliers of :func:`mix32` (both below 2**31: a 32-bit value times one stays below 2**63)."""
_MASK = 0xFFFFFFFF
_ROW_SALT = 0x9E3779B9


@dataclass(frozen=True)
class SketchSpec:
    """One projection: ``kind``, ``k`` rows, ``seed``. Two sketches compare only under the same spec."""

    k: int
    seed: int = 0
    kind: str = "rademacher"

    def __post_init__(self) -> None:
        if type(self.k) is not int or self.k < 1:
            raise UsageError(f"sketch K (--sketch) must be an integer >= 1, got {self.k!r}")
        if type(self.seed) is not int or not 0 <= self.seed <= MAX_SKETCH_SEED:
            raise UsageError(
                f"sketch seed (--sketch-seed) must be an integer in 0..{MAX_SKETCH_SEED}, got {self.seed!r}"
            )
        if self.kind not in SKETCH_KINDS:
            raise UsageError(f"sketch kind must be one of {', '.join(SKETCH_KINDS)}, got {self.kind!r}")

    @property
    def spread(self) -> float:
        """The expected relative spread (standard deviation) of a per-token estimate: sqrt(2/K)."""
        return math.sqrt(2.0 / self.k)

    @property
    def scale(self) -> float:
        """What every sign of ``R`` is multiplied by, so that ``E ||R x||^2 = ||x||^2``."""
        return 1.0 / math.sqrt(self.k)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "k": self.k, "seed": self.seed}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SketchSpec:
        """The spec of a ``{"k", "seed", "kind"}`` object (seed and kind optional); bad values are a :class:`UsageError`
        (a manifest's is checked by :func:`check_spec` first)."""
        return cls(k=raw.get("k"), seed=raw.get("seed", 0), kind=raw.get("kind", "rademacher"))

    def describe(self) -> str:
        return f"{self.kind} K={self.k} seed={self.seed}"

    def check_width(self, hidden: int, what: str) -> None:
        """Refuse to sketch a row of ``hidden`` values with ``K > hidden`` (it would grow, not shrink)."""
        if self.k > hidden:
            raise UsageError(f"--sketch {self.k}: {what} has rows of {hidden} values; K must be at most that")


def check_spec(raw: Any, where: str, field: str = "capture_signature.sketch") -> SketchSpec:
    """The :class:`SketchSpec` of a manifest's ``capture_signature["sketch"]`` (or of the file's ``field``: a noise
    file's ``sketch``); one CorruptDumpError line naming that field if hostile."""
    if type(raw) is not dict or set(raw) != {"kind", "k", "seed"}:
        raise CorruptDumpError(f"{where}: {field}: expected an object of kind, k and seed, got {str(raw)[:80]}")
    kind = raw["kind"]
    k = raw["k"]
    seed = raw["seed"]
    if kind not in SKETCH_KINDS:
        raise CorruptDumpError(f"{where}: {field}.kind: expected one of {list(SKETCH_KINDS)}, got {str(kind)[:40]!r}")
    if type(k) is not int or not 1 <= k <= 1 << 20:
        raise CorruptDumpError(f"{where}: {field}.k: expected an integer in 1..{1 << 20}, got {str(k)[:40]}")
    if type(seed) is not int or not 0 <= seed <= MAX_SKETCH_SEED:
        raise CorruptDumpError(
            f"{where}: {field}.seed: expected an integer in 0..{MAX_SKETCH_SEED}, got {str(seed)[:40]}"
        )
    return SketchSpec(k=k, seed=seed, kind=kind)


def check_record_sketch(
    d: dict[str, Any],
    spec: SketchSpec | None,
    i: int,
    where: str,
    locations: set[tuple[str, str]],
    hidden_size: Any = None,
) -> int:
    """Validate the ``sketch`` field of record ``tensors[i]`` (``d``, its other fields checked) against the manifest's
    spec, its shape and dtype, and ``hidden_size`` (the model's, when the manifest says it); claim its norms'
    (file, key) in ``locations``. Returns the norms' bytes.

    Under a sketch spec, a whole floating-point hidden state left full is refused too: a sketching
    capture stores every one sketched (:func:`dumper.hooks.sketch.sketch_for_record`), so such a
    manifest claims a sketch its records are not.
    """
    field = f"tensors[{i}].sketch"
    raw = d.get("sketch")
    shape = d["shape"]
    dtype = d["dtype"]
    if raw is None:
        if (
            spec is not None
            and d.get("point") in SKETCHED_POINTS
            and d.get("shard_dim") is None
            and dtype in FLOAT_CODES
            and shape
        ):
            raise CorruptDumpError(
                f"{where}: tensors[{i}]: a full {d['point']} record ({dtype}{shape}) under "
                "capture_signature.sketch; a sketching capture stores every whole hidden state "
                "sketched"
            )
        return 0
    if spec is None:
        raise CorruptDumpError(f"{where}: {field}: a sketched record in a dump whose capture_signature has no sketch")
    if type(raw) is not dict or set(raw) != {"hidden", "dtype"}:
        raise CorruptDumpError(f"{where}: {field}: expected an object of hidden and dtype, got {str(raw)[:80]}")
    hidden, source = raw["hidden"], raw["dtype"]
    if type(hidden) is not int or not spec.k <= hidden <= 1 << 40:
        raise CorruptDumpError(f"{where}: {field}.hidden: expected an integer >= K={spec.k}, got {str(hidden)[:40]}")
    if type(hidden_size) is int and hidden != hidden_size and d.get("point") not in CACHE_POINTS:  # kv_cache.py's
        raise CorruptDumpError(f"{where}: {field}.hidden: {hidden}, but the model's hidden_size is {hidden_size}")
    if source not in FLOAT_CODES:
        raise CorruptDumpError(
            f"{where}: {field}.dtype: expected one of {sorted(FLOAT_CODES)}, got {str(source)[:40]!r}"
        )
    if dtype != "F32" or not shape or shape[-1] != spec.k:
        raise CorruptDumpError(f"{where}: {field}: a sketch is F32 [..., {spec.k}], the record is {dtype}{shape}")
    norms = (d["file"], d["key"] + NORM_SUFFIX)
    if norms in locations:
        raise CorruptDumpError(f"{where}: tensors[{i}]: its norms' (file, key) {list(norms)} is taken")
    locations.add(norms)
    return 8 * (math.prod(shape[:-1]) if len(shape) > 1 else 1)


def mix32(x: Any) -> Any:
    """A 32-bit integer hash (xorshift-multiply rounds) of values in [0, 2**32); numpy or torch int64/uint64 alike."""
    x = x ^ (x >> 16)
    x = (x * HASH_MULTIPLIERS[0]) & _MASK
    x = x ^ (x >> 15)
    x = (x * HASH_MULTIPLIERS[1]) & _MASK
    return x ^ (x >> 15)


def hash_keys(seed: int, k: int, hidden: int, arange: Any) -> tuple[Any, Any]:
    """The per-row and per-column hash keys of ``R``, given an ``arange(n)`` of the library wanted (numpy or torch)."""
    rows = mix32(arange(k) ^ mix32(seed ^ _ROW_SALT))
    cols = mix32(arange(hidden))
    return rows, cols


def sign_bits(seed: int, k: int, hidden: int) -> np.ndarray:
    """``[k, hidden]`` bool: where ``R`` is negative. The same bits as :func:`dumper.hooks.sketch.sign_matrix`."""
    rows, cols = hash_keys(seed, k, hidden, lambda n: np.arange(n, dtype=np.int64))
    return (mix32(rows[:, None] ^ cols[None, :]) >> 31).astype(bool)


@lru_cache(maxsize=4)
def signs(spec: SketchSpec, hidden: int) -> np.ndarray:
    """``R``'s signs as float64 ``[k, hidden]`` (+1/-1), read-only; cached for the few specs of one comparison."""
    s = np.where(sign_bits(spec.seed, spec.k, hidden), -1.0, 1.0)
    s.setflags(write=False)
    return s


def project(rows: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """``rows`` ``[n, hidden]`` (float64) projected to ``[n, k]`` float64: what a sketch stores for them, exactly
    computed (a capture computes it in float32)."""
    return (rows @ signs(spec, rows.shape[1]).T) * spec.scale
