"""Measured noise as a value: what benign variation looks like for one baseline (the content of NOISE.json).

A noise file (``NOISE.json``, written by ``python -m comparator calibrate``, read and written by
:mod:`comparator.noise.file`) holds, per captured tensor name (one layer and capture point), the
largest whole-tensor rel_diff and the per-token rel_diff distribution (max, p99.9, p99) that benign
re-runs of the baseline's inputs showed, plus the logprob metrics of the same re-runs
(:class:`~comparator.judging.logprob_noise.LogprobNoise`). Where the calibration compared decode
dumps (``--new-tokens``), each tensor also holds the per-token distribution of each phase apart
(``phases``: prompt rows and decode rows, :class:`PhaseNoise`), as decode has kernels and noise of
its own. Thresholds derived from it are :mod:`comparator.judging.noise_thresholds`.

The file is untrusted input, read by :meth:`NoiseModel.from_json` alone (``--noise`` and the run
store): exact types (:mod:`comparator.judging.fields`), each tensor once, every tensor noise value a
rel_diff and so at most 2. A calibration from variants of another model is recorded
(``model_mismatch``) and becomes a warning of every verdict judged by it.

Example::

    from comparator.noise.file import load_noise
    noise = load_noise("NOISE.json")
    noise.tensor("model.layers.3.self_attn.input").token_max
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from comparator.judging.fields import REL_DIFF_MAX, bad, integer, items, number, record, text
from comparator.judging.identity import IDENTITY_FIELDS, REPORTED_FIELDS, IdentityDifference
from comparator.judging.logprob_noise import LogprobNoise
from comparator.judging.router_noise import RouterNoise, router_noise_from_json, router_noise_to_json
from comparator.judging.row_noise import RowNoiseSet, RowsRef
from dumper.errors import CorruptDumpError, UsageError
from dumper.format import Manifest
from dumper.format.decode import PHASES
from dumper.format.files import show
from dumper.format.jsonfloat import to_json_float
from dumper.format.sketch import SketchSpec, check_spec
from dumper.format.validate import check_model

__all__ = ["NOISE_FORMAT", "PhaseNoise", "TensorNoise", "NoiseModel", "layout", "layout_change"]

NOISE_FORMAT = "driftscope-noise/1"
_MATCH_FIELDS = ("architecture", "num_layers", "hidden_size", "config_hash", "weights_hash")
_TOP_KEYS = ("format", "baseline", "variants", "model", "dtype", "tensors", "logprobs")
_LAYOUT_KEYS = ("attn", "compiled", "chunk_size", "batch_size", "padding_side")
"""The run settings in a dump's manifest (``extra``) that decide how its rows are rounded, beside the engine's."""


def layout(manifest: Manifest) -> dict[str, Any]:
    """How a dump's rows were computed, as far as rounding goes: the engine, its settings but the dtype (vLLM's
    attention backend, chunked prefill budget, compile mode...) and the run's attention kernel, chunk size and
    batch. Two runs with the same layout round alike; a layout the calibration did not run can round some rows
    beyond their calibrated noise (docs/calibration.md, "Row noise")."""
    extra = manifest.extra
    engine = extra.get("engine") if isinstance(extra.get("engine"), dict) else {}
    settings = engine.get("settings") if isinstance(engine.get("settings"), dict) else {}
    out: dict[str, Any] = {"engine": engine.get("name", "transformers")}
    out.update({k: v for k, v in settings.items() if k != "dtype" and _scalar(v)})
    out.update({k: extra[k] for k in _LAYOUT_KEYS if k in extra and _scalar(extra[k])})
    return out


def _scalar(v: Any) -> bool:
    return v is None or type(v) in (str, int, float, bool)


def layout_change(base: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    """``other``'s settings where they differ from ``base``'s, as ``key=value`` words
    (``"attn=sdpa chunk_size=11"``)."""
    keys = [k for k in {**base, **other} if base.get(k) != other.get(k)]
    return " ".join(f"{k}={other.get(k)}" for k in keys) or "the same settings"


_TENSOR_KEYS = ("name", "layer", "point", "rel_diff", "token_max", "token_p999", "token_p99", "positions", "by_variant")
_NOISE_VALUES = ("rel_diff", "token_max", "token_p999", "token_p99")
_PHASE_KEYS = ("token_max", "token_p999", "token_p99", "positions")
_MISMATCH_KEYS = ("variant", "field", "baseline", "target")
_MISMATCH_FIELDS = (*IDENTITY_FIELDS, *REPORTED_FIELDS)


@dataclass(frozen=True)
class PhaseNoise:
    """The per-token rel_diff distribution of one tensor's rows of one phase (prompt or decode rows)."""

    token_max: float
    token_p999: float
    token_p99: float
    positions: int

    def to_json(self) -> dict[str, Any]:
        return {
            "token_max": to_json_float(self.token_max),
            "token_p999": to_json_float(self.token_p999),
            "token_p99": to_json_float(self.token_p99),
            "positions": self.positions,
        }

    @classmethod
    def from_json(cls, d: Any, where: str, field: str) -> PhaseNoise:
        d = record(d, where, field, _PHASE_KEYS)
        return cls(
            **{k: number(d[k], where, f"{field} {k}", high=REL_DIFF_MAX) for k in _PHASE_KEYS[:3]},
            positions=integer(d["positions"], where, f"{field} positions"),
        )


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
    phases: Mapping[str, PhaseNoise] = field(default_factory=dict)
    """Per phase (``prefill``, ``decode``), the per-token values of its rows alone; empty when no decode
    row was compared (the token values above are then all prompt rows)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "point": self.point,
            "rel_diff": to_json_float(self.rel_diff),
            "token_max": to_json_float(self.token_max),
            "token_p999": to_json_float(self.token_p999),
            "token_p99": to_json_float(self.token_p99),
            "positions": self.positions,
            "by_variant": [to_json_float(v) for v in self.by_variant],
            **({"phases": {k: v.to_json() for k, v in self.phases.items()}} if self.phases else {}),
        }

    @classmethod
    def from_json(cls, d: Any, where: str, field: str = "tensor", *, variants: int | None = None) -> TensorNoise:
        """One tensor entry (``field``: where it sits), exact types; every noise value is a rel_diff, so in
        ``[0, 2]``; ``variants``: how many ``by_variant`` must hold."""
        d = record(d, where, field, _TENSOR_KEYS, ("phases",))
        name = text(d["name"], where, f"{field}.name", name=True)
        at = f"{field} {show(name)}"
        values = {k: number(d[k], where, f"{at} {k}", high=REL_DIFF_MAX) for k in _NOISE_VALUES}
        per = items(d["by_variant"], where, f"{at} by_variant", length=variants)
        phases = record(d.get("phases", {}), where, f"{at} phases", (), PHASES)
        return cls(
            name=name,
            layer=integer(d["layer"], where, f"{at} layer", low=None, null=True),
            point=text(d["point"], where, f"{at} point", null=True),
            **values,
            positions=integer(d["positions"], where, f"{at} positions"),
            by_variant=tuple(number(v, where, f"{at} by_variant[{j}]", high=REL_DIFF_MAX) for j, v in enumerate(per)),
            phases={k: PhaseNoise.from_json(phases[k], where, f"{at} phases.{k}") for k in PHASES if k in phases},
        )


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
    not a re-run of the baseline's model (:func:`comparator.judging.identity.check_variant`)."""
    router: Mapping[int, RouterNoise] = field(default_factory=dict)
    """Benign routing variation per MoE layer (:mod:`comparator.judging.router_noise`); empty: none recorded."""
    sketch: SketchSpec | None = None
    """The projection the variants were compared under when either side was a sketch dump (its estimates'
    spread is then part of the noise); None: calibrated on full dumps."""
    rows: RowNoiseSet | None = None
    """Each tensor's noise row by row (:mod:`comparator.judging.row_noise`), from the side file NOISE.json names;
    None: pooled noise only."""
    layouts: tuple[Mapping[str, Any], ...] = ()
    """The :func:`layout` of the baseline and of each variant, in that order (empty: not recorded, or not every
    source was a dump)."""
    rows_ref: RowsRef | None = field(default=None, compare=False)
    """NOISE.json's reference to its side file (set by :func:`comparator.noise.file.save_noise` and on reading)."""
    source: str | None = field(default=None, compare=False)
    """The file it was read from (not stored)."""

    def tensor(self, name: str) -> TensorNoise | None:
        return self.tensors.get(name)

    def check_baseline(self, manifest: Manifest, where: str) -> None:
        """Refuse to judge ``manifest``'s dump with noise measured on another model, weights or dtype."""
        label = self.source or "the noise file"
        dtype = manifest.capture_signature.get("dtype")
        if self.dtype is not None and dtype is not None and dtype != self.dtype:
            raise UsageError(
                f"{label}: calibrated on {self.dtype} dumps, but {where} is {dtype}; "
                "noise does not carry across dtypes: recalibrate"
            )
        for key in _MATCH_FIELDS:
            a, b = self.model.get(key), manifest.model.get(key)
            if a is not None and b is not None and a != b:
                raise UsageError(
                    f"{label}: calibrated on a baseline with {key} {a!r}, but {where} has {b!r}; "
                    "recalibrate against this baseline (python -m comparator calibrate)"
                )

    def identical_variants(self) -> tuple[str, ...]:
        """The variants whose hidden states were bit-identical to the baseline's (every per-token rel_diff 0)."""
        if not self.tensors:
            return ()
        return tuple(
            v
            for i, v in enumerate(self.variants)
            if all(len(t.by_variant) > i and t.by_variant[i] == 0 for t in self.tensors.values())
        )

    def identical_warning(self) -> str | None:
        """What calibrating says when some variants add no noise to measure; None when each one differed."""
        same = self.identical_variants()
        if not same:
            return None
        return (
            f"{len(same)} of {len(self.variants)} variants are bit-identical to the baseline ({', '.join(same)}): "
            f"they measure no noise, so the noise rests on {len(self.variants) - len(same)} variant(s); a layout "
            'outside the calibration can exceed a row\'s noise several times (docs/calibration.md, "Row noise"): '
            "add variants that change the numerics, e.g. the other attention kernel with other chunk sizes"
        )

    def holdout_warning(self, factor: float) -> str | None:
        """What calibrating says when a variant held out of the others exceeds ``factor`` x their row noise (a layout
        outside the calibration can then fail by row noise); None when none does, or none could be held out."""
        held = self.rows.holdout if self.rows is not None else None
        if held is None or held.ratio <= factor:
            return None
        return (
            f"variant {self.variants[held.variant]}, held out of the others, reaches {held.ratio:.3g}x their row "
            f"noise ({held.tensor}, sequence {held.sequence}, position {held.position}), over the factor "
            f"{factor:g}: a layout outside the calibration can fail by row noise; calibrate with the layouts your "
            'candidates run (docs/calibration.md, "Row noise")'
        )

    def mismatch_warning(self) -> str | None:
        """What a verdict judged by this noise says when it was calibrated across models; None when it was not."""
        if not self.model_mismatch:
            return None
        shown = "; ".join(f"variant {v}: {d}" for v, d in self.model_mismatch[:3])
        more = f" and {len(self.model_mismatch) - 3} more" if len(self.model_mismatch) > 3 else ""
        return (
            f"{self.source or 'the noise'}: calibrated with --allow-model-mismatch from variants that are not "
            f"re-runs of the baseline's model ({shown}{more}): that difference was measured as noise and can "
            "excuse a real change"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": NOISE_FORMAT,
            "baseline": self.baseline,
            "variants": list(self.variants),
            "model": dict(self.model),
            "dtype": self.dtype,
            "tensors": [t.to_json() for t in self.tensors.values()],
            "logprobs": self.logprobs.to_json() if self.logprobs is not None else None,
            "model_mismatch": [
                {"variant": v, "field": d.field, "baseline": d.baseline, "target": d.target}
                for v, d in self.model_mismatch
            ],
            **({"layouts": [dict(x) for x in self.layouts]} if self.layouts else {}),
            **({"router": router_noise_to_json(self.router)} if self.router else {}),
            **({"sketch": self.sketch.to_json()} if self.sketch is not None else {}),
            **({"rows": self.rows_ref.to_json()} if self.rows_ref is not None else {}),
        }

    def covers_layout(self, target: Mapping[str, Any]) -> bool:
        """Whether ``target`` (a :func:`layout`) is the baseline's or a variant's; True when none were recorded."""
        return not self.layouts or any(dict(x) == dict(target) for x in self.layouts)

    def sketch_warning(self, sketch: SketchSpec | None) -> str | None:
        """What a verdict says when this noise was measured on other dumps than it judges: full vs sketched."""
        if sketch == self.sketch:
            return None
        label = self.source or "the noise"
        if self.sketch is None:
            return (
                f"{label}: calibrated on full dumps but judging a sketch comparison ({sketch.describe()}): its "
                f"estimates spread by about {sketch.spread:.0%} more than the calibration saw; calibrate with "
                "sketch dumps of the same --sketch for noise that includes it"
            )
        now = "full dumps" if sketch is None else f"a sketch of {sketch.describe()}"
        return (
            f"{label}: calibrated on sketch comparisons ({self.sketch.describe()}) but judging {now}: "
            "the thresholds were measured for another estimate; recalibrate with the same dumps"
        )

    @classmethod
    def from_json(cls, d: Any, where: str) -> NoiseModel:
        """The one reader of a noise file's JSON (:func:`comparator.noise.file.load_noise`, the run store), with the
        rules of the module doc."""
        if type(d) is not dict or d.get("format") != NOISE_FORMAT:
            raise UsageError(
                f'{where}: not a driftscope noise file (expected "format": {NOISE_FORMAT!r}); '
                "write one with python -m comparator calibrate"
            )
        d = record(d, where, "top level", _TOP_KEYS, ("model_mismatch", "router", "sketch", "rows", "layouts"))
        variants = tuple(
            text(v, where, f"variants[{i}]") for i, v in enumerate(items(d["variants"], where, "variants"))
        )
        if not variants:
            raise UsageError(f"{where}: variants: a noise file needs at least one variant")
        tensors: dict[str, TensorNoise] = {}
        seen: dict[str, int] = {}
        for i, entry in enumerate(items(d["tensors"], where, "tensors")):
            t = TensorNoise.from_json(entry, where, f"tensors[{i}]", variants=len(variants))
            if t.name in seen:
                raise UsageError(
                    f"{where}: tensors[{i}]: tensor {show(t.name)} is listed twice (also tensors"
                    f"[{seen[t.name]}]); a noise file holds one entry per tensor"
                )
            tensors[t.name], seen[t.name] = t, i
        lp = d["logprobs"]
        try:
            model = check_model(d["model"], where)
        except CorruptDumpError as e:
            raise UsageError(str(e)) from None
        return cls(
            baseline=text(d["baseline"], where, "baseline"),
            variants=variants,
            tensors=tensors,
            logprobs=None if lp is None else LogprobNoise.from_json(lp, where, variants=len(variants)),
            model=model,
            dtype=text(d["dtype"], where, "dtype", null=True),
            model_mismatch=_mismatch_from_json(d.get("model_mismatch", []), set(variants), where),
            router=router_noise_from_json(d.get("router", []), where),
            source=where,
            sketch=_sketch_from_json(d.get("sketch"), where),
            rows_ref=None if "rows" not in d else RowsRef.from_json(d["rows"], where, set(tensors), len(variants)),
            layouts=_layouts_from_json(d.get("layouts", []), where, len(variants)),
        )


def _layouts_from_json(v: Any, where: str, variants: int) -> tuple[dict[str, Any], ...]:
    """``layouts``: absent, or one flat object of scalars for the baseline and each variant."""
    out = []
    for i, x in enumerate(items(v, where, "layouts")):
        if type(x) is not dict or not all(type(k) is str and _scalar(e) for k, e in x.items()) or len(x) > 64:
            raise bad(where, f"layouts[{i}]", "an object of up to 64 settings, each a string, number, bool or null", x)
        out.append(x)
    if out and len(out) != variants + 1:
        raise bad(where, "layouts", f"{variants + 1} layouts (the baseline's and each variant's)", len(out))
    return tuple(out)


def _sketch_from_json(v: Any, where: str) -> SketchSpec | None:
    """``sketch``: absent or null for noise from full dumps, else the projection (``kind``, ``k``, ``seed``)."""
    try:
        return None if v is None else check_spec(v, where, "sketch")
    except CorruptDumpError as e:
        raise UsageError(str(e)) from None


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
        out.append(
            (
                variant,
                IdentityDifference(
                    e["field"],
                    _identity_value(e["baseline"], where, f"{at}.baseline"),
                    _identity_value(e["target"], where, f"{at}.target"),
                ),
            )
        )
    return tuple(out)
