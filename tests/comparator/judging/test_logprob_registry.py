"""A logprob metric registered in ONE call shows up everywhere a logprob metric does.

The throwaway metric ``p99_abs_err`` (the 99th percentile of |Δlogprob|, max-type) is registered by
one :func:`register_logprob_metric` call and nothing else; real dumps of tiny-llama (float32
baseline, bfloat16 target, so that the logprobs really differ) are then compared, calibrated and
rendered. Every place that lists logprob metrics must list it: the verdict's JSON and its round
trip, the terminal table, Markdown, HTML, the ``--logprob-threshold`` / ``--noise-floor`` help,
``DRIFTSCOPE_LOGPROB_<NAME>``, a row of the threshold table, a threshold that fails the verdict,
NOISE.json's logprob noise from calibration and a verdict judged against it. A metric that needed a
second place (a hand-typed name list, a label table, a per-metric field) fails here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from rich.console import Console

from comparator import CompareConfig, compare_dumps
from comparator.cli.main import build_parser
from comparator.judging.logprob_metrics import (
    MAX,
    LogprobMetric,
    MetricInputs,
    MetricValue,
    metric_names,
    register_logprob_metric,
    unregister_logprob_metric,
)
from comparator.judging.logprob_thresholds import LogprobThresholds, explicit_thresholds, load_threshold_table
from comparator.judging.noise_thresholds import parse_noise_floor, resolve_logprob_thresholds
from comparator.logprobs.judge import compare_logprob_sources
from comparator.logprobs.types import LogprobVerdict
from comparator.noise.calibrate import calibrate
from comparator.noise.file import load_noise, save_noise
from comparator.reports.html import render_html
from comparator.reports.markdown import to_markdown
from comparator.reports.text import render_logprobs, render_noise
from dumper.errors import UsageError
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, run_dump

NAME = "p99_abs_err"
LABEL = "p99 |Δlogprob|"
PROMPTS = ("The quick brown fox jumps over the lazy dog.", "def f(x): return x * x + 1")
SPEC = LogprobSpec(top_k=3, save_logits=True)
BUILTIN = ("mse", "mean_abs_err", "max_abs_err", "k3_mean", "kl_mean", "kl_max", "topk_max_err")


def _p99(c: MetricInputs) -> MetricValue:
    return MetricValue(float(np.quantile(np.abs(np.concatenate([s.delta for s in c.samples])), 0.99)))


@pytest.fixture
def p99() -> Iterator[LogprobMetric]:
    """``p99_abs_err`` registered for one test, and gone after it."""
    spec = register_logprob_metric(LogprobMetric(NAME, LABEL, MAX, 1e-4, _p99))  # the one call
    try:
        yield spec
    finally:
        unregister_logprob_metric(NAME)
    assert NAME not in metric_names()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A float32 baseline and a bfloat16 target of the same prompts, logprobs and logits recorded."""
    root = tmp_path_factory.mktemp("registry")
    for name, dtype in (("base", "float32"), ("bf16", "bfloat16")):
        run_dump(RunConfig(out=str(root / name), prompts=PROMPTS, layers="first", dtype=dtype, logprobs=SPEC))
    return root


def _only(name: str, value: float) -> dict[str, float | None]:
    """Explicit thresholds that check ``name`` alone."""
    return {**dict.fromkeys(BUILTIN), name: value}


def test_builtins_are_in_report_order():
    assert metric_names()[: len(BUILTIN)] == BUILTIN


def test_a_registered_metric_is_in_every_output(p99, dumps):
    base, target = dumps / "base", dumps / "bf16"
    report = compare_dumps(base, target, CompareConfig.resolve(env={}))
    v = report.logprobs
    assert v is not None and v.passed, v.failures()
    value = v.value_of(NAME).value
    deltas = np.abs(np.concatenate([s.delta for s in v.series]))
    assert value is not None and value == pytest.approx(float(np.quantile(deltas, 0.99))) and value > 0
    assert getattr(v, NAME) == value and v.metrics()[NAME] == value

    d = v.to_json()  # the verdict's JSON: a flat key, and one under thresholds (not checked: null)
    assert d[NAME] == value and NAME in d["thresholds"] and d["thresholds"][NAME] is None
    back = LogprobVerdict.from_json(json.loads(json.dumps(d)))
    assert back == v and back.value_of(NAME).value == value

    console = Console(record=True, width=200)  # the terminal table
    render_logprobs(v, console)
    assert any(LABEL in line and NAME not in line for line in console.export_text().splitlines())
    assert LABEL.replace("|", "\\|") in to_markdown(report)  # Markdown (| escaped in a cell)
    assert f"<td>{LABEL}</td>" in render_html(report)  # HTML


def test_a_threshold_on_it_fails_the_verdict(p99, dumps):
    base, target = dumps / "base", dumps / "bf16"
    value = compare_logprob_sources(base, target, explicit=_only(NAME, 1.0)).value_of(NAME).value
    assert value is not None and value > 0
    passing = compare_logprob_sources(base, target, explicit=_only(NAME, 2 * value))
    assert passing.passed and passing.failures() == [] and passing.thresholds.values[NAME] == 2 * value
    failing = compare_logprob_sources(base, target, explicit=_only(NAME, value / 2))
    assert not failing.passed and failing.failures() == [NAME]
    console = Console(record=True, width=200)
    render_logprobs(failing, console)
    assert f"logprobs: FAIL ({NAME})" in console.export_text()
    report = compare_dumps(base, target, CompareConfig.resolve(logprob_thresholds=_only(NAME, value / 2), env={}))
    assert (
        not report.passed
        and f"FAIL ({NAME})" in to_markdown(report)
        and '<tr class="bad"><td>p99' in render_html(report)
    )
    # the same threshold from the environment, DRIFTSCOPE_LOGPROB_<NAME>
    env = {"DRIFTSCOPE_LOGPROB_P99_ABS_ERR": f"{value / 2!r}"}
    assert explicit_thresholds(env=env) == {NAME: value / 2}
    assert LogprobThresholds.resolve("tiny-llama", env=env).failures(failing.metrics()) == [NAME]


def test_cli_help_and_threshold_table_know_it(p99, tmp_path):
    text = " ".join(build_parser().format_help().split())
    assert f"logprob threshold ({', '.join(metric_names())};" in text and NAME in text
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"default": {"mse": 1.0, NAME: 0.5}, "tiny-llama": {NAME: 0.25}}))
    assert load_threshold_table(table)["default"][NAME] == 0.5
    t = LogprobThresholds.resolve("tiny-llama", env={}, table=table)
    assert getattr(t, NAME) == 0.25 and t.mse == 1.0 and t.to_json()[NAME] == 0.25
    assert LogprobThresholds.from_json(t.to_json()) == t and LogprobThresholds(**{NAME: 0.1}).values[NAME] == 0.1
    table.write_text(json.dumps({"default": {"p98_abs_err": 0.5}}))
    with pytest.raises(UsageError, match="unknown keys"):
        load_threshold_table(table)
    assert parse_noise_floor([f"{NAME}=1e-3"]) == {NAME: 1e-3}


def test_calibration_records_its_noise(p99, dumps, tmp_path):
    base, target = dumps / "base", dumps / "bf16"
    noise = calibrate(base, [target])
    assert noise.logprobs is not None
    measured = noise.logprobs.metrics[NAME]
    assert measured is not None and measured > 0 and noise.logprobs.by_variant[NAME] == (measured,)
    save_noise(noise, tmp_path / "noise.json")
    raw = json.loads((tmp_path / "noise.json").read_text())
    assert raw["logprobs"]["metrics"][NAME] == measured
    back = load_noise(tmp_path / "noise.json")
    assert back.logprobs is not None and back.logprobs.metrics[NAME] == measured
    console = Console(record=True, width=400)
    render_noise(back, console)
    assert NAME in console.export_text()
    thresholds = resolve_logprob_thresholds("tiny-llama", noise=back.logprobs, factor=3.0, env={}, floors={NAME: 1e-9})
    assert thresholds.values[NAME] == max(1e-9, 3.0 * measured) and NAME in thresholds.basis.from_noise
    v = compare_logprob_sources(base, target, noise=back)
    assert (
        v.noise is not None
        and NAME in v.noise.metrics
        and v.noise.metrics[NAME].ratio == pytest.approx(v.value_of(NAME).value / max(measured, 1e-4))
    )
    assert NAME in v.to_json()["noise"]["metrics"]
    assert LogprobVerdict.from_json(json.loads(json.dumps(v.to_json()))).noise == v.noise


def test_registration_is_checked(p99):
    with pytest.raises(UsageError, match="already registered"):
        register_logprob_metric(LogprobMetric(NAME, LABEL, MAX, 1e-4, _p99))
    with pytest.raises(UsageError, match="lower-case identifier"):
        LogprobMetric("P99", LABEL, MAX, 1e-4, _p99)
    with pytest.raises(UsageError, match="standard error"):
        LogprobMetric("p98", LABEL, MAX, 1e-4, _p99, se_key="p98_se")
    with pytest.raises(UsageError, match="floor"):
        LogprobMetric("p98", LABEL, MAX, -1.0, _p99)
