"""One JSON codec: every result type reads back what it wrote, ``X.from_json(json.loads(json.dumps(x.to_json())))``.

The results come from real comparisons of real dumps: a clean tiny-llama run against itself
(a pass: every optional field None) and against a one-token bug (first divergence, heatmap,
logprob verdict), and a calibrated comparison whose target holds NaNs and an Inf (infinite
rel_diff and noise ratios, null in the JSON). The scalar-only types are also checked with hypothesis.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dumper
from comparator import CompareConfig, compare_dumps
from comparator.hidden.onset import Amplification
from comparator.hidden.types import FirstDivergence, Heatmap, ReplicaMismatch, Report, TensorComparison
from comparator.logprobs import LogprobVerdict
from comparator.noise.calibrate import calibrate
from comparator.reports.files import json_text
from comparator.store.environment import EnvDifference
from dumper.format.jsonfloat import from_json_float, to_json_float
from tests.report_dumps import clean_dump, one_token_bug_dump

LAYER, TOKEN = 2, 57
ROWS, HIDDEN, LAYERS = 12, 16, 3


def _synth(out: Path, edit: Any = None, *, scale: float = 0.0) -> Path:
    """Three self-attention inputs of one sequence (the same values each call); ``edit(layer, x)`` changes
    a layer's rows in place, ``scale`` adds relative noise of that size (a benign variant)."""
    g, jitter = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    with dumper.capture(None, out, model_name="synth"):
        for layer in range(LAYERS):
            x = torch.randn(ROWS, HIDDEN, generator=g)  # [tokens, hidden]
            x *= 1 + scale * torch.randn(x.shape, generator=jitter)
            if edit is not None:
                edit(layer, x)
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


def _nonfinite(layer: int, x: torch.Tensor) -> None:
    if layer >= 1:
        x[5] = math.nan  # a NaN row from layer 1 on: rel_diff inf (cosine is over the finite values)
    if layer == 2:
        x[7, 0] = math.inf


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Report]:
    root = tmp_path_factory.mktemp("results")
    base = clean_dump(root / "base")
    shutil.copytree(base, root / "same")
    bad = one_token_bug_dump(root / "bad", layer=LAYER, token=TOKEN)
    synth, variant, broken = _synth(root / "s"), _synth(root / "v", scale=1e-6), _synth(root / "n", _nonfinite)
    noise = calibrate(synth, [variant], threads=1)
    return {
        "pass": compare_dumps(base, root / "same"),
        "bug": compare_dumps(base, bad),
        "nonfinite": compare_dumps(synth, broken, CompareConfig.resolve(noise=noise, threads=1)),
    }


def _wire(d: dict[str, Any]) -> dict[str, Any]:
    """Through standard JSON text and back (NaN or Inf would be refused here)."""
    return json.loads(json.dumps(d, allow_nan=False))


@pytest.mark.parametrize("which", ["pass", "bug", "nonfinite"])
def test_report_round_trips(reports, which):
    report = reports[which]
    back = Report.from_json(_wire(report.to_json()))
    assert back == report and back.to_json() == report.to_json() and back.passed == report.passed
    assert Report.from_json(json.loads(json_text(report))) == report


def test_the_reports_hold_what_the_round_trip_must_carry(reports):
    """Guards the test above: each report really has the parts, None fields and non-finite values."""
    ok, bug, nf = reports["pass"], reports["bug"], reports["nonfinite"]
    assert ok.passed and ok.first_divergent is None and ok.heatmap is None and ok.noise is None
    assert all(t.first_failing_token is None and t.noise_ratio is None for t in ok.tensors)
    assert not bug.passed and bug.first_divergent.layer == LAYER + 1 and bug.heatmap is not None
    assert bug.logprobs is not None and not bug.logprobs.passed and bug.amplification
    assert nf.noise_factor is not None and nf.first_divergent is not None and math.isinf(nf.first_divergent.rel_diff)
    worst = [t for t in nf.tensors if math.isinf(t.rel_diff)]
    assert worst and all(math.isinf(t.noise_ratio) and math.isinf(t.token_noise_ratio) for t in worst)
    assert any(math.isinf(v) for row in nf.heatmap.values for v in row)
    assert "NaN" not in json_text(nf) and "Infinity" not in json_text(nf)  # standard JSON: non-finite as null


def test_every_part_round_trips(reports):
    for report in reports.values():
        calibrated = report.noise_factor is not None
        for t in report.tensors:
            assert TensorComparison.from_json(_wire(t.to_json()), calibrated=calibrated) == t
        for a in report.amplification:
            assert Amplification.from_json(_wire(a.to_json())) == a
        if report.first_divergent is not None:
            fd = report.first_divergent
            assert FirstDivergence.from_json(_wire(fd.to_json())) == fd
        if report.heatmap is not None:
            assert Heatmap.from_json(_wire(report.heatmap.to_json())) == report.heatmap
        if report.logprobs is not None:
            assert LogprobVerdict.from_json(_wire(report.logprobs.to_json())) == report.logprobs


_metric = st.one_of(st.floats(min_value=0, allow_nan=False), st.just(math.inf))


@given(
    side=st.sampled_from(["baseline", "target"]),
    name=st.text(max_size=20),
    layer=st.one_of(st.none(), st.integers(0, 200)),
    seq=st.integers(0, 64),
    rank=st.integers(0, 7),
    ref=st.integers(0, 7),
    token=st.integers(0, 10**6),
    value=_metric,
)
def test_replica_mismatch_round_trips(side, name, layer, seq, rank, ref, token, value):
    m = ReplicaMismatch(
        side=side,
        name=name,
        layer=layer,
        sequence=seq,
        rank=rank,
        reference_rank=ref,
        first_token=token,
        max_token_rel_diff=value,
    )
    assert ReplicaMismatch.from_json(_wire(m.to_json())) == m


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8,
)


@given(field=st.sampled_from(["torch", "cuda", "device_name", "python"]), baseline=_json, run=_json)
def test_env_difference_round_trips(field, baseline, run):
    d = EnvDifference(field, baseline, run)
    assert EnvDifference.from_json(_wire(d.to_json())) == d


@given(v=st.one_of(st.floats(allow_nan=False), st.none()))
def test_the_float_rule(v):
    """Finite values cross as they are; any non-finite one (and a missing one) is null, read back as +inf."""
    wire = to_json_float(v)
    assert wire is None or math.isfinite(wire)
    back = from_json_float(_wire({"v": wire})["v"])
    assert back == (v if v is not None and math.isfinite(v) else math.inf)
