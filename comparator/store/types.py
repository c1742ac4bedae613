"""The typed parts of a run record (``run.json``): its verdict summary, calibration and promotion.

The label is :mod:`comparator.store.labels`. Each part is a frozen dataclass with ``to_json`` / ``from_json``;
``from_json`` reads untrusted JSON with exact types, as :meth:`RunRecord.from_json
<comparator.store.record.RunRecord.from_json>` does, and raises a one-line ``ValueError`` naming
the field (and the file, when given ``where``). Example::

    summary = RunSummary.of_report(report)          # a compared run
    summary = RunSummary.unusable("no common tensors")  # dumps that could not be compared
    assert RunSummary.from_json(summary.to_json()) == summary
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from comparator.outcome import FAIL, PASS, UNUSABLE, status
from comparator.store.fields import bad, check, is_int, is_num, is_str, where_prefixed
from comparator.store.labels import LABELS, Label, is_label
from comparator.store.runid import is_run_id
from dumper.format.files import is_text, printable

if TYPE_CHECKING:
    from comparator.hidden.types import Report

__all__ = ["RunSummary", "SUMMARY_KEYS", "Calibration", "CALIBRATION_KEYS", "Promotion", "check_tree"]

MAX_DEPTH = 64
"""Deepest JSON nesting a run record may hold (a sound one nests 3 deep)."""


def check_tree(d: Mapping[str, Any], *, prefix: str = "", depth: int = 1) -> None:
    """Bounded nesting, finite numbers and encodable text anywhere: a record must print and re-serialize.

    ``prefix`` and ``depth``: where ``d`` sits in its record (``"summary."``, 2), so that a part read
    alone is refused exactly as it would be inside a record.
    """
    stack: list[tuple[str, Any, int]] = [(prefix + k, v, depth) for k, v in d.items()]
    while stack:
        path, v, level = stack.pop()
        if level > MAX_DEPTH:
            raise ValueError(f"field {path.split('.')[0]!r}: nested more than {MAX_DEPTH} deep")
        if isinstance(v, float) and not math.isfinite(v):
            raise bad(path, "a finite number", v)
        for text in (path, v) if isinstance(v, str) else (path,):
            if not is_text(text):
                raise ValueError(f"field {printable(path)!r}: holds a lone surrogate (\\u escape of no character)")
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}", x, level + 1) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x, level + 1) for i, x in enumerate(v))


def _object(d: Any, name: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise bad(name, "an object", d)
    check_tree(d, prefix=f"{name}.", depth=2)
    return d


SUMMARY_KEYS = ("passed", "matched", "first_divergent", "logprobs_passed", "threshold", "token_threshold", "error")
"""Keys of ``run.json``'s ``summary``, every one written for every run (``null`` where it does not apply)."""


@dataclass(frozen=True)
class RunSummary:
    """The verdict a stored run's record keeps (``run.json``'s ``summary``); ``None`` for a bootstrapped run.

    One type for both kinds of judged run, built by :meth:`of_report` (the dumps were compared) or
    :meth:`unusable` (they could not be: ``error`` says why, nothing matched). ``first_divergent``
    is the report's :class:`~comparator.hidden.types.FirstDivergence` as JSON (only its ``layer``
    and ``token`` are read back); ``threshold`` / ``token_threshold`` the fixed or noise-derived
    thresholds the run was judged by. ``extra``: keys this version does not know, kept as read
    (the summary is descriptive, and a newer writer may add to it).

    Older stores wrote the same keys, a compared run's without ``error`` and an unusable run's
    without the thresholds; both read as ``None``. No key was ever spelled two ways.
    """

    passed: bool
    matched: int
    first_divergent: dict[str, Any] | None = None
    logprobs_passed: bool | None = None
    threshold: float | None = None
    token_threshold: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_report(cls, report: Report) -> RunSummary:
        """The summary of a comparison report."""
        fd = report.first_divergent
        return cls(
            passed=report.passed,
            matched=report.matched,
            first_divergent=None if fd is None else fd.to_json(),
            logprobs_passed=None if report.logprobs is None else report.logprobs.passed,
            threshold=report.threshold,
            token_threshold=report.token_threshold,
        )

    @classmethod
    def unusable(cls, error: str) -> RunSummary:
        """The summary of a run whose dumps could not be compared: failed, nothing matched, ``error`` why."""
        return cls(passed=False, matched=0, error=error)

    def verdict(self) -> str:
        """A short verdict for listings: ``PASS (N tensors)``, ``FAIL at layer L, token T``, ``UNUSABLE: ...``."""
        if self.error:
            return f"{UNUSABLE}: {self.error}"
        if self.passed:
            return f"{PASS} ({self.matched} tensors)"
        fd = self.first_divergent
        if fd is not None:
            tok = "" if fd.get("token") is None else f", token {fd['token']}"
            return f"{FAIL} at layer {fd.get('layer')}{tok}"
        return status(False, "logprobs" if self.logprobs_passed is False else None)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "matched": self.matched,
            "first_divergent": self.first_divergent,
            "logprobs_passed": self.logprobs_passed,
            "threshold": self.threshold,
            "token_threshold": self.token_threshold,
            "error": self.error,
            **self.extra,
        }

    @classmethod
    def from_json(cls, d: Any, where: str | None = None) -> RunSummary:
        """Read a ``summary`` object; ``ValueError`` naming the field (``where``: the file, in front) if malformed."""
        try:
            s = _object(d, "summary")
            _check_summary(s)
        except ValueError as e:
            raise where_prefixed(e, where) from None
        return cls(
            passed=s["passed"],
            matched=s["matched"],
            first_divergent=s.get("first_divergent"),
            logprobs_passed=s.get("logprobs_passed"),
            threshold=s.get("threshold"),
            token_threshold=s.get("token_threshold"),
            error=s.get("error"),
            extra={k: v for k, v in s.items() if k not in SUMMARY_KEYS},
        )


def _check_summary(s: dict[str, Any]) -> None:
    """Exact types of the :data:`SUMMARY_KEYS` (``passed`` and ``matched`` required); other keys are kept."""
    for key in ("passed", "matched"):
        if key not in s:
            raise ValueError(f"field 'summary': missing key {key!r}")
    p = "summary."
    check(s, "passed", lambda v: type(v) is bool, "true or false", prefix=p)
    check(s, "matched", lambda v: is_int(v) and v >= 0, "a non-negative integer", prefix=p)
    check(s, "logprobs_passed", lambda v: v is None or type(v) is bool, "true, false or null", prefix=p)
    for key in ("threshold", "token_threshold"):
        check(s, key, lambda v: v is None or is_num(v), "a number or null", prefix=p)
    check(s, "error", lambda v: v is None or is_str(v), "a string or null", prefix=p)
    check(s, "first_divergent", lambda v: v is None or isinstance(v, dict), "an object or null", prefix=p)
    fd = s.get("first_divergent")
    if isinstance(fd, dict):
        for key in ("layer", "token"):
            check(fd, key, lambda v: v is None or is_int(v), "an integer or null", prefix=p + "first_divergent.")


_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
CALIBRATION_KEYS = ("variants", "created_at", "sha256", "measured_on")
"""Keys of ``run.json``'s ``calibration``, all required."""


@dataclass(frozen=True)
class Calibration:
    """What ``run.json`` records about the run's ``noise.json``: it vouches for those bytes.

    ``variants``: how many benign variants the noise was measured from; ``created_at``: when (ISO
    time); ``sha256``: of the stored ``noise.json`` (the pair must agree, so a half-finished
    recalibration is detected); ``measured_on``: the run whose dump the variants were compared
    with (the run itself, or the calibrated baseline a passed run inherited its noise from).
    """

    variants: int
    created_at: str
    sha256: str
    measured_on: str

    @classmethod
    def of(cls, data: bytes, *, variants: int, measured_on: str) -> Calibration:
        """The calibration vouching for the ``noise.json`` bytes ``data``, created now."""
        return cls(
            variants=variants,
            created_at=datetime.now(timezone.utc).isoformat(),
            sha256=hashlib.sha256(data).hexdigest(),
            measured_on=measured_on,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "variants": self.variants,
            "created_at": self.created_at,
            "sha256": self.sha256,
            "measured_on": self.measured_on,
        }

    @classmethod
    def from_json(cls, d: Any, where: str | None = None) -> Calibration:
        """Read a ``calibration`` object: exactly :data:`CALIBRATION_KEYS`, of the types :meth:`of` writes."""
        try:
            c = _object(d, "calibration")
            if set(c) != set(CALIBRATION_KEYS):
                raise bad("calibration", f"an object with exactly the keys {', '.join(CALIBRATION_KEYS)}", c)
            p = "calibration."
            check(c, "variants", lambda v: is_int(v) and v >= 1, "a positive integer", prefix=p)
            check(c, "created_at", is_str, "a string (ISO time)", prefix=p)
            check(
                c,
                "sha256",
                lambda v: is_str(v) and _SHA256.fullmatch(v) is not None,
                "64 lowercase hex digits",
                prefix=p,
            )
            check(c, "measured_on", is_run_id, "a run id", prefix=p)
        except ValueError as e:
            raise where_prefixed(e, where) from None
        return cls(variants=c["variants"], created_at=c["created_at"], sha256=c["sha256"], measured_on=c["measured_on"])


@dataclass(frozen=True)
class Promotion:
    """A human's blessing of a run as a baseline: when (ISO time), and the label it had before (JSON ``from``)."""

    at: str
    previous: Label

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "from": Label(self.previous).value}

    @classmethod
    def from_json(cls, d: Any, where: str | None = None) -> Promotion:
        """Read a ``promoted`` object: exactly ``at`` (a string) and ``from`` (a label)."""
        try:
            p = _object(d, "promoted")
            if set(p) != {"at", "from"}:
                raise bad("promoted", 'an object with exactly the keys "at" and "from"', p)
            check(p, "at", is_str, "a string (ISO time)", prefix="promoted.")
            check(p, "from", is_label, f"one of {', '.join(LABELS)}", prefix="promoted.")
        except ValueError as e:
            raise where_prefixed(e, where) from None
        return cls(at=p["at"], previous=Label(p["from"]))
