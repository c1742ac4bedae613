"""The typed parts of a run record (``RunSummary``, ``Calibration``, ``Promotion``, ``Label``) from real runs.

One local store of real tiny-llama runs regressed by today's code: a baseline bootstrapped with
its noise measured from two benign variants, a run with other weights (failed, with a first
divergence), a passing run (inheriting the noise), and in another run group a run that cannot
be compared (unusable); the failed run is then promoted. Each part reads back what it wrote,
equals what its builder makes from the regress result, and a malformed one is refused in one
line naming the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from comparator import regress
from comparator.store import LABELS, Calibration, Label, Promotion, RunStore, RunSummary
from comparator.store.regress import RegressResult
from comparator.store.types import CALIBRATION_KEYS, SUMMARY_KEYS
from dumper.errors import EXIT_DIVERGED, EXIT_OK, EXIT_UNUSABLE

WHERE = "store/runs/20261130T094716.302031123Z-a1b2c3/run.json"


@pytest.fixture(scope="module")
def judged(
    tiny_dumps: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunStore, dict[str, RegressResult]]:
    d = tiny_dumps
    store = RunStore(tmp_path_factory.mktemp("record-types") / "store")
    runs = {"calibrated": regress(d["base"], store, bootstrap=True, calibrate_from=[d["sdpa"], d["chunk"]])}
    runs["failed"] = regress(d["buggy"], store)
    runs["passed"] = regress(d["base"], store)
    runs["synth"] = regress(d["synth"], store, bootstrap=True)
    runs["unusable"] = regress(d["shifted"], store)
    assert [r.exit_code for r in runs.values()] == [EXIT_OK, EXIT_DIVERGED, EXIT_OK, EXIT_OK, EXIT_UNUSABLE]
    return store, runs


def _wire(d: dict[str, Any]) -> Any:
    """Through standard JSON text and back."""
    return json.loads(json.dumps(d, allow_nan=False))


@pytest.mark.parametrize("which", ["failed", "passed", "unusable"])
def test_run_summary_round_trips(judged: tuple[RunStore, dict[str, RegressResult]], which: str) -> None:
    store, runs = judged
    summary = store.get(runs[which].run_id).summary
    assert summary is not None and tuple(summary.to_json()) == SUMMARY_KEYS  # every key, for every kind of run
    back = RunSummary.from_json(_wire(summary.to_json()), WHERE)
    assert back == summary and back.to_json() == summary.to_json() and back.verdict() == summary.verdict()


def test_one_builder_per_kind_of_run(judged: tuple[RunStore, dict[str, RegressResult]]) -> None:
    store, runs = judged
    for which in ("failed", "passed"):
        r = runs[which]
        assert r.report is not None and store.get(r.run_id).summary == RunSummary.of_report(r.report)
    failed = store.get(runs["failed"].run_id).summary
    assert failed.first_divergent == runs["failed"].report.first_divergent.to_json()
    assert failed.verdict().startswith("FAIL at layer") and failed.error is None and failed.threshold is not None
    unusable = store.get(runs["unusable"].run_id).summary
    assert unusable == RunSummary.unusable(unusable.error) and unusable.error in runs["unusable"].message
    assert unusable.threshold is None and unusable.verdict() == f"UNUSABLE: {unusable.error}"
    assert store.get(runs["calibrated"].run_id).summary is None and store.get(runs["synth"].run_id).verdict() == "-"


def test_a_newer_writers_summary_keys_are_kept(judged: tuple[RunStore, dict[str, RegressResult]]) -> None:
    store, runs = judged
    summary = store.get(runs["passed"].run_id).summary
    newer = RunSummary.from_json({**summary.to_json(), "onset": {"layer": 3}})
    assert newer.extra == {"onset": {"layer": 3}} and newer.to_json()["onset"] == {"layer": 3}
    assert RunSummary.from_json(_wire(newer.to_json())) == newer


@pytest.mark.parametrize("which", ["calibrated", "passed"])
def test_calibration_round_trips(judged: tuple[RunStore, dict[str, RegressResult]], which: str) -> None:
    store, runs = judged
    rec = store.get(runs[which].run_id)
    cal = rec.calibration
    assert isinstance(cal, Calibration) and runs[which].calibration == cal and tuple(cal.to_json()) == CALIBRATION_KEYS
    assert Calibration.from_json(_wire(cal.to_json()), WHERE) == cal
    noise = store.noise(rec)
    assert noise is not None and noise.calibration == cal and cal.sha256 == hashlib.sha256(noise.data).hexdigest()
    assert cal.measured_on == runs["calibrated"].run_id and cal.variants == 2  # passed: inherited from its baseline
    fresh = Calibration.of(noise.data, variants=cal.variants, measured_on=cal.measured_on)
    assert fresh.to_json() == {**cal.to_json(), "created_at": fresh.created_at}
    assert RegressResult.from_json(_wire(runs[which].to_json())).calibration == cal


def test_labels_and_a_promotion(judged: tuple[RunStore, dict[str, RegressResult]], tmp_path: Path) -> None:
    store, runs = judged
    labels = {k: store.get(r.run_id).label for k, r in runs.items()}
    assert labels == {
        "calibrated": Label.BASELINE,
        "failed": Label.FAILED,
        "passed": Label.PASSED,
        "synth": Label.BASELINE,
        "unusable": Label.FAILED,
    }
    assert all(runs[k].label is v for k, v in labels.items())  # RegressResult.label and RunRecord.label: one field
    assert LABELS == ("baseline", "passed", "failed", "bisect") and json.dumps([Label.FAILED]) == '["failed"]'
    assert f"{Label.PASSED}" == "passed" and Label.of_verdict(False) is Label.FAILED
    promoted = store.promote(runs["failed"].run_id)
    assert promoted.label is Label.BASELINE and promoted.promoted is not None
    assert promoted.promoted.previous is Label.FAILED and promoted.to_json()["promoted"]["from"] == "failed"
    assert Promotion.from_json(_wire(promoted.promoted.to_json()), WHERE) == promoted.promoted
    assert store.get(promoted.run_id) == promoted and promoted.to_json()["pass_label"] == "baseline"


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"passed": 1}, "summary.passed"),
        ({"matched": True}, "summary.matched"),
        ({"matched": -1}, "summary.matched"),
        ({"threshold": "1e-3"}, "summary.threshold"),
        ({"threshold": float("inf")}, "summary.threshold"),
        ({"error": 7}, "summary.error"),
        ({"logprobs_passed": 0}, "summary.logprobs_passed"),
        ({"first_divergent": {"layer": "3"}}, "summary.first_divergent.layer"),
        ({"first_divergent": []}, "summary.first_divergent"),
    ],
)
def test_a_malformed_summary_is_one_line_naming_the_file(
    judged: tuple[RunStore, dict[str, RegressResult]], edit: dict[str, Any], field: str
) -> None:
    store, runs = judged
    summary = store.get(runs["failed"].run_id).summary.to_json()
    with pytest.raises(ValueError) as e:
        RunSummary.from_json({**summary, **edit}, WHERE)
    assert str(e.value).startswith(f"{WHERE}: field {field!r}: ") and "\n" not in str(e.value), e.value
    with pytest.raises(ValueError, match="missing key 'matched'"):
        RunSummary.from_json({"passed": True}, WHERE)


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"variants": 0}, "calibration.variants"),
        ({"variants": 2.0}, "calibration.variants"),
        ({"sha256": "ABC"}, "calibration.sha256"),
        ({"measured_on": "yesterday"}, "calibration.measured_on"),
        ({"created_at": None}, "calibration.created_at"),
        ({"extra": 1}, "calibration"),
    ],
)
def test_a_malformed_calibration_is_one_line_naming_the_file(
    judged: tuple[RunStore, dict[str, RegressResult]], edit: dict[str, Any], field: str
) -> None:
    store, runs = judged
    cal = store.get(runs["calibrated"].run_id).calibration.to_json()
    with pytest.raises(ValueError) as e:
        Calibration.from_json({**cal, **edit}, WHERE)
    assert str(e.value).startswith(f"{WHERE}: field {field!r}: ") and "\n" not in str(e.value), e.value
    with pytest.raises(ValueError, match=f"^{WHERE}: field 'calibration': expected an object"):
        Calibration.from_json([cal], WHERE)
