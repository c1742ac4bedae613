"""Comparison settings: one typed object, defaults overridable by env vars and then by flags."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from comparator.judging.noise_thresholds import (
    DEFAULT_FACTOR,
    DEFAULT_FLOOR,
    NoiseLimits,
    check_noise_factor,
    noise_limits,
    noise_warnings,
)
from comparator.judging.values import is_threshold
from comparator.settings import comparator_settings
from dumper.errors import UsageError

if TYPE_CHECKING:  # a noise file's model loads only with --noise
    from comparator.judging.noise import NoiseModel

__all__ = ["CompareConfig", "DEFAULT_THRESHOLD", "DEFAULT_TOKEN_THRESHOLD", "DEFAULT_ACCEPTANCE_TOLERANCE"]

DEFAULT_THRESHOLD = 1e-3
"""Whole-tensor rel_diff threshold (the seed's nightly default). See docs/verdict.md, "Choosing thresholds"."""
DEFAULT_TOKEN_THRESHOLD = 1e-3
"""Per-token rel_diff threshold: the max-type signal that catches one broken position."""
DEFAULT_ACCEPTANCE_TOLERANCE = 0.02
"""Largest relative drop of a speculative target's acceptance length below the baseline's that passes."""
MAX_THREADS = 256
"""Most metric worker threads (each holds a block of both dumps' rows in flight)."""


@dataclass(frozen=True)
class CompareConfig:
    """How two dumps are compared.

    Attributes:
        threshold: a tensor fails when its rel_diff exceeds this (default 1e-3).
        token_threshold: ... or when any single token's rel_diff exceeds this (default 1e-3).
        threads: worker threads for the metric kernels (default 2).
        logprob_thresholds: explicit logprob thresholds as (name, value) pairs; they win over
            ``DRIFTSCOPE_LOGPROB_*`` and over ``configs/logprob_thresholds.json``.
        model: the row of that table to use (default: the baseline's model name).
        require_all: refuse (exit 2) a comparison in which either side holds tensors the other
            lacks, instead of comparing the common ones and saying so in the verdict.
        allow_model_mismatch: compare dumps of different models (architecture, sizes, config
            hash), for cross-engine or quantized runs; the differences become verdict notes.
        noise: measured noise of the baseline (:mod:`comparator.judging.noise`); each tensor it covers is
            judged by thresholds derived from its own noise instead of the fixed ones.
        noise_factor, noise_floor: the safety factor and absolute rel_diff floor of those thresholds.
        noise_floors: absolute floors of logprob thresholds derived from noise, by metric name.
        fixed_explicit: ``threshold`` / ``token_threshold`` were given (flag or env), so with
            ``noise`` they still apply on top; otherwise the defaults apply only where no noise is known.
        subset: the target holds part of the baseline's rows by design (a truncated prompt, positions a
            prefix cache served): judge the target's rows only (:mod:`comparator.hidden.subset`).
        sequence_map: the target's sequence ``i`` is the baseline's ``sequence_map[i]`` (empty: the same ids).
        row_cover: per sequence, how many leading positions the noise's row noise covers in this comparison
            (set by :func:`~comparator.hidden.compare.compare_dumps` from the token ids; None: no row noise used).
        acceptance_tolerance: two speculative decodes fail when the target's acceptance length is below the
            baseline's by more than this fraction of it (default 0.02; :mod:`comparator.hidden.speculative`).
    """

    threshold: float = DEFAULT_THRESHOLD
    token_threshold: float = DEFAULT_TOKEN_THRESHOLD
    threads: int = 2
    logprob_thresholds: tuple[tuple[str, float | None], ...] = ()
    model: str | None = None
    require_all: bool = False
    allow_model_mismatch: bool = False
    noise: NoiseModel | None = None
    noise_factor: float = DEFAULT_FACTOR
    noise_floor: float = DEFAULT_FLOOR
    noise_floors: tuple[tuple[str, float], ...] = ()
    fixed_explicit: bool = False
    subset: bool = False
    sequence_map: tuple[int, ...] = ()
    row_cover: tuple[int, ...] | None = None
    acceptance_tolerance: float = DEFAULT_ACCEPTANCE_TOLERANCE

    def noise_limits_of(self, name: str) -> NoiseLimits:
        """The thresholds the tensor ``name`` is judged by: from its noise when calibrated, else the fixed ones."""
        entry = self.noise.tensor(name) if self.noise is not None else None
        if entry is None:
            return NoiseLimits(self.threshold, self.token_threshold, None, self.noise_floor)
        fixed = (self.threshold, self.token_threshold) if self.fixed_explicit else None
        rows = self.noise.rows.tensors.get(name) if self.noise.rows is not None and self.row_cover else None
        return noise_limits(entry, self.noise_factor, self.noise_floor, fixed, rows, self.row_cover or ())

    def noise_warnings(self, names: Iterable[str]) -> tuple[str, ...]:
        """What a verdict judged by ``noise`` must warn about, for the tensors ``names`` it judged
        (:func:`comparator.judging.noise_thresholds.noise_warnings`, against the fixed thresholds); ``()``
        without noise."""
        if self.noise is None:
            return ()
        return noise_warnings(
            self.noise, {n: self.noise_limits_of(n) for n in names}, (self.threshold, self.token_threshold)
        )

    def __post_init__(self) -> None:
        for name in ("threshold", "token_threshold"):
            v = getattr(self, name)
            if not is_threshold(v):
                raise UsageError(f"{name} must be a finite number >= 0, got {v!r}")
        check_noise_factor(self.noise_factor)
        if not is_threshold(self.acceptance_tolerance) or self.acceptance_tolerance >= 1:
            raise UsageError(f"acceptance_tolerance must be a number in [0, 1), got {self.acceptance_tolerance!r}")
        if not is_threshold(self.noise_floor):
            raise UsageError(f"noise_floor must be a finite number >= 0, got {self.noise_floor!r}")
        if not 1 <= self.threads <= MAX_THREADS:
            raise UsageError(f"threads must be between 1 and {MAX_THREADS}, got {self.threads}")

    @classmethod
    def resolve(
        cls,
        *,
        threshold: float | None = None,
        token_threshold: float | None = None,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
        logprob_thresholds: Mapping[str, float | None] | None = None,
        model: str | None = None,
        require_all: bool = False,
        allow_model_mismatch: bool = False,
        noise: NoiseModel | None = None,
        noise_factor: float | None = None,
        noise_floors: Mapping[str, float] | None = None,
        acceptance_tolerance: float | None = None,
    ) -> CompareConfig:
        """Flags win over ``DRIFTSCOPE_DIFF_THRESHOLD`` / ``DRIFTSCOPE_TOKEN_THRESHOLD``, which win over defaults.

        ``noise_floors``: as parsed by :func:`comparator.judging.noise_thresholds.parse_noise_floor` (``rel_diff`` and
        logprob metric names). ``acceptance_tolerance`` wins over ``DRIFTSCOPE_ACCEPTANCE_TOLERANCE``, which wins over
        :data:`DEFAULT_ACCEPTANCE_TOLERANCE`.
        """
        s = comparator_settings(env)
        floors = dict(noise_floors or {})
        explicit = any(v is not None for v in (threshold, token_threshold, s.diff_threshold, s.token_threshold))
        return cls(
            threshold=threshold
            if threshold is not None
            else (s.diff_threshold if s.diff_threshold is not None else DEFAULT_THRESHOLD),
            token_threshold=token_threshold
            if token_threshold is not None
            else (s.token_threshold if s.token_threshold is not None else DEFAULT_TOKEN_THRESHOLD),
            threads=threads if threads is not None else 2,
            logprob_thresholds=tuple((logprob_thresholds or {}).items()),
            model=model,
            require_all=require_all,
            allow_model_mismatch=allow_model_mismatch,
            noise=noise,
            noise_factor=noise_factor if noise_factor is not None else DEFAULT_FACTOR,
            noise_floor=floors.pop("rel_diff", DEFAULT_FLOOR),
            noise_floors=tuple(sorted(floors.items())),
            fixed_explicit=explicit,
            acceptance_tolerance=acceptance_tolerance
            if acceptance_tolerance is not None
            else (s.acceptance_tolerance if s.acceptance_tolerance is not None else DEFAULT_ACCEPTANCE_TOLERANCE),
        )
