"""A store written by the code before the typed record parts (issue 21) reads with today's code.

The old code (:data:`~tests.comparator.store.conftest.OLD_COMMIT`, exported from git) runs in a
subprocess on real tiny-llama dumps: a baseline bootstrapped with its noise measured, a run with
other weights (failed, a first divergence), a passing run (inheriting the noise, then promoted by
a human), and in another run group a run that cannot be compared (unusable: an ``error``, no
thresholds). Today's code lists it, shows it, selects from it and regresses against it, and the
old code still reads what today's wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from comparator import regress
from comparator.store import Calibration, Label, RunRecord, RunStatus, RunStore, RunSummary, select_baseline
from comparator.store.types import SUMMARY_KEYS
from dumper.errors import EXIT_DIVERGED, EXIT_OK, EXIT_UNUSABLE
from dumper.format import load_manifest
from tests.conftest import run_cli

OLD_WRITER = """
import json, sys
import comparator
from comparator import regress
from comparator.store import RunStore

code, store, base, sdpa, chunk, buggy, synth, shifted = sys.argv[1:]
assert comparator.__file__.startswith(code), comparator.__file__  # the old code, not this checkout
runs = {"calibrated": regress(base, store, bootstrap=True, calibrate_from=[sdpa, chunk])}
runs["failed"] = regress(buggy, store)
runs["passed"] = regress(base, store)
runs["synth"] = regress(synth, store, bootstrap=True)
runs["unusable"] = regress(shifted, store)
RunStore(store).promote(runs["passed"].run_id)
print(json.dumps({k: {"run_id": r.run_id, "label": r.label, "exit_code": r.exit_code} for k, r in runs.items()}))
"""

OLD_READER = """
import json, sys
import comparator
from comparator.store import RunStore

code, store = sys.argv[1:]
assert comparator.__file__.startswith(code), comparator.__file__
print(json.dumps({e.name: [e.status, e.record and e.record.pass_label, e.record and e.record.verdict()]
                  for e in RunStore(store).runs()}))
"""


def _old(code: Path, script: str, *args: str | os.PathLike[str]) -> Any:
    """Run ``script`` with the old code alone on the path (not from this checkout), its stdout as JSON."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    r = subprocess.run(
        [sys.executable, "-c", script, str(code), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=code,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def old_store(
    tiny_dumps: dict[str, Path], old_code: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str]]:
    """The store the old code wrote, and its run ids by role."""
    store = tmp_path_factory.mktemp("old-store") / "store"
    runs = _old(
        old_code, OLD_WRITER, store, *(tiny_dumps[k] for k in ("base", "sdpa", "chunk", "buggy", "synth", "shifted"))
    )
    assert [runs[k]["exit_code"] for k in runs] == [EXIT_OK, EXIT_DIVERGED, EXIT_OK, EXIT_OK, EXIT_UNUSABLE]
    return store, {k: r["run_id"] for k, r in runs.items()}


def _raw(store: Path, run_id: str) -> dict[str, Any]:
    return json.loads((store / "runs" / run_id / "run.json").read_text())


def test_an_old_store_lists_with_typed_records(old_store: tuple[Path, dict[str, str]]) -> None:
    store, ids = old_store
    entries = RunStore(store).runs()
    assert [e.status for e in entries] == [RunStatus.COMPLETE] * 5
    rec = {role: RunStore(store).get(run_id) for role, run_id in ids.items()}
    cal = rec["calibrated"]
    assert cal.label is Label.BASELINE and cal.summary is None and cal.promoted is None
    assert isinstance(cal.calibration, Calibration) and cal.calibration.variants == 2
    assert cal.calibration.measured_on == cal.run_id
    failed = rec["failed"]
    assert failed.label is Label.FAILED and failed.calibration is None and failed.summary is not None
    assert type(failed.summary.first_divergent["layer"]) is int and failed.summary.error is None
    assert failed.verdict().startswith("FAIL at layer")
    passed = rec["passed"]  # promoted by a human after it passed: a baseline that inherited the noise
    assert passed.label is Label.BASELINE and passed.promoted is not None and passed.promoted.previous is Label.PASSED
    assert passed.calibration == Calibration(2, cal.calibration.created_at, cal.calibration.sha256, cal.run_id)
    assert passed.summary.passed and passed.summary.threshold is not None and passed.verdict().startswith("PASS (")
    unusable = rec["unusable"]
    assert unusable.label is Label.FAILED and unusable.summary.error
    assert unusable.summary == RunSummary.unusable(unusable.summary.error) and unusable.verdict().startswith("UNUSABLE")
    # the old writer left out the keys that did not apply; they read as None
    assert "error" not in _raw(store, failed.run_id)["summary"]
    assert "threshold" not in _raw(store, unusable.run_id)["summary"]


def test_an_old_record_writes_back_whole(old_store: tuple[Path, dict[str, str]]) -> None:
    """Every key and value the old code wrote comes back, plus the summary keys it left out (as null)."""
    store, _ = old_store
    for e in RunStore(store).runs():
        assert e.record is not None
        raw = _raw(store, e.name)
        if raw["summary"] is not None:
            raw["summary"] = {**dict.fromkeys(SUMMARY_KEYS), **raw["summary"]}
        assert e.record.to_json() == raw
        assert RunRecord.from_json(json.loads(e.record.dumps()), folder=e.name) == e.record


def test_the_cli_lists_and_shows_an_old_store(old_store: tuple[Path, dict[str, str]]) -> None:
    store, ids = old_store
    r = run_cli("comparator", "store", "ls", store)
    assert r.returncode == 0, r.stdout + r.stderr
    for text in ("baseline (current)", "FAIL at layer", "UNUSABLE", "PASS (", "5 runs shown", ids["unusable"]):
        assert text in r.stdout, (text, r.stdout)
    r = run_cli("comparator", "store", "ls", store, "--label", "failed")
    assert r.returncode == 0 and "2 runs shown" in r.stdout, r.stdout + r.stderr
    r = run_cli("comparator", "store", "show", store, ids["passed"])
    text = " ".join(r.stdout.split())  # rich wraps long lines at the console width
    assert r.returncode == 0 and '"pass_label": "baseline"' in text and '"from": "passed"' in text, r.stdout + r.stderr
    assert f"from 2 variants, measured on run {ids['calibrated']} (inherited)" in text


def test_today_selects_and_regresses_against_an_old_store(
    old_store: tuple[Path, dict[str, str]], tiny_dumps: dict[str, Path], old_code: Path, tmp_path: Path
) -> None:
    store = shutil.copytree(old_store[0], tmp_path / "store")
    ids = old_store[1]
    m = load_manifest(tiny_dumps["base"])
    base = select_baseline(RunStore(store), m.model["name"], m.capture_signature, m.environment)
    assert base is not None and base.run_id == ids["passed"]  # the promoted run: the latest that did not fail
    ok = regress(tiny_dumps["base"], store)
    assert ok.exit_code == EXIT_OK and ok.label is Label.PASSED, ok.message
    assert f"noise of baseline {ids['passed']} (2 variants, measured on run {ids['calibrated']})" in ok.message
    assert ok.calibration == base.calibration  # the old baseline's noise, inherited byte for byte
    bad = regress(tiny_dumps["buggy"], store)
    assert bad.exit_code == EXIT_DIVERGED and bad.label is Label.FAILED and bad.report is not None
    assert RunStore(store).get(bad.run_id).summary == RunSummary.of_report(bad.report)
    # and the old code reads what today's wrote (a summary with every key, null where it does not apply)
    listed = _old(old_code, OLD_READER, store)
    assert listed[ok.run_id][:2] == ["complete", "passed"] and listed[ok.run_id][2].startswith("PASS (")
    assert listed[bad.run_id][:2] == ["complete", "failed"] and listed[bad.run_id][2].startswith("FAIL at layer")
    assert [status for status, _, _ in listed.values()] == ["complete"] * 7
