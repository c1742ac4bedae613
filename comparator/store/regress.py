"""Regress a run against its golden baseline: select it, compare, store the run labelled.

Example::

    from comparator import regress
    result = regress("dumps/nightly", "s3://bucket/driftscope")
    print(result.message)            # e.g. "PASS: stored run 2026...-a1b2c3 as passed (baseline 2026...-0f9e8d)"
    raise SystemExit(result.exit_code)

Every compared run is stored whole, failed runs included (labelled ``failed``, as diagnostic
evidence); a failed run is never selected as a baseline, so an unchanged buggy run keeps
failing against the last good one instead of passing against its own predecessor.

Calibrated baselines: a run stored with its measured noise (``calibrate_from``: benign re-runs
of its inputs, see :mod:`comparator.noise.calibrate`) judges every later run by thresholds derived
from that noise; a run that passes against it inherits it, since it becomes the next baseline.
A baseline without noise falls back to the fixed thresholds, with a warning::

    result = regress("dumps/base", "ci-store", bootstrap=True, calibrate_from=["dumps/sdpa", "dumps/chunk64"])
    result = regress("dumps/nightly", "ci-store")   # "... judged against the noise of baseline ... (2 variants)"
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from comparator.config import CompareConfig
from comparator.hidden.compare import compare_dumps
from comparator.hidden.types import Report
from comparator.judging.noise import NoiseModel
from comparator.noise.calibrate import calibrate
from comparator.outcome import BOOTSTRAP, FAIL, PASS, UNUSABLE
from comparator.store.environment import EnvDifference, describe_differences, env_differences
from comparator.store.errors import EnvMismatchError, NoBaselineError
from comparator.store.labels import Label
from comparator.store.record import RunEntry, RunRecord, StoredNoise, signature_key
from comparator.store.runstore import RunStore
from comparator.store.select import select_baseline
from comparator.store.types import Calibration, RunSummary
from dumper.errors import EXIT_DIVERGED, EXIT_OK, EXIT_UNUSABLE, NotComparableError, UsageError
from dumper.format import Manifest, load_manifest

__all__ = ["regress", "RegressResult"]


@dataclass(frozen=True)
class RegressResult:
    """What :func:`regress` did; ``bool(result)`` is "exit code 0".

    ``label`` is how the run was stored (:attr:`Label.BASELINE` when bootstrapped, else ``PASSED``
    or ``FAILED``; the field :attr:`RunRecord.label` holds); ``report`` is ``None`` when nothing was
    compared; ``exit_code`` is 0 (passed or bootstrapped), 1 (divergence) or 2 (the dumps could not
    be compared). ``noise`` is the store path of the baseline's ``noise.json`` the run was judged
    against (``None``: fixed thresholds); ``calibration`` is the stored run's own (``run.json``),
    ``None`` when it has none.
    """

    store: str
    run_id: str
    label: Label
    baseline_run: str | None
    exit_code: int
    message: str
    report: Report | None = None
    env_differences: tuple[EnvDifference, ...] = ()
    warnings: tuple[str, ...] = ()
    noise: str | None = None
    calibration: Calibration | None = None

    def __bool__(self) -> bool:
        return self.exit_code == EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "run_id": self.run_id,
            "label": Label(self.label).value,
            "baseline_run": self.baseline_run,
            "exit_code": self.exit_code,
            "message": self.message,
            "env_differences": [d.to_json() for d in self.env_differences],
            "warnings": list(self.warnings),
            "noise": self.noise,
            "calibration": self.calibration.to_json() if self.calibration is not None else None,
            "report": self.report.to_json() if self.report is not None else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RegressResult:
        """Inverse of :meth:`to_json` (the report through :meth:`Report.from_json`)."""
        report, cal = d.get("report"), d.get("calibration")
        return cls(
            store=str(d["store"]),
            run_id=str(d["run_id"]),
            label=Label(str(d["label"])),
            baseline_run=d.get("baseline_run"),
            exit_code=int(d["exit_code"]),
            message=str(d["message"]),
            report=None if report is None else Report.from_json(report),
            env_differences=tuple(EnvDifference.from_json(e) for e in d.get("env_differences") or ()),
            warnings=tuple(str(w) for w in d.get("warnings") or ()),
            noise=d.get("noise"),
            calibration=None if cal is None else Calibration.from_json(cal),
        )


def regress(
    run_dir: str | os.PathLike[str],
    store: str | os.PathLike[str] | RunStore,
    *,
    model: str | None = None,
    bootstrap: bool = False,
    allow_env_mismatch: bool = False,
    config: CompareConfig | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    require_all: bool = True,
    calibrate_from: Sequence[str | os.PathLike[str]] = (),
    build: str | None = None,
) -> RegressResult:
    """Compare the dump ``run_dir`` against its baseline in ``store`` and store it, labelled.

    Args:
        run_dir: the new run's dump directory (complete: manifest written).
        store: a :class:`~comparator.store.RunStore` or its location (local path, ``file://``,
            ``s3://``, ``gcs://``, ``hf://``, ``memory://``, ...).
        model: the model name runs are grouped by (default: the dump's ``model["name"]``).
        bootstrap: when no comparable baseline exists, store this run as the first baseline
            (exit 0) instead of raising :class:`~comparator.store.NoBaselineError`.
        allow_env_mismatch: compare against a baseline from another environment (torch,
            CUDA, GPU, ...) when none from this one exists, instead of raising
            :class:`~comparator.store.EnvMismatchError`.
        config: thresholds (default: :meth:`CompareConfig.resolve`, i.e. env vars, then defaults).
            Its ``noise_factor`` and ``noise_floor(s)`` apply to a calibrated baseline's noise;
            its ``noise`` must be ``None`` (the noise comes from the baseline in the store).
        cache_dir: where a remote baseline's dump is kept between calls (default: a temporary
            directory, removed afterwards).
        require_all: a run that lacks tensors of its baseline, or holds tensors it lacks, is
            unusable (exit 2, stored as failed evidence) rather than compared on the common ones.
            On by default: a CI gate must not pass a run that stopped capturing some layers.
        calibrate_from: dumps of benign re-runs of this run's inputs (another attention backend,
            chunk size, batch layout, thread count): the run's noise is measured from them before
            anything is stored, and stored with it (``noise.json``), so that the runs judged
            against it later are judged by that noise. Without it a passing run keeps its
            baseline's noise.
        build: the run is one build of a bisection (``regress --git-bisect``): it is judged as any run, and
            stored labelled ``bisect`` with this build label, good or bad, so that it never becomes a baseline.

    Raises :class:`~dumper.errors.DriftscopeError` subclasses (exit 2) for a broken run dump, a
    missing model name, no comparable baseline, an environment mismatch, a variant that cannot
    be compared with the run, or a baseline whose stored noise is unusable; nothing is stored then.
    """
    config = config or CompareConfig.resolve()
    if config.noise is not None:
        raise UsageError("regress judges against the noise stored with the baseline; pass a config without noise")
    manifest = load_manifest(run_dir)
    model = model or manifest.model.get("name")
    if not model:
        raise UsageError(f"{run_dir}: the dump records no model name; pass --model NAME")
    st = store if isinstance(store, RunStore) else RunStore(store)
    entries = st.runs()
    warnings = tuple(e.problem for e in entries if e.status.warned and e.problem)
    base, why, diffs = _select(entries, model, manifest, allow_env_mismatch=allow_env_mismatch, bootstrap=bootstrap)
    if base is None:
        if not bootstrap or build is not None:
            raise NoBaselineError(_no_baseline(st, entries, model, manifest))
        own = _measure(run_dir, calibrate_from, config)
        return _bootstrap(st, run_dir, manifest, model, warnings, why=why, diffs=diffs, noise=own)
    base_noise = st.noise(base)  # before calibrating: a baseline with broken noise fails fast
    own = _measure(run_dir, calibrate_from, config)
    diffs = tuple(env_differences(base.environment, manifest.environment))
    config = replace(config, require_all=require_all, noise=base_noise.noise if base_noise else None)
    if base_noise is None:
        warnings += (_uncalibrated(st, base, config),)
    return _compare_and_store(
        st,
        run_dir,
        manifest,
        model,
        base,
        config,
        cache_dir,
        warnings,
        diffs,
        base_noise=base_noise,
        own=own,
        build=build,
    )


def _select(
    entries: list[RunEntry], model: str, manifest: Manifest, *, allow_env_mismatch: bool, bootstrap: bool
) -> tuple[RunRecord | None, str, tuple[EnvDifference, ...]]:
    """The run's baseline (``None``: none), why there is none, and the environment differences that left none.

    An environment mismatch raises unless ``bootstrap``, which then stores the run as a new baseline.
    """
    try:
        base = select_baseline(
            entries, model, manifest.capture_signature, manifest.environment, allow_env_mismatch=allow_env_mismatch
        )
    except EnvMismatchError as e:
        if not bootstrap:
            raise
        return None, "no baseline from this environment: " + describe_differences(e.differences), e.differences
    return base, "no comparable baseline", ()


def _uncalibrated(st: RunStore, base: RunRecord, config: CompareConfig) -> str:
    """The notice for a baseline without noise: what the run is judged by instead, and how to calibrate it."""
    return (
        f"baseline {base.run_id} is not calibrated: judged by the fixed thresholds (rel_diff {config.threshold:g}, "
        f"per-token {config.token_threshold:g}); measure its noise with python -m comparator store promote "
        f"{st.url} {base.run_id} --calibrate VARIANT [VARIANT ...]"
    )


def _measure(
    run_dir: str | os.PathLike[str], variants: Sequence[str | os.PathLike[str]], config: CompareConfig
) -> NoiseModel | None:
    """The run's noise from benign variants (``None`` without any); a variant that cannot be compared raises."""
    if not variants:
        return None
    return calibrate(run_dir, list(variants), threads=config.threads, allow_model_mismatch=config.allow_model_mismatch)


def _judged(base: RunRecord, base_noise: StoredNoise | None) -> str:
    """What the verdict rests on, for the message."""
    if base_noise is None:
        return f"judged by the fixed thresholds (baseline {base.run_id} is not calibrated)"
    cal = base_noise.calibration
    measured = "" if cal.measured_on == base.run_id else f", measured on run {cal.measured_on}"
    return f"judged against the noise of baseline {base.run_id} ({cal.variants} variants{measured})"


def _kept_noise(
    own: NoiseModel | None, base_noise: StoredNoise | None, passed: bool, manifest: Manifest
) -> NoiseModel | StoredNoise | None:
    """The noise stored with the run: its own, else (when it passed) its baseline's, if it fits the run."""
    if own is not None or base_noise is None or not passed:
        return own
    try:
        base_noise.noise.check_baseline(manifest, "this run")
    except UsageError:  # other weights, say: that noise does not describe this run
        return None
    return base_noise


def _compare_and_store(
    st: RunStore,
    run_dir: str | os.PathLike[str],
    manifest: Manifest,
    model: str,
    base: RunRecord,
    config: CompareConfig,
    cache_dir: str | os.PathLike[str] | None,
    warnings: tuple[str, ...],
    diffs: tuple[EnvDifference, ...],
    *,
    base_noise: StoredNoise | None,
    own: NoiseModel | None,
    build: str | None,
) -> RegressResult:
    noise_at = st.where(base.run_id, "noise.json") if base_noise is not None else None
    with st.local_dump(base.run_id, cache_dir) as base_dir:
        try:
            report = compare_dumps(base_dir, run_dir, config)
        except NotComparableError as e:
            # zero compared tensors is a failure, never a pass: keep the run as evidence, never as a baseline
            label = Label.FAILED if build is None else Label.BISECT
            rec = st.put(
                run_dir,
                model=model,
                label=label,
                baseline_run=base.run_id,
                manifest=manifest,
                summary=RunSummary.unusable(str(e)),
                noise=own,
                build=build,
            )
            return RegressResult(
                store=st.url,
                run_id=rec.run_id,
                label=label,
                baseline_run=base.run_id,
                exit_code=EXIT_UNUSABLE,
                env_differences=diffs,
                warnings=warnings,
                noise=noise_at,
                calibration=rec.calibration,
                message=f"{UNUSABLE}: {e}; stored run {rec.run_id} as {label} (evidence); "
                f"the baseline stays {base.run_id}",
            )
    report = replace(report, baseline=st.where(base.run_id, "dump"))
    rj = report.to_json()
    label = Label.of_verdict(report.passed) if build is None else Label.BISECT
    rec = st.put(
        run_dir,
        model=model,
        label=label,
        baseline_run=base.run_id,
        summary=RunSummary.of_report(report),
        report=rj,
        manifest=manifest,
        noise=_kept_noise(own, base_noise, report.passed, manifest),
        build=build,
    )
    if build is not None:
        msg = (
            f"{PASS if report.passed else FAIL}: stored run {rec.run_id} as bisect (build {build!r}; it never "
            f"becomes a baseline unless promoted) against baseline {base.run_id}"
        )
    elif report.passed:
        msg = f"{PASS}: stored run {rec.run_id} as passed (baseline {base.run_id})"
    else:
        msg = (
            f"{FAIL}: stored run {rec.run_id} as failed (evidence; it never becomes a baseline); "
            f"the baseline stays {base.run_id}"
        )
    msg += f"; {_judged(base, base_noise)}" + _stored_noise(rec, own)
    if diffs:
        msg += f"; compared across environments: {describe_differences(diffs)}"
    msg += "".join(f"; {n}" for n in report.notes)
    return RegressResult(
        store=st.url,
        run_id=rec.run_id,
        label=label,
        baseline_run=base.run_id,
        exit_code=EXIT_OK if report.passed else EXIT_DIVERGED,
        message=msg,
        report=report,
        env_differences=diffs,
        warnings=(*warnings, *report.warnings),
        noise=noise_at,
        calibration=rec.calibration,
    )


def _stored_noise(rec: RunRecord, own: NoiseModel | None) -> str:
    if own is not None:
        return f"; stored its noise from {len(own.variants)} variants"
    if rec.calibration is not None:
        return f"; it keeps the noise of run {rec.calibration.measured_on}"
    return ""


def _bootstrap(
    st: RunStore,
    run_dir: str | os.PathLike[str],
    manifest: Manifest,
    model: str,
    warnings: tuple[str, ...],
    *,
    why: str,
    diffs: tuple[EnvDifference, ...] = (),
    noise: NoiseModel | None = None,
) -> RegressResult:
    rec = st.put(run_dir, model=model, label=Label.BASELINE, manifest=manifest, noise=noise)
    calibrated = (
        f"calibrated from {len(noise.variants)} variants"
        if noise is not None
        else f"not calibrated: runs are judged against it by the fixed thresholds until python -m comparator "
        f"store promote {st.url} {rec.run_id} --calibrate VARIANT [VARIANT ...] measures its noise"
    )
    return RegressResult(
        store=st.url,
        run_id=rec.run_id,
        label=Label.BASELINE,
        baseline_run=None,
        exit_code=EXIT_OK,
        message=f"{BOOTSTRAP}: {why} for model {model!r}; stored run {rec.run_id} as the baseline "
        f"(nothing compared); {calibrated}",
        env_differences=diffs,
        warnings=warnings,
        calibration=rec.calibration,
    )


def _no_baseline(st: RunStore, entries: list[RunEntry], model: str, manifest: Manifest) -> str:
    recs = [e.record for e in entries if e.complete and e.record is not None and e.record.model == model]
    sig = signature_key(manifest.capture_signature)
    same_sig = [r for r in recs if signature_key(r.capture_signature) == sig]
    why = []
    if same_sig:
        why.append(
            f"{len(same_sig)} runs with this signature are all labelled failed or bisect and never become baselines"
        )
    if len(recs) > len(same_sig):
        why.append(f"{len(recs) - len(same_sig)} runs of this model have another capture signature")
    detail = f" ({'; '.join(why)})" if why else " (no runs of this model)"
    fix = "record this run as the first baseline with --bootstrap"
    if same_sig:
        fix += f", or bless a failed run with python -m comparator store promote {st.url} RUN_ID"
    return f"{st.url}: no comparable baseline for model {model!r} with this capture signature{detail}; {fix}"
