"""A store of runs: one folder per run holding its whole dump and its ``run.json`` record.

Layout (no shared index file that concurrent writers could corrupt: the listing is the index)::

    <store>/runs/<run_id>/dump/...        the run's dump, manifest.json last
    <store>/runs/<run_id>/report.json     the full comparison report (compared runs only)
    <store>/runs/<run_id>/noise.json      the run's measured noise (calibrated runs only)
    <store>/runs/<run_id>/run.json        the run record
    <store>/runs/<run_id>/COMPLETE        written last: the run is whole

See :mod:`.backend` for how a run is published atomically on each kind of filesystem. Everything read back is
untrusted: a listing entry that is not a real run folder, a marker or record that is not a regular file, a record that
does not validate, or a dump folder that leaves the store lists as ``corrupt`` (never selected, never deleted by
:meth:`RunStore.prune`); paths named by a stored manifest are single plain names that stay inside the run's dump
folder. A ``noise.json`` that its record does not vouch for is refused when the run is used (:meth:`RunStore.noise`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from comparator.judging.noise import NoiseModel
from comparator.store.backend import open_backend
from comparator.store.backend_base import Backend, EntryKind, ReadResult, plain_name
from comparator.store.errors import CorruptRunError, StoreError
from comparator.store.labels import LABELS, Label
from comparator.store.record import RunEntry, RunRecord, RunStatus, StoredNoise, signature_key
from comparator.store.runid import is_run_id, new_run_id
from comparator.store.select import current_baselines
from comparator.store.types import Promotion, RunSummary
from dumper.errors import DumpError
from dumper.format import MANIFEST_NAME, Manifest, dir_mode, load_manifest
from dumper.format.files import parse_json, printable
from dumper.format.validate import MAX_MANIFEST_BYTES

__all__ = ["RunStore", "PruneResult", "STAGING_GRACE_S"]

RUNS = "runs"
RUN_JSON = "run.json"
COMPLETE = "COMPLETE"
REPORT_JSON = "report.json"
DUMP = "dump"
NOISE_JSON = "noise.json"
STAGING_PREFIXES = (".tmp-", ".trash-")
STAGING_GRACE_S = 3600.0
"""Unfinished uploads younger than this are left alone by :meth:`RunStore.prune` (they may be running)."""
MAX_RECORD_BYTES = 1 << 20
"""Largest ``run.json`` read (a sound one is a few KiB)."""
_KIND_WORDS = {"file": "a file", "symlink": "a symlink (not followed)", "other": "a FIFO, socket or device"}


def _detail(e: Exception, where: str) -> str:
    """An error's message without the leading ``where: `` it repeats."""
    text = str(e)
    return text[len(where) + 2 :] if text.startswith(f"{where}: ") else text


def _loads(dump: Path) -> bool:
    try:
        load_manifest(dump)
    except DumpError:
        return False
    return True


@dataclass(frozen=True)
class PruneResult:
    """What :meth:`RunStore.prune` deleted (or would delete with ``dry_run``) and why it kept the rest."""

    deleted: tuple[str, ...]
    kept: tuple[str, ...]
    protected: tuple[str, ...]
    """Runs kept although older than the newest N: the current baseline of their group."""
    skipped: tuple[str, ...]
    """Entries left alone, with the reason (corrupt runs, young unfinished uploads)."""


class RunStore:
    """A run store at a local path (the default) or any fsspec URL.

    Example::

        store = RunStore("s3://bucket/driftscope")        # or "ci-store", "file:///srv/store"
        for entry in store.runs():
            print(entry.name, entry.status, entry.record and entry.record.label)
    """

    def __init__(self, url: str | os.PathLike[str]) -> None:
        self.backend: Backend = open_backend(url)
        self.url = self.backend.url

    def __repr__(self) -> str:
        return f"RunStore({self.url!r})"

    def where(self, run_id: str, *parts: str) -> str:
        """Where an entry of the store is, for messages (undecodable or control characters escaped)."""
        return "/".join((self.url.rstrip("/"), RUNS, printable(run_id), *parts))

    def exists(self) -> bool:
        return self.backend.exists(RUNS)

    def runs(self) -> list[RunEntry]:
        """Every entry under ``runs/``, sorted by name (run ids sort by creation time).

        Never raises for one bad entry: a file, FIFO or symlink where a run folder belongs, a
        marker or ``run.json`` that is a directory, a FIFO, a symlink out of the store or garbage,
        a record of the wrong types, or a dump folder outside the store lists as ``corrupt``, with
        a problem naming the entry. Nothing that is not a regular file is opened.
        """
        listed = self.backend.list_entries(RUNS)
        ids = [n for n, kind in listed if kind == "dir" and is_run_id(n)]
        blobs = self.backend.read_many(
            [f"{RUNS}/{n}/{f}" for n in ids for f in (COMPLETE, RUN_JSON)], max_bytes=MAX_RECORD_BYTES
        )
        out = []
        for name, kind in listed:
            if kind != "dir" or not (is_run_id(name) or name.startswith(STAGING_PREFIXES)):
                out.append(RunEntry(name, RunStatus.CORRUPT, problem=self._not_a_run(name, kind)))
            elif name.startswith(STAGING_PREFIXES):
                out.append(
                    RunEntry(
                        name,
                        RunStatus.STAGING,
                        problem=f"{self.where(name)}: unfinished upload or deletion (in progress, or its writer died)",
                    )
                )
            else:
                entry = self._entry(name, blobs[f"{RUNS}/{name}/{COMPLETE}"], blobs[f"{RUNS}/{name}/{RUN_JSON}"])
                out.append(self._with_dump_checked(entry))
        return out

    def _not_a_run(self, name: str, kind: EntryKind) -> str:
        if kind != "dir":
            return f"{self.where(name)}: {_KIND_WORDS[kind]} where a run folder belongs; skipped"
        return f"{self.where(name)}: not a run folder (not a run id)"

    def _entry(self, name: str, marker: ReadResult, raw: ReadResult) -> RunEntry:
        """The entry of the run folder ``name`` from the bytes of its marker and record (or why they are unreadable)."""
        if isinstance(marker, StoreError):
            return RunEntry(
                name,
                RunStatus.CORRUPT,
                problem=f"{self.where(name, COMPLETE)}: unusable marker "
                f"({_detail(marker, self.where(name, COMPLETE))})",
            )
        if marker is None:
            why = f"no {COMPLETE} marker: the upload did not finish, or is still running"
            return RunEntry(name, RunStatus.INCOMPLETE, problem=f"{self.where(name)}: incomplete run ({why})")
        where = self.where(name, RUN_JSON)
        if raw is None:
            return RunEntry(name, RunStatus.CORRUPT, problem=f"{where}: missing")
        try:
            if isinstance(raw, StoreError):
                raise raw
            rec = RunRecord.from_json(parse_json(raw, where, "JSON"), folder=name)
        except (StoreError, DumpError, ValueError) as e:
            return RunEntry(name, RunStatus.CORRUPT, problem=f"{where}: corrupt run record ({_detail(e, where)})")
        return RunEntry(name, RunStatus.COMPLETE, record=rec)

    def _with_dump_checked(self, entry: RunEntry) -> RunEntry:
        """A complete entry of a store read in place whose dump folder is missing or leaves the store is corrupt."""
        if not entry.complete:
            return entry
        try:
            local = self.backend.local_path(f"{RUNS}/{entry.name}/{DUMP}")  # refuses a dump folder leaving the store
            if local is not None and not local.is_dir():
                raise StoreError(f"{self.where(entry.name, DUMP)}: missing or not a folder")
        except StoreError as e:
            return RunEntry(entry.name, RunStatus.CORRUPT, problem=str(e))
        return entry

    def get(self, run_id: str) -> RunRecord:
        """The record of one complete run; :class:`StoreError` (:class:`CorruptRunError`) for anything else."""
        if not is_run_id(run_id):
            raise StoreError(
                f"{printable(repr(run_id))} is not a run id (like 20261130T094716.302031123Z-a1b2c3); "
                f"see python -m comparator store ls {self.url}"
            )
        kind = self.backend.entry_kind(f"{RUNS}/{run_id}")
        if kind is None:
            raise StoreError(f"{self.where(run_id)}: no such run")
        if kind != "dir":
            raise CorruptRunError(self._not_a_run(run_id, kind))
        marker_rel, record_rel = f"{RUNS}/{run_id}/{COMPLETE}", f"{RUNS}/{run_id}/{RUN_JSON}"
        blobs = self.backend.read_many([marker_rel, record_rel], max_bytes=MAX_RECORD_BYTES)
        entry = self._with_dump_checked(self._entry(run_id, blobs[marker_rel], blobs[record_rel]))
        if entry.record is None:
            error = CorruptRunError if entry.status == RunStatus.CORRUPT else StoreError
            raise error(entry.problem or f"{self.where(run_id)}: unusable run")
        return entry.record

    def put(
        self,
        dump_dir: str | os.PathLike[str],
        *,
        model: str,
        label: Label | str,
        baseline_run: str | None = None,
        summary: RunSummary | None = None,
        report: Mapping[str, Any] | None = None,
        manifest: Manifest | None = None,
        noise: NoiseModel | StoredNoise | None = None,
        build: str | None = None,
    ) -> RunRecord:
        """Store the dump at ``dump_dir`` whole, as a new run labelled ``label``; return its record.

        Data files go first, the dump's manifest after them, then ``report.json`` (if given),
        ``noise.json`` (if given), ``run.json`` and the ``COMPLETE`` marker; a local store then
        renames the staging folder into place. A writer that dies on the way leaves nothing that
        lists as complete. ``noise``: measured on this dump, or a baseline's (inherited byte for byte);
        ``build``: the build a bisection tested (label ``bisect``)."""
        if not (isinstance(label, str) and label in LABELS):
            raise StoreError(f"label {printable(repr(label))} is not one of {', '.join(LABELS)}")
        src = Path(dump_dir)
        manifest = manifest if manifest is not None else load_manifest(src)
        run_id, created = new_run_id()
        stored = StoredNoise.measured(noise, run_id) if isinstance(noise, NoiseModel) else noise
        record = RunRecord(
            run_id=run_id,
            created_at=created,
            model=model,
            capture_signature=manifest.capture_signature,
            environment=manifest.environment,
            label=Label(label),
            baseline_run=baseline_run,
            summary=summary,
            model_identity=manifest.model,
            dump_format_version=manifest.format_version,
            dump_created_at=manifest.created_at,
            calibration=stored.calibration if stored is not None else None,
            build=build,
        )
        try:  # what is written must read back: a record that would list as corrupt is never stored
            RunRecord.from_json(json.loads(record.dumps()), folder=run_id)
        except ValueError as e:
            raise StoreError(f"{src}: cannot store this run: its run record would not validate ({e})") from None
        names = [plain_name(name, f"{src}/{MANIFEST_NAME}") for name in sorted(manifest.files)]
        staging = self.backend.staging(run_id)
        try:
            for name in names:
                self.backend.upload(src / name, f"{staging}/{DUMP}/{name}")
            self.backend.upload(src / MANIFEST_NAME, f"{staging}/{DUMP}/{MANIFEST_NAME}")
            if report is not None:
                self.backend.write_bytes(
                    f"{staging}/{REPORT_JSON}", json.dumps(report, indent=1, allow_nan=False).encode()
                )
            if stored is not None:
                stored.write(self.backend, staging)
            self.backend.write_bytes(f"{staging}/{RUN_JSON}", record.dumps())
            self.backend.write_bytes(f"{staging}/{COMPLETE}", f"{run_id}\n".encode())
            self.backend.publish(staging, f"{RUNS}/{run_id}")
        except BaseException:
            with contextlib.suppress(OSError, StoreError):
                self.backend.remove_tree(staging)
            raise
        return record

    def promote(self, run_id: str, noise: NoiseModel | None = None) -> RunRecord:
        """Relabel a run ``baseline`` (a human blesses it), rewriting its ``run.json`` atomically; ``noise``
        (measured on its dump; a baseline is calibrated anew) is written first, replacing any earlier one."""
        rec = self.get(run_id)
        if rec.label == Label.BASELINE and noise is None:
            return rec
        now = datetime.now(timezone.utc).isoformat()
        new = (
            rec
            if rec.label == Label.BASELINE
            else replace(rec, label=Label.BASELINE, promoted=Promotion(at=now, previous=rec.label))
        )
        if noise is not None:
            stored = StoredNoise.measured(noise, new.run_id)
            new = replace(new, calibration=stored.calibration)
            stored.write(self.backend, f"{RUNS}/{new.run_id}")
        self.backend.write_bytes(f"{RUNS}/{new.run_id}/{RUN_JSON}", new.dumps())  # a crash before: old record holds
        return new

    def noise(self, record: RunRecord) -> StoredNoise | None:
        """A run's stored noise (``None``: not calibrated); :class:`StoreError` naming ``noise.json`` if unusable.

        Such a run still lists as complete (its dump and record are sound), but using it as a baseline
        fails (exit 2), as for a broken dump, instead of judging by thresholds nobody measured."""
        if record.calibration is None:
            return None
        try:
            return StoredNoise.read(
                self.backend,
                f"{RUNS}/{record.run_id}",
                record.calibration,
                lambda name: self.where(record.run_id, name),
            )
        except StoreError as e:
            raise StoreError(
                f"{e}; recalibrate it: python -m comparator store promote {self.url} "
                f"{record.run_id} --calibrate VARIANT [VARIANT ...]"
            ) from None

    def manifest_json(self, run_id: str) -> dict[str, Any]:
        """The stored dump's raw manifest (for summaries; not validated against the data files)."""
        return self._manifest(run_id)[1]

    def _manifest(self, run_id: str) -> tuple[bytes, dict[str, Any]]:
        """The stored manifest's bytes and JSON, its ``files`` checked: plain names, byte counts."""
        where = self.where(run_id, DUMP, MANIFEST_NAME)
        raw = self.backend.read_bytes(f"{RUNS}/{run_id}/{DUMP}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
        if raw is None:
            raise StoreError(f"{where}: missing")
        try:
            d = parse_json(raw, where, "dump manifest")
        except DumpError as e:
            raise StoreError(str(e)) from None
        if not isinstance(d, dict) or not isinstance(d.get("files"), dict):
            raise StoreError(f'{where}: not a dump manifest (no "files" object)')
        for name, size in d["files"].items():
            plain_name(name, f"{where}: files")
            if type(size) is not int or size < 0:
                raise StoreError(f"{where}: files[{printable(repr(name))}]: expected a byte count, got {size!r:.40}")
        return raw, d

    def report_json(self, run_id: str) -> dict[str, Any] | None:
        """The stored comparison report (``None`` for a run not compared), refused over the limit of any report."""
        from comparator.results import MAX_REPORT_BYTES  # here: listing a store loads no report types

        where = self.where(run_id, REPORT_JSON)
        raw = self.backend.read_bytes(f"{RUNS}/{run_id}/{REPORT_JSON}", max_bytes=MAX_REPORT_BYTES)
        if raw is None:
            return None
        try:
            d = parse_json(raw, where, "comparison report")
        except DumpError as e:
            raise StoreError(str(e)) from None
        if not isinstance(d, dict):
            raise StoreError(f"{where}: not a comparison report (not a JSON object)")
        return d

    @contextlib.contextmanager
    def local_dump(self, run_id: str, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[Path]:
        """A local directory holding the run's dump, validated.

        A local store is read in place. A remote one is downloaded file by file (streamed) into
        ``cache_dir/<run_id>`` and kept there for the next call (stored runs never change), or,
        without ``cache_dir``, into a temporary directory removed on exit.
        """
        rel = f"{RUNS}/{run_id}/{DUMP}"
        local = self.backend.local_path(rel)  # refuses a dump folder that leaves the store
        if local is not None:
            _, manifest = self._manifest(run_id)
            for name in (MANIFEST_NAME, *manifest["files"]):
                self.backend.check_in_place(f"{rel}/{name}", within=rel)
            yield self._validated(local, run_id)
            return
        if cache_dir is not None:
            target = Path(cache_dir) / run_id
            if not _loads(target):  # absent, or a cache entry damaged since: fetch it again
                shutil.rmtree(target, ignore_errors=True)
                self._download(run_id, target)
            yield self._validated(target, run_id)
            return
        with tempfile.TemporaryDirectory(prefix="driftscope-baseline-") as tmp:
            target = Path(tmp) / run_id
            self._download(run_id, target)
            yield self._validated(target, run_id)

    def _download(self, run_id: str, target: Path) -> None:
        """Download into a sibling temp folder, manifest last, then rename into place."""
        raw, manifest = self._manifest(run_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{run_id}-", dir=target.parent))
        try:
            os.chmod(tmp, dir_mode())  # mkdtemp makes it 0700: a shared cache follows the umask
            for name, size in sorted(manifest["files"].items()):  # plain names (checked by _manifest)
                self.backend.download(f"{RUNS}/{run_id}/{DUMP}/{name}", tmp / name, max_bytes=size)
            (tmp / MANIFEST_NAME).write_bytes(raw)
            if target.exists():  # another process filled the cache meanwhile
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _validated(self, path: Path, run_id: str) -> Path:
        try:
            load_manifest(path)
        except DumpError as e:
            raise StoreError(
                f"stored run {run_id} of {self.url} has a broken dump ({e}); promote another run or remove it"
            ) from None
        return path

    def prune(
        self, keep: int, *, dry_run: bool = False, grace_s: float = STAGING_GRACE_S, now: float | None = None
    ) -> PruneResult:
        """Delete all but the newest ``keep`` runs of each (model, signature).

        Never deletes the current baseline (the run :func:`select_baseline` picks) of any model,
        signature and environment, nor corrupt runs (a human should look), nor unfinished
        uploads younger than ``grace_s`` seconds (they may still be running; older ones are
        abandoned and deleted).
        """
        if keep < 0:
            raise StoreError(f"--keep must be >= 0, got {keep}")
        now = time.time() if now is None else now
        entries = self.runs()
        protected = current_baselines(entries)
        groups: dict[tuple[str, str], list[RunRecord]] = {}
        for e in entries:
            if e.record is not None:
                groups.setdefault((e.record.model, signature_key(e.record.capture_signature)), []).append(e.record)
        deleted = []
        kept = []
        saved = []
        skipped = []
        for recs in groups.values():
            for i, r in enumerate(sorted(recs, key=lambda r: r.run_id, reverse=True)):
                if i < keep:
                    kept.append(r.run_id)
                elif r.run_id in protected:
                    saved.append(r.run_id)
                else:
                    deleted.append(r.run_id)
        for e in entries:
            if e.status == RunStatus.CORRUPT:
                skipped.append(f"{printable(e.name)}: {e.problem}")
            elif e.status.unfinished:
                times = [t for t in (e.started, self.backend.newest_mtime(f"{RUNS}/{e.name}")) if t is not None]
                if not times:
                    skipped.append(f"{printable(e.name)}: unfinished upload of unknown age")
                elif now - max(times) < grace_s:
                    skipped.append(
                        f"{printable(e.name)}: unfinished upload younger than {grace_s:g} s (may be running)"
                    )
                else:
                    deleted.append(e.name)
        if not dry_run:
            for name in deleted:
                self.backend.remove_tree(f"{RUNS}/{name}")
        return PruneResult(tuple(sorted(deleted)), tuple(sorted(kept)), tuple(sorted(saved)), tuple(skipped))
