"""The metric registry: a metric added from outside the library shows in every output of a real comparison.

Two real dumps of the tiny llama (eager vs sdpa attention: small, real numeric differences) are
compared with a throwaway metric registered for the test only; its values are checked against
float64 numpy on the raw tensors read straight from the safetensors files.
"""

from __future__ import annotations

import io
import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from rich.console import Console
from safetensors.numpy import load_file

import dumper
from comparator import compare_dumps
from comparator.hidden import registry
from comparator.hidden.registry import Metric, RowSums, registered
from comparator.hidden.types import Report, TensorComparison
from comparator.reports.files import json_text, write_csv
from comparator.reports.html import render_html
from comparator.reports.text import render_report
from tests.conftest import prompt_ids, tiny_llama

BUILTIN = ["rel_diff", "max_token_rel_diff", "max_abs_diff", "mean_abs_diff", "cosine"]
"""The built-in metrics, in the order the JSON contract has always had them."""
JSON_KEYS = [
    "name",
    "layer",
    "forward_pass",
    "rank",
    "shape",
    *BUILTIN,
    "nan_baseline",
    "inf_baseline",
    "nan_target",
    "inf_target",
    "nonfinite_mismatches",
    "failing_tokens",
    "first_failing_token",
    "first_failing_row",
    "first_failing_sequence",
    "worst_token",
    "worst_row",
    "passed",
    "sequence",
    "failing_ranges",
    "note",
    "threshold",
    "token_threshold",
    "noise_ratio",
    "token_noise_ratio",
    "decode_token_threshold",
    "replica_side",
    "point",
    "own_noise_rows",
]


def _rms_diff(s: RowSums) -> float:
    """sqrt(mean (x - y)^2) over the compared pairs: the throwaway metric of these tests."""
    return math.sqrt(s.total("dd") / max(1, s.elements - s.mismatches))


RMS = Metric("rms_diff", _rms_diff, label="rms |diff|", short="rms")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    for attn in ("eager", "sdpa"):
        model, tok = tiny_llama(attn=attn)
        with dumper.capture(model, root / attn, layers="all"), torch.inference_mode():
            model(prompt_ids(tok, 24))
    return root / "eager", root / "sdpa"


def _raw(dump, name: str) -> np.ndarray:
    """The tensor ``name`` of a one-pass dump as float64, read with safetensors (not the library's reader)."""
    rec = next(t for t in json.loads((dump / "manifest.json").read_text())["tensors"] if t["name"] == name)
    return load_file(str(dump / rec["file"]))[rec["key"]].astype(np.float64)


def test_builtin_metrics_keep_their_json_keys_and_order(dumps):
    assert [m.name for m in registry.metrics()] == BUILTIN
    report = compare_dumps(*dumps)
    assert all(list(t.to_json()) == JSON_KEYS for t in report.tensors)


def test_a_registered_metric_is_in_the_json_csv_text_and_html(dumps, tmp_path):
    with registered(RMS):
        report = compare_dumps(*dumps)
    assert report.tensors and all(list(t.metrics) == [*BUILTIN, "rms_diff"] for t in report.tensors)
    want = {
        t.name: float(np.sqrt(np.mean((_raw(dumps[0], t.name) - _raw(dumps[1], t.name)) ** 2))) for t in report.tensors
    }
    assert sum(v > 0 for v in want.values()) >= len(want) - 1  # only layer 0's input is the same
    assert {t.name: t.metrics["rms_diff"] for t in report.tensors} == pytest.approx(want, rel=1e-9)

    d = report.to_json()["tensors"][0]
    assert list(d) == [*JSON_KEYS[:10], "rms_diff", *JSON_KEYS[10:]]  # after the built-ins, before the counts
    assert d["rms_diff"] == report.tensors[0].metrics["rms_diff"]

    write_csv(report, tmp_path / "t.csv")
    csv = pd.read_csv(tmp_path / "t.csv")
    assert list(csv.columns) == [*JSON_KEYS[:10], "rms_diff", *JSON_KEYS[10:]]
    np.testing.assert_allclose(csv["rms_diff"], [t.metrics["rms_diff"] for t in report.tensors], rtol=1e-12)

    console = Console(file=io.StringIO(), width=400, color_system=None)
    with registered(RMS):  # the tables label and format a metric as its registration says
        render_report(report, console, tensors=True)
        html = render_html(report)
    worst = max(report.tensors, key=lambda t: t.metrics["rms_diff"])
    text = console.file.getvalue()
    assert re.search(r"┃ rms +┃", text) and f"│ {worst.metrics['rms_diff']:.3e} │" in text
    assert ">rms |diff|</th>" in html and f'data-v="{worst.metrics["rms_diff"]!r}"' in html


def test_a_metric_is_gone_once_unregistered_but_a_report_keeps_it(dumps):
    with registered(RMS):
        kept = compare_dumps(*dumps)
    assert "rms_diff" not in [m.name for m in registry.metrics()]
    assert all("rms_diff" not in t.metrics for t in compare_dumps(*dumps).tensors)
    back = Report.from_json(json.loads(json_text(kept)))  # read while the metric is not registered
    assert [t.metrics["rms_diff"] for t in back.tensors] == [t.metrics["rms_diff"] for t in kept.tensors]
    assert ">rms_diff</th>" in render_html(back)  # shown by its name: nothing says how else


def test_a_nonfinite_metric_is_null_in_json_and_reads_back_by_its_direction(dumps):
    nan_metric = Metric("always_nan", lambda s: math.nan, label="nan")
    similarity = Metric("nan_similarity", lambda s: math.nan, label="sim", higher_is_worse=False)
    with registered(nan_metric), registered(similarity):
        t = compare_dumps(*dumps).tensors[0]
    d = t.to_json()
    assert d["always_nan"] is None and d["nan_similarity"] is None
    with registered(nan_metric), registered(similarity):
        back = TensorComparison.from_json(d)
    assert back.metrics["always_nan"] == math.inf  # a difference that can never pass
    assert math.isnan(back.metrics["nan_similarity"])


def test_registering_twice_or_looking_up_an_unknown_name_is_an_error():
    with registered(RMS):
        with pytest.raises(ValueError, match="rms_diff.*already registered"):
            registry.register(RMS)
    with pytest.raises(KeyError, match="no metric named 'rms_diff'; registered: rel_diff"):
        registry.get("rms_diff")
    with pytest.raises(KeyError, match="no metric named"):
        registry.unregister("rms_diff")
    assert registry.get("cosine").higher_is_worse is False and registry.get("rel_diff").higher_is_worse


def test_a_metric_named_like_a_result_field_is_refused(dumps):
    with (
        registered(Metric("passed", lambda s: 1.0, label="passed")),
        pytest.raises(ValueError, match=r"metric names \['passed'\] are fields of TensorComparison"),
    ):
        compare_dumps(*dumps)
