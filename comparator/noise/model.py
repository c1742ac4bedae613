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

The file is untrusted input, read by :meth:`NoiseModel.from_json` alone (``--noise`` and the run
store): exact types (:mod:`comparator.noise.fields`), each tensor once, every tensor noise value a
rel_diff and so at most 2. Noise that is possible but would excuse what the fixed thresholds
fail (a derived threshold over :data:`EXCESSIVE` x the fixed one) is a warning in the verdict
(:func:`noise_warnings`), as is a calibration from variants of another model (``model_mismatch``).

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

from dumper.errors import CorruptDumpError, DumpError, UsageError
from dumper.format import Manifest, write_json_atomic
from dumper.format.files import parse_json, read_regular_file, show
from dumper.format.validate import check_model

from comparator.hidden.identity import IDENTITY_FIELDS, REPORTED_FIELDS, IdentityDifference
from comparator.jsonfloat import to_json_float
from comparator.noise.fields import EXCESSIVE, REL_DIFF_MAX, bad, integer, items, number, record, text
from comparator.noise.logprobs import LogprobNoise
from comparator.thresholds import parse_assignments

__all__ = ["NOISE_FORMAT", "DEFAULT_FACTOR", "DEFAULT_FLOOR", "EXCESSIVE", "MAX_NOISE_BYTES", "TensorNoise",
           "NoiseModel", "Limits", "noise_warnings", "parse_noise_floor", "check_noise_factor"]

NOISE_FORMAT = "driftscope-noise/1"
DEFAULT_FACTOR = 3.0
"""Safety factor over the calibrated noise. A benign layout not used for calibration reached at
most 1.14x the calibrated maximum on the presets (README, "Calibrated verdicts"); 3x leaves 2.6x
room for that and still fails a change at 4x the noise."""
DEFAULT_FLOOR = 1e-12
"""Absolute rel_diff floor: a threshold never drops below it, so a calibration of bit-identical
re-runs (noise 0) still passes float32 rounding of the same computation (about 1e-14)."""
MAX_NOISE_BYTES = 64 << 20
"""Largest noise file read (``--noise`` and the run store's ``noise.json``); a few KiB per tensor when sound."""
_MATCH_FIELDS = ("architecture", "num_layers", "hidden_size", "config_hash", "weights_hash")
_TOP_KEYS = ("format", "baseline", "variants", "model", "dtype", "tensors", "logprobs")
_TENSOR_KEYS = ("name", "layer", "point", "rel_diff", "token_max", "token_p999", "token_p99", "positions",
                "by_variant")
_NOISE_VALUES = ("rel_diff", "token_max", "token_p999", "token_p99")
_MISMATCH_KEYS = ("variant", "field", "baseline", "target")
_MISMATCH_FIELDS = (*IDENTITY_FIELDS, *REPORTED_FIELDS)


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
    def from_json(cls, d: Any, where: str, field: str = "tensor", *, variants: int | None = None) -> TensorNoise:
        """One tensor entry (``field``: where it sits), exact types; every noise value is a rel_diff, so in
        ``[0, 2]``; ``variants``: how many ``by_variant`` must hold."""
        d = record(d, where, field, _TENSOR_KEYS)
        name = text(d["name"], where, f"{field}.name", name=True)
        at = f"{field} {show(name)}"
        values = {k: number(d[k], where, f"{at} {k}", high=REL_DIFF_MAX) for k in _NOISE_VALUES}
        per = items(d["by_variant"], where, f"{at} by_variant", length=variants)
        return cls(name=name, layer=integer(d["layer"], where, f"{at} layer", low=None, null=True),
                   point=text(d["point"], where, f"{at} point", null=True), **values,
                   positions=integer(d["positions"], where, f"{at} positions"),
                   by_variant=tuple(number(v, where, f"{at} by_variant[{j}]", high=REL_DIFF_MAX)
                                    for j, v in enumerate(per)))


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
    model_mismatch: tuple[tuple[str, IdentityDifference], ...] = ()
    """(variant, difference) of each variant calibrated with ``--allow-model-mismatch`` although it is
    not a re-run of the baseline's model (:func:`comparator.hidden.identity.check_variant`)."""
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

    def mismatch_warning(self) -> str | None:
        """What a verdict judged by this noise says when it was calibrated across models; None when it was not."""
        if not self.model_mismatch:
            return None
        shown = "; ".join(f"variant {v}: {d}" for v, d in self.model_mismatch[:3])
        more = f" and {len(self.model_mismatch) - 3} more" if len(self.model_mismatch) > 3 else ""
        return (f"{self.source or 'the noise'}: calibrated with --allow-model-mismatch from variants that are not "
                f"re-runs of the baseline's model ({shown}{more}): that difference was measured as noise and can "
                "excuse a real change")

    def to_json(self) -> dict[str, Any]:
        return {"format": NOISE_FORMAT, "baseline": self.baseline, "variants": list(self.variants),
                "model": dict(self.model), "dtype": self.dtype,
                "tensors": [t.to_json() for t in self.tensors.values()],
                "logprobs": self.logprobs.to_json() if self.logprobs is not None else None,
                "model_mismatch": [{"variant": v, "field": d.field, "baseline": d.baseline, "target": d.target}
                                   for v, d in self.model_mismatch]}

    @classmethod
    def from_json(cls, d: Any, where: str) -> NoiseModel:
        """The one reader of a noise file's JSON (:meth:`load`, the run store), with the rules of the module doc."""
        if type(d) is not dict or d.get("format") != NOISE_FORMAT:
            raise UsageError(f"{where}: not a driftscope noise file (expected \"format\": {NOISE_FORMAT!r}); "
                             "write one with python -m comparator calibrate")
        d = record(d, where, "top level", _TOP_KEYS, ("model_mismatch",))
        variants = tuple(text(v, where, f"variants[{i}]")
                         for i, v in enumerate(items(d["variants"], where, "variants")))
        if not variants:
            raise UsageError(f"{where}: variants: a noise file needs at least one variant")
        tensors: dict[str, TensorNoise] = {}
        seen: dict[str, int] = {}
        for i, entry in enumerate(items(d["tensors"], where, "tensors")):
            t = TensorNoise.from_json(entry, where, f"tensors[{i}]", variants=len(variants))
            if t.name in seen:
                raise UsageError(f"{where}: tensors[{i}]: tensor {show(t.name)} is listed twice (also tensors"
                                 f"[{seen[t.name]}]); a noise file holds one entry per tensor")
            tensors[t.name], seen[t.name] = t, i
        lp = d["logprobs"]
        try:
            model = check_model(d["model"], where)
        except CorruptDumpError as e:
            raise UsageError(str(e)) from None
        return cls(baseline=text(d["baseline"], where, "baseline"), variants=variants, tensors=tensors,
                   logprobs=None if lp is None else LogprobNoise.from_json(lp, where, variants=len(variants)),
                   model=model, dtype=text(d["dtype"], where, "dtype", null=True),
                   model_mismatch=_mismatch_from_json(d.get("model_mismatch", []), set(variants), where), source=where)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename)."""
        try:
            write_json_atomic(path, self.to_json())
        except OSError as e:
            raise UsageError(f"{path}: cannot write the noise file ({e.strerror})") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NoiseModel:
        """Read and validate a noise file; any problem is a one-line :class:`UsageError` naming it.

        Read as untrusted (:func:`~dumper.format.files.read_regular_file`): a FIFO or a device is refused
        without blocking, a file over :data:`MAX_NOISE_BYTES` before it is read; then :meth:`from_json`.
        """
        where = str(path)
        try:  # the bytes go straight to the parser, which drops them once decoded
            d = parse_json(read_regular_file(Path(path), MAX_NOISE_BYTES, "noise file"), where, "noise file")
        except DumpError as e:  # the reader's one-line message, as a usage error
            raise UsageError(str(e)) from None
        return cls.from_json(d, where)


def _identity_value(v: Any, where: str, field: str) -> Any:
    """A model identity value: a string or an integer (the types of :func:`dumper.format.validate.check_model`)."""
    return integer(v, where, field, low=None) if type(v) is int else text(v, where, field)


def _mismatch_from_json(v: Any, variants: set[str], where: str) -> tuple[tuple[str, IdentityDifference], ...]:
    """``model_mismatch``: each entry names one of the file's variants and one identity field."""
    out = []
    for i, e in enumerate(items(v, where, "model_mismatch")):
        at = f"model_mismatch[{i}]"
        e = record(e, where, at, _MISMATCH_KEYS)
        variant = text(e["variant"], where, f"{at}.variant")
        if variant not in variants:
            raise bad(where, f"{at}.variant", "one of the file's variants", variant)
        if e["field"] not in _MISMATCH_FIELDS:
            raise bad(where, f"{at}.field", f"one of {list(_MISMATCH_FIELDS)}", e["field"])
        out.append((variant, IdentityDifference(e["field"], _identity_value(e["baseline"], where, f"{at}.baseline"),
                                                _identity_value(e["target"], where, f"{at}.target"))))
    return tuple(out)


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


def noise_warnings(noise: NoiseModel, limits: Mapping[str, Limits], fixed: tuple[float, float]) -> tuple[str, ...]:
    """What a verdict judged against ``noise`` must warn about.

    A calibration across models (:meth:`NoiseModel.mismatch_warning`), and the tensors whose
    thresholds (``limits``, by name, of the tensors judged) derived from noise exceed
    :data:`EXCESSIVE` x the ``fixed`` (rel_diff, per-token) thresholds they replace: such noise lets
    pass what the fixed thresholds fail (a noise value of 1 passes unrelated tensors).
    """
    out = [w for w in (noise.mismatch_warning(),) if w is not None]
    calibrated = {n: lim for n, lim in limits.items() if lim.noise is not None}
    over = [(n, lim) for n, lim in calibrated.items()
            if lim.threshold > EXCESSIVE * fixed[0] or lim.token_threshold > EXCESSIVE * fixed[1]]
    if over:
        name, lim = over[0]
        out.append(f"{noise.source or 'the noise'}: the noise-derived thresholds of {len(over)} of {len(calibrated)} "
                   f"calibrated tensors are over {EXCESSIVE:g}x the fixed thresholds they replace (e.g. {name}: "
                   f"rel_diff <= {lim.threshold:.3g}, per-token <= {lim.token_threshold:.3g}; fixed {fixed[0]:g} and "
                   f"{fixed[1]:g}): differences the fixed thresholds fail pass; recalibrate from benign re-runs")
    return tuple(out)


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
