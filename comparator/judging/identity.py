"""Model identity: two dumps are only compared when they come from the same model.

A dump's manifest records ``model`` (see :func:`dumper.hooks.fingerprint.model_identity`). The
fields in :data:`IDENTITY_FIELDS` say *which model* computed it; when they differ the
comparison is meaningless (tiny-llama against tiny-qwen2 would read as "diverged at layer
0"), so :func:`check_identity` refuses it unless the caller allows it, as a cross-engine or
quantized comparison may spell the same model differently. Run settings (dtype, attention
implementation, device) are not identity: a float32 reference against a bfloat16 candidate is
exactly what this tool is for. Different weights (``weights_hash``, compared only between dumps
of the same dtype, since it hashes the stored bytes) are reported, not fatal: a fine-tune or a
re-quantization of the same model is a legitimate thing to judge.

Calibration (:func:`check_variant`) is stricter: its variants must be benign re-runs of the
baseline's model, so different weights are refused there too. A variant with other weights
differs by the weights, and that difference, measured as noise, would excuse real changes.

Example::

    from comparator.judging.identity import check_identity
    notes = check_identity(base_manifest, target_manifest, allow_mismatch=False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comparator.judging.runmode import run_mode_notes
from dumper.errors import ModelMismatchError, UsageError
from dumper.format import Manifest
from dumper.format.remote import is_url

__all__ = [
    "IDENTITY_FIELDS",
    "REPORTED_FIELDS",
    "IdentityDifference",
    "identity_differences",
    "weights_differences",
    "check_identity",
    "check_variant",
    "check_distinct",
]

IDENTITY_FIELDS = ("architecture", "num_layers", "hidden_size", "config_hash")
"""Model fields that must agree (compared when both dumps record them)."""
REPORTED_FIELDS = ("weights_hash",)
"""Model fields whose difference is reported in the verdict but does not stop the comparison."""


@dataclass(frozen=True)
class IdentityDifference:
    """One model field that differs between the baseline and the target."""

    field: str
    baseline: Any
    target: Any

    def __str__(self) -> str:
        return f"{self.field} {self.baseline!r} (baseline) vs {self.target!r} (target)"


def _num_layers(m: Manifest) -> Any:
    """Layer count from the model identity, else from the capture signature (older dumps)."""
    v = m.model.get("num_layers")
    return v if v is not None else m.capture_signature.get("num_layers")


def identity_differences(
    baseline: Manifest, target: Manifest, fields: tuple[str, ...] = IDENTITY_FIELDS
) -> list[IdentityDifference]:
    """The ``fields`` that both manifests record (not null) and that differ."""
    out = []
    for f in fields:
        b, t = (
            (_num_layers(baseline), _num_layers(target))
            if f == "num_layers"
            else (baseline.model.get(f), target.model.get(f))
        )
        if b is not None and t is not None and b != t:
            out.append(IdentityDifference(f, b, t))
    return out


def weights_differences(baseline: Manifest, target: Manifest) -> list[IdentityDifference]:
    """A different ``weights_hash``, compared only between dumps of the same dtype: it hashes the
    stored bytes, so it differs whenever the dtype does (compare like with like)."""
    if baseline.capture_signature.get("dtype") != target.capture_signature.get("dtype"):
        return []
    return identity_differences(baseline, target, REPORTED_FIELDS)


def check_identity(
    baseline: Manifest, target: Manifest, *, allow_mismatch: bool = False, where: str = "target"
) -> tuple[str, ...]:
    """Raise :class:`ModelMismatchError` naming the differing fields; return notes for the verdict.

    With ``allow_mismatch`` the differences become notes instead. A different ``weights_hash``
    is always a note, and so are the engines and how each side ran
    (:func:`comparator.judging.runmode.run_mode_notes`): every note about the two dumps is made here.
    """
    diffs = identity_differences(baseline, target)
    if diffs and not allow_mismatch:
        raise ModelMismatchError(
            f"{where}: the dumps come from different models ({'; '.join(map(str, diffs))}); "
            "pass --allow-model-mismatch to compare them anyway (cross-engine or quantized runs)"
        )
    notes = [f"model differs (allowed): {d}" for d in diffs]
    notes += [f"different weights: {d}" for d in weights_differences(baseline, target)]
    # how the weights are stored (gguf:Q8_0, onnx:int8; absent for HF safetensors): reported whatever the dtype
    formats = [baseline.model.get("weights_format") or "hf", target.model.get("weights_format") or "hf"]
    if formats[0] != formats[1]:
        notes.append(f"different weights format: {formats[0]!r} (baseline) vs {formats[1]!r} (target)")
    for side, m in (("baseline", baseline), ("target", target)):
        engine = m.environment.get("engine")
        if engine and engine != "transformers":
            notes.append(f"{side} computed by {engine} {m.environment.get('engine_version') or ''}".rstrip())
    return (*notes, *run_mode_notes(baseline, target))


def check_variant(
    baseline: Manifest, variant: Manifest, *, allow_mismatch: bool = False, where: str = "variant"
) -> list[IdentityDifference]:
    """Refuse a calibration variant that is not a re-run of the baseline's model: an identity field
    or (same dtype) the weights differ. :class:`ModelMismatchError` names the fields; with
    ``allow_mismatch`` the differences are returned, for the noise file to record."""
    diffs = identity_differences(baseline, variant) + weights_differences(baseline, variant)
    if diffs and not allow_mismatch:
        raise ModelMismatchError(
            f"{where}: not a benign re-run of the baseline's model ({'; '.join(map(str, diffs))}): the difference "
            "would be measured as noise and excuse real changes; calibrate from re-runs of the same model and "
            "weights, or pass --allow-model-mismatch to record it in the noise file"
        )
    return diffs


def check_distinct(baseline: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Refuse comparing a dump with itself: it would pass without testing anything (a URL is itself only)."""
    if is_url(baseline) or is_url(target):
        b_url, t_url = (os.fspath(p).rstrip("/") for p in (baseline, target))
        if b_url == t_url:
            raise UsageError(f"{target}: baseline and target are the same dump; nothing would be compared")
        return
    b, t = Path(baseline), Path(target)
    try:
        same = b.exists() and t.exists() and os.path.samefile(b, t)
    except OSError:
        same = False
    if same:
        kind = "directory" if b.is_dir() else "file"
        raise UsageError(f"{target}: baseline and target are the same {kind}; nothing would be compared")
