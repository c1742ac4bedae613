"""``RegressResult`` reads back what it wrote, for every kind of real ``regress`` on a real store.

One local store: a baseline bootstrapped with its noise measured (no report, a calibration), a
run with one bumped row (a failing report with a first divergence), a run with a NaN row and an
Inf (infinite rel_diff and noise ratios, ``null`` in JSON), and a run from another machine
compared across environments (its environment differences), and a run regressed while the store
holds an unfinished upload (its warnings).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import dumper
from comparator.store import RunStore
from comparator.store.regress import RegressResult, regress
from dumper.errors import EXIT_DIVERGED, EXIT_OK
from tests.storeutil import OTHER_GPU, edited_copy, synth_dump

ROWS, HIDDEN, LAYERS = 12, 16, 3


def _nonfinite_dump(out: Path) -> Path:
    """``synth_dump(out)``'s values with a NaN row from layer 1 on and an Inf at layer 2."""
    g = torch.Generator().manual_seed(0)
    with dumper.capture(None, out, model_name="synth"):
        for layer in range(LAYERS):
            x = torch.randn(ROWS, HIDDEN, generator=g)  # [tokens, hidden]
            if layer >= 1:
                x[5] = math.nan
            if layer == 2:
                x[7, 0] = math.inf
            dumper.dump(
                f"model.layers.{layer}.self_attn.input",
                x,
                layer=layer,
                point="input",
                positions=range(ROWS),
                sequence_ids=[0] * ROWS,
            )
        dumper.step()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RegressResult]:
    root = tmp_path_factory.mktemp("regress_codec")
    store = RunStore(root / "store")
    base, variant = synth_dump(root / "base"), synth_dump(root / "variant", seed=0)
    out = {"bootstrap": regress(base, store, bootstrap=True, calibrate_from=[variant])}
    out["bump"] = regress(synth_dump(root / "bump", bump=(1, 5)), store)
    out["nonfinite"] = regress(_nonfinite_dump(root / "nonfinite"), store)
    other = edited_copy(base, root / "other", environment=OTHER_GPU)
    out["other_env"] = regress(other, store, allow_env_mismatch=True)
    (root / "store" / "runs" / out["bump"].run_id / "COMPLETE").unlink()  # an upload that never finished
    out["warned"] = regress(synth_dump(root / "again"), store)
    return out


def _wire(d: dict[str, Any]) -> dict[str, Any]:
    """Through standard JSON text and back (NaN or Inf would be refused here)."""
    return json.loads(json.dumps(d, allow_nan=False))


@pytest.mark.parametrize("which", ["bootstrap", "bump", "nonfinite", "other_env", "warned"])
def test_regress_result_round_trips(results: dict[str, RegressResult], which: str) -> None:
    r = results[which]
    back = RegressResult.from_json(_wire(r.to_json()))
    assert back == r and back.to_json() == r.to_json() and bool(back) == bool(r)


def test_the_cases_cover_every_optional_field(results: dict[str, RegressResult]) -> None:
    """Each optional field is both set and unset among the cases, so the round trips above read each kind."""
    boot, bump, nonfinite, other = (results[k] for k in ("bootstrap", "bump", "nonfinite", "other_env"))
    assert boot.report is None and boot.baseline_run is None and boot.noise is None and boot.calibration
    assert bump.exit_code == EXIT_DIVERGED and bump.report.first_divergent.layer == 1 and bump.noise
    assert nonfinite.exit_code == EXIT_DIVERGED and not bump.env_differences
    rel = [t.rel_diff for t in nonfinite.report.tensors]
    assert math.isinf(max(rel)) and any(t.noise_ratio == math.inf for t in nonfinite.report.tensors)
    assert other.exit_code == EXIT_OK and {d.field for d in other.env_differences} >= {"torch", "device_name"}
    assert not other.warnings and any("incomplete" in w for w in results["warned"].warnings)
