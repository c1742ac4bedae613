"""The run record (``run.json``), run ids, and one listed entry of a store.

A run id is ``<UTC time to the nanosecond>Z-<6 random hex digits>``, e.g.
``20261130T094716.302031123Z-a1b2c3``: fixed width, so ids sort by creation time, and two
writers starting in the same nanosecond still get different ids.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "RUN_FORMAT_VERSION",
    "LABELS",
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

_RUN_ID = re.compile(r"^(\d{8}T\d{6})\.(\d{9})Z-[0-9a-f]{6}$")


def new_run_id(now_ns: int | None = None) -> tuple[str, str]:
    """A fresh run id and its creation time as a UTC ISO string."""
    ns = time.time_ns() if now_ns is None else now_ns
    t = datetime.fromtimestamp(ns // 1_000_000_000, tz=timezone.utc)
    run_id = f"{t:%Y%m%dT%H%M%S}.{ns % 1_000_000_000:09d}Z-{secrets.token_hex(3)}"
    created = t.replace(microsecond=(ns % 1_000_000_000) // 1000).isoformat()
    return run_id, created


def is_run_id(name: str) -> bool:
    return _RUN_ID.match(name) is not None


def run_id_time(run_id: str) -> float | None:
    """Creation time (epoch seconds) encoded in a run id, or ``None`` for something else."""
    m = _RUN_ID.match(run_id)
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
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any) -> RunRecord:
        """Parse and validate; raises ``ValueError`` naming the problem."""
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        if d.get("format_version") != RUN_FORMAT_VERSION:
            raise ValueError(f"run format version {d.get('format_version')!r} is not supported "
                             f"(expected {RUN_FORMAT_VERSION})")
        try:
            rec = cls(
                run_id=str(d["run_id"]), created_at=str(d["created_at"]), model=str(d["model"]),
                capture_signature=dict(d["capture_signature"]), environment=dict(d["environment"]),
                pass_label=str(d["pass_label"]), baseline_run=d.get("baseline_run"), summary=d.get("summary"),
                model_identity=dict(d.get("model_identity") or {}),
                dump_format_version=int(d.get("dump_format_version", 1)),
                dump_created_at=d.get("dump_created_at"), promoted=d.get("promoted"),
            )
        except KeyError as e:
            raise ValueError(f"missing key {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed ({e})") from None
        if rec.pass_label not in LABELS:
            raise ValueError(f"pass_label {rec.pass_label!r} is not one of {', '.join(LABELS)}")
        if rec.summary is not None and not isinstance(rec.summary, dict):
            raise ValueError("summary is not an object")
        return rec

    def verdict(self) -> str:
        """A short verdict for listings: ``PASS``, ``FAIL at layer L, token T``, ``UNUSABLE ...`` or ``-``."""
        s = self.summary
        if not s:
            return "-"
        if s.get("error"):
            return f"UNUSABLE: {s['error']}"
        if s.get("passed"):
            return f"PASS ({s.get('matched')} tensors)"
        fd = s.get("first_divergent")
        if isinstance(fd, dict):
            tok = "" if fd.get("token") is None else f", token {fd['token']}"
            return f"FAIL at layer {fd.get('layer')}{tok}"
        return "FAIL (logprobs)" if s.get("logprobs_passed") is False else "FAIL"


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
