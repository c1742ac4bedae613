"""The results of an invariance sweep (:mod:`dumper.jobs.sweep.run`): one :class:`CellResult` per cell, one
:class:`SweepResult`; each ``to_json`` has its ``from_json``, and the JSON keys are a public contract.

``SweepResult.to_json()`` is ``{"passed", "baseline", "out", "engine", "block_size", "wall_s",
"cells": [{"index", "name", "settings", "passed", "verdict", "reasons", "first_divergent",
"logprobs", "cache_hits", "cache_hits_by_sequence", "report", "dump", "wall_s", "run_s",
"engine_reused"}, ...]}``; ``first_divergent`` is the comparator's
:class:`~comparator.hidden.types.FirstDivergence` JSON, ``report`` the path of the cell's full report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from comparator import FirstDivergence
from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["CellLogprobs", "CellResult", "SweepResult", "PREFIX_CACHE_NOTE", "ZERO_HITS"]

PREFIX_CACHE_NOTE = "n/a (prefix cache)"
"""A prefix-caching cell records no logprobs: vLLM never reads the cache for a request with prompt_logprobs."""
ZERO_HITS = "prefix caching on but 0 cache hits: not exercised"


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class CellLogprobs:
    """A cell's logprob verdict in brief; ``note`` instead when none was recorded by design."""

    passed: bool | None = None
    max_abs_err: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    compared_positions: int = 0
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "max_abs_err": to_json_float(self.max_abs_err),
            "kl_mean": to_json_float(self.kl_mean),
            "kl_max": to_json_float(self.kl_max),
            "compared_positions": self.compared_positions,
            "note": self.note,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CellLogprobs:
        computed = d["passed"] is not None  # a computed max |dlogprob| that was not finite crossed as null
        err = from_json_float(d["max_abs_err"]) if computed else _float(d["max_abs_err"])
        return cls(
            passed=d["passed"],
            max_abs_err=err,
            kl_mean=_float(d["kl_mean"]),
            kl_max=_float(d["kl_max"]),
            compared_positions=int(d["compared_positions"]),
            note=d["note"],
        )


@dataclass(frozen=True)
class CellResult:
    """One cell: its settings, verdict, where it first diverged, its logprobs, cache hits and times.

    ``reasons`` are failures of the cell besides its comparison (a prefix-caching cell that read
    no cache); ``engine_reused`` says whether the run found its engine already loaded.
    """

    index: int
    settings: dict[str, Any]
    passed: bool
    verdict: str
    report: str
    dump: str
    wall_s: float
    run_s: float
    engine_reused: bool
    reasons: tuple[str, ...] = ()
    first_divergent: FirstDivergence | None = None
    logprobs: CellLogprobs | None = None
    cache_hits: int | None = None
    cache_hits_by_sequence: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return f"cell-{self.index:03d}"

    @property
    def first_token(self) -> int | None:
        """The first failing token of the first divergent tensor (where it crosses the threshold)."""
        return None if self.first_divergent is None else self.first_divergent.token

    @property
    def onset(self) -> int | None:
        """Where the comparator estimates the divergence starts (:mod:`comparator.hidden.onset`), else the
        first failing token. An estimate: a run whose first rows are bit-identical and the next within
        rounding may put it at the first inexact row."""
        fd = self.first_divergent
        return None if fd is None else fd.onset if fd.onset is not None else fd.token

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "settings": dict(self.settings),
            "passed": self.passed,
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "first_divergent": None if self.first_divergent is None else self.first_divergent.to_json(),
            "logprobs": None if self.logprobs is None else self.logprobs.to_json(),
            "cache_hits": self.cache_hits,
            "cache_hits_by_sequence": None
            if self.cache_hits_by_sequence is None
            else list(self.cache_hits_by_sequence),
            "report": self.report,
            "dump": self.dump,
            "wall_s": self.wall_s,
            "run_s": self.run_s,
            "engine_reused": self.engine_reused,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CellResult:
        fd = d["first_divergent"]
        lp = d["logprobs"]
        by_seq = d["cache_hits_by_sequence"]
        return cls(
            index=int(d["index"]),
            settings=dict(d["settings"]),
            passed=bool(d["passed"]),
            verdict=str(d["verdict"]),
            report=str(d["report"]),
            dump=str(d["dump"]),
            wall_s=float(d["wall_s"]),
            run_s=float(d["run_s"]),
            engine_reused=bool(d["engine_reused"]),
            reasons=tuple(d["reasons"]),
            first_divergent=None if fd is None else FirstDivergence.from_json(fd),
            logprobs=None if lp is None else CellLogprobs.from_json(lp),
            cache_hits=d["cache_hits"],
            cache_hits_by_sequence=None if by_seq is None else tuple(int(h) for h in by_seq),
        )


@dataclass(frozen=True)
class SweepResult:
    """Every cell of a sweep against one baseline; ``bool(result)`` is "every cell passed"."""

    baseline: str
    out: str
    engine: str
    block_size: int | None
    wall_s: float
    cells: tuple[CellResult, ...]

    @property
    def passed(self) -> bool:
        return bool(self.cells) and all(c.passed for c in self.cells)

    def __bool__(self) -> bool:
        return self.passed

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "baseline": self.baseline,
            "out": self.out,
            "engine": self.engine,
            "block_size": self.block_size,
            "wall_s": self.wall_s,
            "cells": [c.to_json() for c in self.cells],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SweepResult:
        return cls(
            baseline=str(d["baseline"]),
            out=str(d["out"]),
            engine=str(d["engine"]),
            block_size=d["block_size"],
            wall_s=float(d["wall_s"]),
            cells=tuple(CellResult.from_json(c) for c in d["cells"]),
        )
