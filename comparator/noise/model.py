"""Measured noise: what benign variation looks like for one baseline, and thresholds derived from it.

A noise file (``NOISE.json``, written by ``python -m comparator calibrate``) holds, per captured
tensor name (one layer and capture point), the largest whole-tensor rel_diff and the per-token
rel_diff distribution (max, p99.9, p99) that benign re-runs of the baseline's inputs showed, plus
the logprob metrics of the same re-runs (:mod:`comparator.noise.logprobs`). A comparison judged
against it fails a tensor when

    rel_diff           > max(floor, factor * noise rel_diff)        or
    per-token rel_diff > max(floor, factor * noise per-token max)

with ``factor`` :data:`DEFAULT_FACTOR` (3) and ``floor`` :data:`DEFAULT_FLOOR` (``--noise-factor``,
``--noise-floor``); fixed thresholds given explicitly still apply on top. Values are also
reported as multiples of the noise, ``value / max(noise, floor)``.

Example::

    from comparator.noise.model import NoiseModel
    noise = NoiseModel.load("NOISE.json")
    noise.tensor("model.layers.3.self_attn.input").token_max
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dumper.errors import UsageError
from dumper.format import Manifest, write_json_atomic
from dumper.format.files import parse_json

from comparator.jsonfloat import from_json_float, to_json_float
from comparator.noise.logprobs import LogprobNoise
from comparator.thresholds import parse_assignments

__all__ = ["NOISE_FORMAT", "DEFAULT_FACTOR", "DEFAULT_FLOOR", "TensorNoise", "NoiseModel", "Limits",
           "parse_noise_floor", "check_noise_factor"]

NOISE_FORMAT = "driftscope-noise/1"
DEFAULT_FACTOR = 3.0
"""Safety factor over the calibrated noise. A benign layout not used for calibration reached at
most 1.14x the calibrated maximum on the presets (README, "Calibrated verdicts"); 3x leaves 2.6x
room for that and still fails a change at 4x the noise."""
DEFAULT_FLOOR = 1e-12
"""Absolute rel_diff floor: a threshold never drops below it, so a calibration of bit-identical
re-runs (noise 0) still passes float32 rounding of the same computation (about 1e-14)."""
_MATCH_FIELDS = ("architecture", "num_layers", "hidden_size", "config_hash", "weights_hash")
_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorNoise:
    """Benign variation of one captured tensor (a layer's capture point), over every variant and sequence."""

    name: str
    layer: int | None
    point: str | None
    rel_diff: float
    """Largest whole-tensor rel_diff (per sequence) of any variant."""
    token_max: float
    token_p999: float
    token_p99: float
    positions: int
    """Per-token values the quantiles rest on (all variants together)."""
    by_variant: tuple[float, ...] = ()
    """Each variant's largest per-token rel_diff, in variant order."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "layer": self.layer, "point": self.point,
                "rel_diff": to_json_float(self.rel_diff), "token_max": to_json_float(self.token_max),
                "token_p999": to_json_float(self.token_p999), "token_p99": to_json_float(self.token_p99),
                "positions": self.positions, "by_variant": [to_json_float(v) for v in self.by_variant]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> TensorNoise:
        try:
            out = cls(name=str(d["name"]), layer=None if d.get("layer") is None else int(d["layer"]),
                      point=d.get("point"), rel_diff=from_json_float(d["rel_diff"]),
                      token_max=from_json_float(d["token_max"]), token_p999=from_json_float(d["token_p999"]),
                      token_p99=from_json_float(d["token_p99"]), positions=int(d["positions"]),
                      by_variant=tuple(from_json_float(v) for v in d.get("by_variant", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"{where}: malformed tensor entry ({type(e).__name__}: {e})") from None
        for v in (out.rel_diff, out.token_max, out.token_p999, out.token_p99):
            if not (math.isfinite(v) and v >= 0):
                raise UsageError(f"{where}: tensor {out.name!r} has a non-finite or negative noise value; "
                                 "recalibrate with benign variants")
        return out


@dataclass(frozen=True)
class NoiseModel:
    """The noise of one baseline: per tensor name, and of its logprobs (None: no logprobs compared)."""

    baseline: str
    variants: tuple[str, ...]
    tensors: Mapping[str, TensorNoise]
    logprobs: LogprobNoise | None = None
    model: Mapping[str, Any] = field(default_factory=dict)
    """The baseline's model identity (IDENTITY_FIELDS and weights_hash)."""
    dtype: str | None = None
    source: str | None = field(default=None, compare=False)
    """The file it was read from (not stored)."""

    def tensor(self, name: str) -> TensorNoise | None:
        return self.tensors.get(name)

    def check_baseline(self, manifest: Manifest, where: str) -> None:
        """Refuse to judge ``manifest``'s dump with noise measured on another model, weights or dtype."""
        label = self.source or "the noise file"
        dtype = manifest.capture_signature.get("dtype")
        if self.dtype is not None and dtype is not None and dtype != self.dtype:
            raise UsageError(f"{label}: calibrated on {self.dtype} dumps, but {where} is {dtype}; "
                             "noise does not carry across dtypes: recalibrate")
        for key in _MATCH_FIELDS:
            a, b = self.model.get(key), manifest.model.get(key)
            if a is not None and b is not None and a != b:
                raise UsageError(f"{label}: calibrated on a baseline with {key} {a!r}, but {where} has {b!r}; "
                                 "recalibrate against this baseline (python -m comparator calibrate)")

    def to_json(self) -> dict[str, Any]:
        return {"format": NOISE_FORMAT, "baseline": self.baseline, "variants": list(self.variants),
                "model": dict(self.model), "dtype": self.dtype,
                "tensors": [t.to_json() for t in self.tensors.values()],
                "logprobs": self.logprobs.to_json() if self.logprobs is not None else None}

    @classmethod
    def from_json(cls, d: Any, where: str) -> NoiseModel:
        if not isinstance(d, dict) or d.get("format") != NOISE_FORMAT:
            raise UsageError(f"{where}: not a driftscope noise file (expected \"format\": {NOISE_FORMAT!r}); "
                             "write one with python -m comparator calibrate")
        variants, tensors = d.get("variants"), d.get("tensors")
        if not isinstance(variants, list) or not variants or not isinstance(tensors, list):
            raise UsageError(f"{where}: a noise file needs a non-empty \"variants\" list and a \"tensors\" list")
        if not all(isinstance(t, dict) for t in tensors):
            raise UsageError(f"{where}: tensor entries must be objects")
        parsed = [TensorNoise.from_json(t, where) for t in tensors]
        lp = d.get("logprobs")
        return cls(baseline=str(d.get("baseline", "")), variants=tuple(str(v) for v in variants),
                   tensors={t.name: t for t in parsed},
                   logprobs=LogprobNoise.from_json(lp, where) if lp is not None else None,
                   model=dict(d.get("model") or {}), dtype=d.get("dtype"), source=where)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename)."""
        try:
            write_json_atomic(path, self.to_json())
        except OSError as e:
            raise UsageError(f"{path}: cannot write the noise file ({e.strerror})") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NoiseModel:
        """Read and validate a noise file; any problem is a one-line :class:`UsageError` naming it."""
        p = Path(path)
        try:
            if p.stat().st_size > _MAX_BYTES:
                raise UsageError(f"{p}: too large for a noise file (over {_MAX_BYTES >> 20} MiB)")
            raw = p.read_bytes()
        except OSError as e:
            raise UsageError(f"{p}: cannot read the noise file ({e.strerror})") from None
        try:
            d = parse_json(raw, str(p), "noise file")
        except Exception as e:  # DumpError from the JSON reader: same one-line message, as a usage error
            raise UsageError(str(e)) from None
        return cls.from_json(d, str(p))


@dataclass(frozen=True)
class Limits:
    """The thresholds one tensor is judged by, and the noise they came from (None: fixed thresholds)."""

    threshold: float
    token_threshold: float
    noise: TensorNoise | None = None
    floor: float = DEFAULT_FLOOR

    def ratios(self, rel_diff: float, token_max: float) -> tuple[float | None, float | None]:
        """``(noise_ratio, token_noise_ratio)``: the values as multiples of ``max(noise, floor)``."""
        if self.noise is None:
            return None, None
        return (_ratio(rel_diff, max(self.noise.rel_diff, self.floor)),
                _ratio(token_max, max(self.noise.token_max, self.floor)))


def _ratio(value: float, noise: float) -> float:
    return math.inf if math.isnan(value) else value / noise


def noise_limits(noise: TensorNoise, factor: float, floor: float, fixed: tuple[float, float] | None) -> Limits:
    """Thresholds from one tensor's noise; ``fixed`` (explicit thresholds) apply on top."""
    threshold = max(floor, factor * noise.rel_diff)
    token = max(floor, factor * noise.token_max)
    if fixed is not None:
        threshold, token = min(threshold, fixed[0]), min(token, fixed[1])
    return Limits(threshold, token, noise, floor)


def check_noise_factor(factor: float) -> float:
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
        raise UsageError(f"--noise-factor must be a finite number >= 1, got {factor!r}")
    return float(factor)


def parse_noise_floor(items: Sequence[str]) -> dict[str, float]:
    """``--noise-floor VALUE`` (rel_diff) or ``--noise-floor NAME=VALUE`` (a logprob metric) items."""
    floors = parse_assignments(items, flag="--noise-floor", default_name="rel_diff")
    return {name: v for name, v in floors.items() if v is not None}  # None only comes with allow_off
