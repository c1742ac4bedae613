"""The run record (``run.json``), run ids, and one listed entry of a store.

A run id is ``<UTC time to the nanosecond>Z-<6 random hex digits>``, e.g.
``20261130T094716.302031123Z-a1b2c3``: fixed width, so ids sort by creation time, and two
writers starting in the same nanosecond still get different ids.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from comparator.noise.model import NoiseModel
from comparator.outcome import FAIL, PASS, UNUSABLE, status
from comparator.store.errors import StoreError
from dumper.errors import DriftscopeError
from dumper.format.files import is_text, parse_json, printable

__all__ = [
    "RUN_FORMAT_VERSION",
    "LABELS",
    "CALIBRATION_KEYS",
    "StoredNoise",
    "noise_bytes",
    "RunRecord",
    "RunEntry",
    "new_run_id",
    "is_run_id",
    "run_id_time",
    "signature_key",
    "summarize_report",
]

RUN_FORMAT_VERSION = 1
LABELS = ("baseline", "passed", "failed")
"""``baseline``: bootstrapped or promoted by a human; ``passed`` / ``failed``: the verdict against its baseline."""

_RUN_ID = re.compile(r"(\d{8}T\d{6})\.(\d{9})Z-[0-9a-f]{6}", re.ASCII)
_KEYS = ("format_version", "run_id", "created_at", "model", "pass_label", "baseline_run", "summary",
         "capture_signature", "environment", "model_identity", "dump_format_version", "dump_created_at", "promoted",
         "calibration")
_REQUIRED = ("run_id", "created_at", "model", "pass_label", "capture_signature", "environment")
_MAX_DEPTH = 64
"""Deepest JSON nesting a run record may hold (a sound one nests 3 deep)."""
_SCALAR = (str, int, float, bool, type(None))
_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
CALIBRATION_KEYS = ("variants", "created_at", "sha256", "measured_on")
"""Keys of ``run.json``'s ``calibration``: how many benign variants, when, the ``sha256`` of the
stored ``noise.json`` (the pair must agree, so a half-finished recalibration is detected), and
the run whose dump the variants were compared with (the run itself, or the calibrated baseline
a passed run inherited its noise from)."""


def new_run_id(now_ns: int | None = None) -> tuple[str, str]:
    """A fresh run id and its creation time as a UTC ISO string."""
    ns = time.time_ns() if now_ns is None else now_ns
    t = datetime.fromtimestamp(ns // 1_000_000_000, tz=timezone.utc)
    run_id = f"{t:%Y%m%dT%H%M%S}.{ns % 1_000_000_000:09d}Z-{secrets.token_hex(3)}"
    created = t.replace(microsecond=(ns % 1_000_000_000) // 1000).isoformat()
    return run_id, created


def is_run_id(name: object) -> bool:
    return isinstance(name, str) and _RUN_ID.fullmatch(name) is not None


def run_id_time(run_id: str) -> float | None:
    """Creation time (epoch seconds) encoded in a run id, or ``None`` for something else."""
    m = _RUN_ID.fullmatch(run_id)
    if m is None:
        return None
    t = datetime.strptime(m.group(1), "%Y%m%dT%H%M%S").replace(tzinfo=timezone.utc)
    return t.timestamp() + int(m.group(2)) / 1e9


def signature_key(signature: Mapping[str, Any]) -> str:
    """Canonical JSON of a capture signature: equal keys mean exactly equal signatures."""
    return json.dumps(signature, sort_keys=True, separators=(",", ":"))


def summarize_report(report_json: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict summary kept in ``run.json``, from ``Report.to_json()``."""
    lp = report_json.get("logprobs")
    return {
        "passed": bool(report_json["passed"]),
        "matched": int(report_json["matched"]),
        "first_divergent": report_json.get("first_divergent"),
        "logprobs_passed": None if lp is None else bool(lp.get("passed")),
        "threshold": report_json.get("threshold"),
        "token_threshold": report_json.get("token_threshold"),
    }


@dataclass(frozen=True)
class RunRecord:
    """What ``runs/<run_id>/run.json`` holds about one stored run.

    ``pass_label`` is ``"baseline"`` (bootstrapped or promoted), ``"passed"`` or ``"failed"``
    (the verdict against ``baseline_run``); ``summary`` is ``None`` for a bootstrapped run.
    """

    run_id: str
    created_at: str
    model: str
    capture_signature: dict[str, Any]
    environment: dict[str, Any]
    pass_label: str
    baseline_run: str | None = None
    summary: dict[str, Any] | None = None
    model_identity: dict[str, Any] = field(default_factory=dict)
    dump_format_version: int = 1
    dump_created_at: str | None = None
    promoted: dict[str, Any] | None = None
    """``{"at": ISO time, "from": previous label}`` once a human promoted the run."""
    calibration: dict[str, Any] | None = None
    """:data:`CALIBRATION_KEYS` when ``noise.json`` holds the run's measured noise; ``None``: uncalibrated."""
    format_version: int = RUN_FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "run_id": self.run_id,
            "created_at": self.created_at,
            "model": self.model,
            "pass_label": self.pass_label,
            "baseline_run": self.baseline_run,
            "summary": self.summary,
            "capture_signature": self.capture_signature,
            "environment": self.environment,
            "model_identity": self.model_identity,
            "dump_format_version": self.dump_format_version,
            "dump_created_at": self.dump_created_at,
            "promoted": self.promoted,
            # only when set: an uncalibrated record stays readable by versions that predate calibration
            **({"calibration": self.calibration} if self.calibration is not None else {}),
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any, *, folder: str | None = None) -> RunRecord:
        """Parse and validate a decoded ``run.json``; ``folder`` is the run folder's name, if known.

        Strict: no unknown keys, exact types (``true`` is not an integer, ``"3"`` not a number),
        a known ``pass_label``, run ids where run ids belong, a ``summary`` of the shape
        :func:`summarize_report` writes, finite numbers only, bounded nesting, and a ``run_id``
        equal to ``folder``. Raises ``ValueError`` naming the field and what is wrong with it.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {_show(d)}")
        if type(d.get("format_version")) is not int or d["format_version"] != RUN_FORMAT_VERSION:
            raise ValueError(f"run format version {_show(d.get('format_version'))} is not supported "
                             f"(expected {RUN_FORMAT_VERSION})")
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ValueError(f"unexpected keys {', '.join(_show(k) for k in unknown[:5])}{more}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"missing key {missing[0]!r}")
        _check_tree(d)
        _check_fields(d)
        if folder is not None and d["run_id"] != folder:
            raise ValueError(f"field 'run_id': says run id {d['run_id']!r}, but the folder is {printable(folder)!r}")
        return cls(
            run_id=d["run_id"], created_at=d["created_at"], model=d["model"],
            capture_signature=d["capture_signature"], environment=d["environment"], pass_label=d["pass_label"],
            baseline_run=d.get("baseline_run"), summary=d.get("summary"), model_identity=d.get("model_identity", {}),
            dump_format_version=d.get("dump_format_version", 1), dump_created_at=d.get("dump_created_at"),
            promoted=d.get("promoted"), calibration=d.get("calibration"),
        )

    def verdict(self) -> str:
        """A short verdict for listings: ``PASS``, ``FAIL at layer L, token T``, ``UNUSABLE ...`` or ``-``."""
        s = self.summary
        if not s:
            return "-"
        if s.get("error"):
            return f"{UNUSABLE}: {s['error']}"
        if s.get("passed"):
            return f"{PASS} ({s.get('matched')} tensors)"
        fd = s.get("first_divergent")
        if isinstance(fd, dict):
            tok = "" if fd.get("token") is None else f", token {fd['token']}"
            return f"{FAIL} at layer {fd.get('layer')}{tok}"
        return status(False, "logprobs" if s.get("logprobs_passed") is False else None)


def _show(v: Any) -> str:
    try:
        text = json.dumps(v, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    return printable(text if len(text) <= 60 else text[:57] + "...")


def _bad(field: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"field {field!r}: expected {expected}, got {_show(got)}")


def _check_tree(d: dict[str, Any]) -> None:
    """Bounded nesting, finite numbers and encodable text anywhere: a record must print and re-serialize."""
    stack: list[tuple[str, Any, int]] = [(k, v, 1) for k, v in d.items()]
    while stack:
        path, v, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise ValueError(f"field {path.split('.')[0]!r}: nested more than {_MAX_DEPTH} deep")
        if isinstance(v, float) and not math.isfinite(v):
            raise _bad(path, "a finite number", v)
        for text in (path, v) if isinstance(v, str) else (path,):
            if not is_text(text):
                raise ValueError(f"field {printable(path)!r}: holds a lone surrogate (\\u escape of no character)")
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}", x, depth + 1) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x, depth + 1) for i, x in enumerate(v))


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_num(v: Any) -> bool:
    return type(v) in (int, float)


def _check(d: dict[str, Any], field: str, ok: Any, expected: str, *, prefix: str = "") -> None:
    if field in d and not ok(d[field]):
        raise _bad(prefix + field, expected, d[field])


def _check_fields(d: dict[str, Any]) -> None:
    """Type checks of every key of a run record (presence of the required ones is checked before)."""
    _check(d, "run_id", is_run_id, "a run id like 20261130T094716.302031123Z-a1b2c3")
    _check(d, "created_at", lambda v: isinstance(v, str), "a string (ISO time)")
    _check(d, "model", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    _check(d, "pass_label", lambda v: v in LABELS and isinstance(v, str), f"one of {', '.join(LABELS)}")
    _check(d, "baseline_run", lambda v: v is None or is_run_id(v), "a run id or null")
    for key in ("capture_signature", "model_identity"):
        _check(d, key, lambda v: isinstance(v, dict), "an object")
    _check(d, "environment", lambda v: isinstance(v, dict), "an object")
    for k, v in d["environment"].items():
        if not isinstance(v, _SCALAR):
            raise _bad(f"environment.{k}", "a string, number, boolean or null", v)
    _check(d, "dump_format_version", lambda v: _is_int(v) and v >= 0, "a non-negative integer")
    _check(d, "dump_created_at", lambda v: v is None or isinstance(v, str), "a string or null")
    _check(d, "promoted", lambda v: v is None or isinstance(v, dict), "an object or null")
    if isinstance(d.get("promoted"), dict):
        p = d["promoted"]
        if set(p) != {"at", "from"}:
            raise _bad("promoted", 'an object with exactly the keys "at" and "from"', p)
        _check(p, "at", lambda v: isinstance(v, str), "a string (ISO time)", prefix="promoted.")
        _check(p, "from", lambda v: v in LABELS and isinstance(v, str), f"one of {', '.join(LABELS)}",
               prefix="promoted.")
    _check(d, "summary", lambda v: v is None or isinstance(v, dict), "an object or null")
    if isinstance(d.get("summary"), dict):
        _check_summary(d["summary"])
    _check(d, "calibration", lambda v: v is None or isinstance(v, dict), "an object or null")
    if isinstance(d.get("calibration"), dict):
        _check_calibration(d["calibration"])


def _check_calibration(c: dict[str, Any]) -> None:
    """``calibration``: exactly :data:`CALIBRATION_KEYS`, of the types :meth:`RunStore.put` writes."""
    if set(c) != set(CALIBRATION_KEYS):
        raise _bad("calibration", f"an object with exactly the keys {', '.join(CALIBRATION_KEYS)}", c)
    _check(c, "variants", lambda v: _is_int(v) and v >= 1, "a positive integer", prefix="calibration.")
    _check(c, "created_at", lambda v: isinstance(v, str), "a string (ISO time)", prefix="calibration.")
    _check(c, "sha256", lambda v: isinstance(v, str) and _SHA256.fullmatch(v) is not None,
           "64 lowercase hex digits", prefix="calibration.")
    _check(c, "measured_on", is_run_id, "a run id", prefix="calibration.")


def _check_summary(s: dict[str, Any]) -> None:
    """The verdict summary: the keys :func:`summarize_report` (or regress, for an unusable run) writes.

    Keys this version does not know are kept: the summary is descriptive, and newer writers may add to it.
    """
    for key in ("passed", "matched"):
        if key not in s:
            raise ValueError(f"field 'summary': missing key {key!r}")
    _check(s, "passed", lambda v: type(v) is bool, "true or false", prefix="summary.")
    _check(s, "matched", lambda v: _is_int(v) and v >= 0, "a non-negative integer", prefix="summary.")
    _check(s, "logprobs_passed", lambda v: v is None or type(v) is bool, "true, false or null", prefix="summary.")
    for key in ("threshold", "token_threshold"):
        _check(s, key, lambda v: v is None or _is_num(v), "a number or null", prefix="summary.")
    _check(s, "error", lambda v: v is None or isinstance(v, str), "a string or null", prefix="summary.")
    _check(s, "first_divergent", lambda v: v is None or isinstance(v, dict), "an object or null", prefix="summary.")
    fd = s.get("first_divergent")
    if isinstance(fd, dict):
        for key in ("layer", "token"):
            _check(fd, key, lambda v: v is None or _is_int(v), "an integer or null", prefix="summary.first_divergent.")


def noise_bytes(noise: NoiseModel) -> bytes:
    """``noise`` as ``noise.json`` bytes: exactly what ``python -m comparator calibrate --out`` writes."""
    return json.dumps(noise.to_json(), indent=1, allow_nan=False).encode()


@dataclass(frozen=True)
class StoredNoise:
    """A run's noise: ``noise.json``'s bytes, parsed, and the ``calibration`` of ``run.json`` vouching for them."""

    noise: NoiseModel
    data: bytes
    calibration: dict[str, Any]

    @classmethod
    def measured(cls, noise: NoiseModel, measured_on: str) -> StoredNoise:
        """Fresh noise of the run ``measured_on``: bytes and ``calibration`` (created now) to store."""
        data = noise_bytes(noise)
        return cls(noise, data, {"variants": len(noise.variants), "created_at": datetime.now(timezone.utc).isoformat(),
                                 "sha256": hashlib.sha256(data).hexdigest(), "measured_on": measured_on})

    @classmethod
    def parse(cls, raw: bytes | None, calibration: Mapping[str, Any], where: str) -> StoredNoise:
        """Validate stored ``noise.json`` bytes (``None``: missing) against their record; one-line :class:`StoreError`.

        The bytes must hash to ``calibration["sha256"]``: a ``noise.json`` replaced by an interrupted
        recalibration, or edited by hand, is refused instead of judging a run by thresholds nobody measured.
        They are then read as ``--noise`` reads a file (:meth:`NoiseModel.from_json`), whatever they hold.
        """
        if raw is None:
            raise StoreError(f"{where}: missing, but its run.json records a calibration")
        if hashlib.sha256(raw).hexdigest() != calibration["sha256"]:
            raise StoreError(f"{where}: does not match the calibration its run.json records (sha256 differs: "
                             "changed since, or a recalibration was interrupted)")
        try:
            noise = NoiseModel.from_json(parse_json(raw, where, "noise file"), where)
        except DriftscopeError as e:
            raise StoreError(str(e)) from None
        if len(noise.variants) != calibration["variants"]:
            raise StoreError(f"{where}: holds {len(noise.variants)} variants, but its run.json records "
                             f"{calibration['variants']}")
        return cls(noise, raw, dict(calibration))


@dataclass(frozen=True)
class RunEntry:
    """One folder under ``runs/``: a complete run, or something that must never be selected.

    ``status`` is ``complete`` (``record`` is set), ``incomplete`` (no ``COMPLETE`` marker: an
    upload that did not finish or is still running), ``corrupt`` (unreadable or inconsistent
    ``run.json``, or not a run folder at all) or ``staging`` (a local writer's temporary folder,
    in progress or abandoned). ``problem`` says what is wrong, naming the folder.
    """

    name: str
    status: str
    record: RunRecord | None = None
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def started(self) -> float | None:
        """Creation time from the run id in the folder name (staging folders embed it too)."""
        name = self.name
        for prefix in (".tmp-", ".trash-"):
            if name.startswith(prefix):
                name = name[len(prefix):].rsplit("-", 1)[0]
        return run_id_time(name)
