"""The run record (``run.json``), a run's stored noise, and one listed entry of a store.

:class:`RunRecord` holds the typed parts of :mod:`comparator.store.types` (:class:`Label`,
:class:`RunSummary`, :class:`Calibration`, :class:`Promotion`); run ids are
:mod:`comparator.store.runid`'s. On disk the label is ``pass_label`` (``RunRecord.label`` in Python,
as ``RegressResult.label``); the key was never renamed, so every store ever written reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from comparator.judging.noise import NoiseModel
from comparator.judging.row_noise import RowsRef, rows_from_bytes, rows_to_bytes
from comparator.store.errors import StoreError
from comparator.store.fields import bad, check, is_int, show
from comparator.store.labels import LABELS, Label, is_label
from comparator.store.runid import is_run_id, run_id_time
from comparator.store.types import Calibration, Promotion, RunSummary, check_tree
from dumper.errors import DriftscopeError
from dumper.format.files import parse_json, printable

__all__ = [
    "RUN_FORMAT_VERSION",
    "StoredNoise",
    "noise_bytes",
    "RunRecord",
    "RunEntry",
    "RunStatus",
    "signature_key",
]

RUN_FORMAT_VERSION = 1
_KEYS = (
    "format_version",
    "run_id",
    "created_at",
    "model",
    "pass_label",
    "baseline_run",
    "summary",
    "capture_signature",
    "environment",
    "model_identity",
    "dump_format_version",
    "dump_created_at",
    "promoted",
    "calibration",
    "build",
)
_REQUIRED = ("run_id", "created_at", "model", "pass_label", "capture_signature", "environment")
_SCALAR = (str, int, float, bool, type(None))


def signature_key(signature: Mapping[str, Any]) -> str:
    """Canonical JSON of a capture signature: equal keys mean exactly equal signatures."""
    return json.dumps(signature, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class RunRecord:
    """What ``runs/<run_id>/run.json`` holds about one stored run.

    ``label`` (JSON ``pass_label``) is :attr:`Label.BASELINE` (bootstrapped or promoted),
    :attr:`Label.PASSED` or :attr:`Label.FAILED` (the verdict against ``baseline_run``), or
    :attr:`Label.BISECT` (a build a bisection tested: ``build``);
    ``summary`` is ``None`` for a bootstrapped run; ``promoted`` is set once a human promoted the
    run; ``calibration`` vouches for the run's ``noise.json`` (``None``: uncalibrated).
    """

    run_id: str
    created_at: str
    model: str
    capture_signature: dict[str, Any]
    environment: dict[str, Any]
    label: Label
    baseline_run: str | None = None
    summary: RunSummary | None = None
    model_identity: dict[str, Any] = field(default_factory=dict)
    dump_format_version: int = 1
    dump_created_at: str | None = None
    promoted: Promotion | None = None
    calibration: Calibration | None = None
    build: str | None = None
    """The build a bisection tested (its line of ``--builds``), for ``bisect`` runs; None otherwise."""
    format_version: int = RUN_FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "run_id": self.run_id,
            "created_at": self.created_at,
            "model": self.model,
            "pass_label": Label(self.label).value,
            "baseline_run": self.baseline_run,
            "summary": self.summary.to_json() if self.summary is not None else None,
            "capture_signature": self.capture_signature,
            "environment": self.environment,
            "model_identity": self.model_identity,
            "dump_format_version": self.dump_format_version,
            "dump_created_at": self.dump_created_at,
            "promoted": self.promoted.to_json() if self.promoted is not None else None,
            # only when set: an uncalibrated record stays readable by versions that predate calibration
            **({"calibration": self.calibration.to_json()} if self.calibration is not None else {}),
            **({"build": self.build} if self.build is not None else {}),
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any, *, folder: str | None = None) -> RunRecord:
        """Parse and validate a decoded ``run.json``; ``folder`` is the run folder's name, if known.

        Strict: no unknown keys, exact types (``true`` is not an integer, ``"3"`` not a number),
        a known ``pass_label``, run ids where run ids belong, a ``summary``, ``calibration`` and
        ``promoted`` their types read (:mod:`comparator.store.types`), finite numbers only, bounded
        nesting, and a ``run_id`` equal to ``folder``. Raises ``ValueError`` naming the field and
        what is wrong with it.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {show(d)}")
        if type(d.get("format_version")) is not int or d["format_version"] != RUN_FORMAT_VERSION:
            raise ValueError(
                f"run format version {show(d.get('format_version'))} is not supported (expected {RUN_FORMAT_VERSION})"
            )
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ValueError(f"unexpected keys {', '.join(show(k) for k in unknown[:5])}{more}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"missing key {missing[0]!r}")
        check_tree(d)
        _check_fields(d)
        promoted, summary, calibration = (
            _optional(kind, d.get(key))
            for kind, key in ((Promotion, "promoted"), (RunSummary, "summary"), (Calibration, "calibration"))
        )
        if folder is not None and d["run_id"] != folder:
            raise ValueError(f"field 'run_id': says run id {d['run_id']!r}, but the folder is {printable(folder)!r}")
        return cls(
            run_id=d["run_id"],
            created_at=d["created_at"],
            model=d["model"],
            capture_signature=d["capture_signature"],
            environment=d["environment"],
            label=Label(d["pass_label"]),
            baseline_run=d.get("baseline_run"),
            summary=summary,
            model_identity=d.get("model_identity", {}),
            dump_format_version=d.get("dump_format_version", 1),
            dump_created_at=d.get("dump_created_at"),
            promoted=promoted,
            calibration=calibration,
            build=d.get("build"),
        )

    def verdict(self) -> str:
        """A short verdict for listings (:meth:`RunSummary.verdict`), ``-`` for a run that was not compared."""
        return "-" if self.summary is None else self.summary.verdict()


def _optional(kind: Any, v: Any) -> Any:
    return None if v is None else kind.from_json(v)


def _check_fields(d: dict[str, Any]) -> None:
    """Type checks of every top-level key (presence of the required ones is checked before)."""
    check(d, "run_id", is_run_id, "a run id like 20261130T094716.302031123Z-a1b2c3")
    check(d, "created_at", lambda v: isinstance(v, str), "a string (ISO time)")
    check(d, "model", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    check(d, "pass_label", is_label, f"one of {', '.join(LABELS)}")
    check(d, "baseline_run", lambda v: v is None or is_run_id(v), "a run id or null")
    for key in ("capture_signature", "model_identity"):
        check(d, key, lambda v: isinstance(v, dict), "an object")
    check(d, "environment", lambda v: isinstance(v, dict), "an object")
    for k, v in d["environment"].items():
        if not isinstance(v, _SCALAR):
            raise bad(f"environment.{k}", "a string, number, boolean or null", v)
    check(d, "dump_format_version", lambda v: is_int(v) and v >= 0, "a non-negative integer")
    check(d, "dump_created_at", lambda v: v is None or isinstance(v, str), "a string or null")
    check(d, "build", lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 4096), "a string or null")
    for key in ("promoted", "summary", "calibration"):  # their fields: their from_json, when the record is built
        check(d, key, lambda v: v is None or isinstance(v, dict), "an object or null")


ROWS_NAME = "noise.rows.safetensors"
"""The run's row noise (:mod:`comparator.judging.row_noise`), beside its ``noise.json``, which names it."""


def noise_bytes(noise: NoiseModel) -> bytes:
    """``noise`` as ``noise.json`` bytes: what ``python -m comparator calibrate --out`` writes (its side file
    named :data:`ROWS_NAME`)."""
    return json.dumps(noise.to_json(), indent=1, allow_nan=False).encode()


@dataclass(frozen=True)
class StoredNoise:
    """A run's noise: ``noise.json``'s bytes, parsed, the ``calibration`` of ``run.json`` vouching for them, and
    the row-noise side file's bytes (None: pooled noise only; ``noise.json`` holds their SHA-256)."""

    noise: NoiseModel
    data: bytes
    calibration: Calibration
    rows_data: bytes | None = None

    @classmethod
    def measured(cls, noise: NoiseModel, measured_on: str) -> StoredNoise:
        """Fresh noise of the run ``measured_on``: bytes and ``calibration`` (created now) to store."""
        rows = rows_to_bytes(noise.rows) if noise.rows is not None else None
        if rows is not None:
            noise = replace(
                noise,
                rows_ref=RowsRef(
                    ROWS_NAME,
                    hashlib.sha256(rows).hexdigest(),  # type: ignore[union-attr]
                    dict(noise.rows.tables),
                    noise.rows.holdout,
                ),
            )  # type: ignore[union-attr]
        else:
            noise = replace(noise, rows_ref=None)
        data = noise_bytes(noise)
        return cls(noise, data, Calibration.of(data, variants=len(noise.variants), measured_on=measured_on), rows)

    def write(self, backend: Any, folder: str) -> None:
        """Write the side file (if any), then the ``noise.json`` that names it, into ``folder`` of ``backend``."""
        if self.rows_data is not None:
            backend.write_bytes(f"{folder}/{ROWS_NAME}", self.rows_data)
        backend.write_bytes(f"{folder}/noise.json", self.data)

    @classmethod
    def read(cls, backend: Any, folder: str, calibration: Calibration, where: Callable[[str], str]) -> StoredNoise:
        """The noise stored in ``folder`` of ``backend`` (``where(name)``: a file's place, for messages), as
        :meth:`parse` checks it."""
        from comparator.noise.file import MAX_NOISE_BYTES, MAX_ROWS_BYTES

        raw = backend.read_bytes(f"{folder}/noise.json", max_bytes=MAX_NOISE_BYTES)
        return cls.parse(
            raw,
            calibration,
            where("noise.json"),
            lambda name: (backend.read_bytes(f"{folder}/{name}", max_bytes=MAX_ROWS_BYTES), where(name)),
        )

    @classmethod
    def parse(
        cls,
        raw: bytes | None,
        calibration: Calibration,
        where: str,
        read_rows: Callable[[str], tuple[bytes | None, str]] | None = None,
    ) -> StoredNoise:
        """Validate stored ``noise.json`` bytes (``None``: missing) against their record; one-line :class:`StoreError`.

        The bytes must hash to ``calibration.sha256``: a ``noise.json`` replaced by an interrupted
        recalibration, or edited by hand, is refused instead of judging a run by thresholds nobody measured.
        They are then read as ``--noise`` reads a file (:meth:`NoiseModel.from_json`), whatever they hold;
        the side file they name is read by ``read_rows(name)`` (its bytes, None when missing, and where it
        is) and checked against their hash (without ``read_rows``: pooled noise only).
        """
        if raw is None:
            raise StoreError(f"{where}: missing, but its run.json records a calibration")
        if hashlib.sha256(raw).hexdigest() != calibration.sha256:
            raise StoreError(
                f"{where}: does not match the calibration its run.json records (sha256 differs: "
                "changed since, or a recalibration was interrupted)"
            )
        rows = None
        try:
            noise = NoiseModel.from_json(parse_json(raw, where, "noise file"), where)
            if noise.rows_ref is not None and read_rows is not None:
                rows, at = read_rows(noise.rows_ref.file)
                if rows is None:
                    raise StoreError(f"{at}: missing, but {where} names it")
                noise = replace(noise, rows=rows_from_bytes(rows, noise.rows_ref, at))
        except DriftscopeError as e:
            raise StoreError(str(e)) from None
        if len(noise.variants) != calibration.variants:
            raise StoreError(
                f"{where}: holds {len(noise.variants)} variants, but its run.json records {calibration.variants}"
            )
        return cls(noise, raw, calibration, rows)


class RunStatus(str, Enum):
    """What one folder under ``runs/`` is, found when the store is listed (:attr:`RunEntry.status`); never stored.

    A ``str``: ``RunStatus.CORRUPT == "corrupt"``, and it prints as its value (``store ls`` shows it upper-cased).
    """

    COMPLETE = "complete"
    """A whole run: its ``COMPLETE`` marker and a valid ``run.json`` (the entry's ``record``)."""
    INCOMPLETE = "incomplete"
    """No ``COMPLETE`` marker: an upload that did not finish, or is still running."""
    CORRUPT = "corrupt"
    """An unusable marker, an unreadable or inconsistent ``run.json``, or not a run folder at all: never selected,
    never pruned (a human should look)."""
    STAGING = "staging"
    """A local writer's temporary folder (``.tmp-`` or ``.trash-``), in progress or abandoned."""

    def __str__(self) -> str:
        return self.value

    @property
    def unfinished(self) -> bool:
        """An upload or deletion that did not finish (or is running): pruned once older than the grace period."""
        return self in (RunStatus.INCOMPLETE, RunStatus.STAGING)

    @property
    def warned(self) -> bool:
        """Whether ``store ls`` and ``regress`` warn about such an entry: incomplete and corrupt runs (a staging
        folder is a writer's own business)."""
        return self in (RunStatus.INCOMPLETE, RunStatus.CORRUPT)


@dataclass(frozen=True)
class RunEntry:
    """One folder under ``runs/``: a complete run, or something that must never be selected.

    ``status`` (:class:`RunStatus`) is complete (``record`` is set), incomplete, corrupt or staging;
    ``problem`` says what is wrong, naming the folder.
    """

    name: str
    status: RunStatus
    record: RunRecord | None = None
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == RunStatus.COMPLETE

    @property
    def started(self) -> float | None:
        """Creation time from the run id in the folder name (staging folders embed it too)."""
        name = self.name
        for prefix in (".tmp-", ".trash-"):
            if name.startswith(prefix):
                name = name[len(prefix) :].rsplit("-", 1)[0]
        return run_id_time(name)
