"""The one threshold parser (:mod:`comparator.judging.values`) and the places that read thresholds through it."""

from __future__ import annotations

import json

import pytest

from comparator.cli.args import logprob_thresholds
from comparator.judging.logprob_thresholds import LogprobThresholds, load_threshold_table, logprob_env_thresholds
from comparator.judging.noise_thresholds import parse_noise_floor
from comparator.judging.values import parse_assignments, parse_threshold
from dumper.errors import UsageError


@pytest.mark.parametrize(
    "raw, want", [("1e-3", 1e-3), (" 0.5 ", 0.5), ("0", 0.0), (2, 2.0), (0.25, 0.25), ("1E+2", 100.0), (-0.0, 0.0)]
)
def test_numbers_parse_to_floats(raw, want):
    got = parse_threshold(raw, where="X")
    assert got == want and type(got) is float


@pytest.mark.parametrize(
    "raw", ["nan", "NaN", "inf", "-inf", "-1", "-1e-9", float("nan"), float("inf"), -1, -1e-300, 10**400]
)
@pytest.mark.parametrize("allow_off", [False, True])
def test_a_check_that_cannot_fail_is_refused(raw, allow_off):
    with pytest.raises(
        UsageError,
        match=r"^DRIFTSCOPE_X: .*must be a finite number >= 0|^DRIFTSCOPE_X: .*is not a "
        "finite number >= 0",
    ) as e:
        parse_threshold(raw, where="DRIFTSCOPE_X", allow_off=allow_off)
    assert ("(or off)" in str(e.value)) == allow_off and "\n" not in str(e.value)


@pytest.mark.parametrize("raw", ["abc", "", "1e-3x", "1,5"])
def test_text_that_is_no_number_is_refused(raw):
    with pytest.raises(UsageError, match=f"--flag: {raw!r} is not a number$"):
        parse_threshold(raw, where="--flag")
    with pytest.raises(UsageError, match=r"is not a number \(or off\)$"):
        parse_threshold(raw, where="--flag", allow_off=True)


@pytest.mark.parametrize("word", ["off", "OFF", " none ", "null"])
def test_off_words_switch_off_only_where_allowed(word):
    assert parse_threshold(word, where="X", allow_off=True) is None
    with pytest.raises(UsageError, match="is not a number$"):
        parse_threshold(word, where="X")


def test_json_values():
    row = json.loads(
        '{"null": null, "int": 3, "float": 1e-4, "true": true, "false": false, "text": "1e-2", '
        '"list": [1], "big": 1e400}'
    )
    assert parse_threshold(row["null"], where="t", allow_off=True) is None
    with pytest.raises(UsageError, match="t: a threshold is required"):
        parse_threshold(row["null"], where="t")
    assert parse_threshold(row["int"], where="t") == 3.0 and parse_threshold(row["float"], where="t") == 1e-4
    assert parse_threshold(row["text"], where="t") == 1e-2
    for key in ("true", "false", "list", "big"):  # a bool is no number; 1e400 reads as inf
        with pytest.raises(UsageError, match="must be a finite number >= 0"):
            parse_threshold(row[key], where="t", allow_off=True)


def test_assignments_later_items_win():
    got = parse_assignments(["mse=1", "kl_max=off", "mse = 2e-3", "kl_max=0.5"], flag="--t", allow_off=True)
    assert got == {"mse": 2e-3, "kl_max": 0.5}
    assert parse_assignments(["kl_max=0.5", "kl_max=off"], flag="--t", allow_off=True) == {"kl_max": None}
    assert parse_assignments([], flag="--t") == {}


@pytest.mark.parametrize(
    "item, words",
    [
        ("mse", "expected NAME=VALUE"),
        ("=1", "expected NAME=VALUE"),
        (" =1", "expected NAME=VALUE"),
        ("mse=", "'' is not a number"),
        ("mse=abc", "'abc' is not a number"),
        ("mse=-1", "-1.0 must be"),
        ("mse=nan", "nan must be"),
        ("mse=off", "'off' is not a number"),
    ],
)
def test_assignment_errors_name_the_item(item, words):
    with pytest.raises(UsageError, match=f"^--t {item!r}: ") as e:
        parse_assignments(["k3_mean=1", item], flag="--t")
    assert words in str(e.value)


def test_a_default_name_takes_bare_values():
    got = parse_assignments(["1e-9", "kl_max=1e-3", "2e-9"], flag="--noise-floor", default_name="rel_diff")
    assert got == {"rel_diff": 2e-9, "kl_max": 1e-3}
    with pytest.raises(UsageError, match="--noise-floor '=1': expected NAME=VALUE"):
        parse_assignments(["=1"], flag="--noise-floor", default_name="rel_diff")
    with pytest.raises(UsageError, match=r"--noise-floor 'off': 'off' is not a number$"):
        parse_assignments(["off"], flag="--noise-floor", default_name="rel_diff")


def test_every_logprob_threshold_source_parses_alike(tmp_path):
    """The flag, the environment, the table and the dataclass refuse the same values the same way."""
    assert logprob_thresholds(["mse=1e-3", "kl_max=off", "mse=2e-3"]) == {"mse": 2e-3, "kl_max": None}
    assert parse_noise_floor(["1e-10", "kl_max=1e-9"]) == {"rel_diff": 1e-10, "kl_max": 1e-9}
    assert logprob_env_thresholds({"DRIFTSCOPE_LOGPROB_MSE": "off", "DRIFTSCOPE_LOGPROB_KL_MAX": "0.1"}) == {
        "mse": None,
        "kl_max": 0.1,
    }
    table = tmp_path / "t.json"
    for bad in ("nan", "-1", "inf"):
        with pytest.raises(UsageError, match=f"--logprob-threshold 'mse={bad}'"):
            logprob_thresholds([f"mse={bad}"])
        with pytest.raises(UsageError, match=f"--noise-floor 'kl_max={bad}'"):
            parse_noise_floor([f"kl_max={bad}"])
        with pytest.raises(UsageError, match="DRIFTSCOPE_LOGPROB_MSE: .*finite number >= 0"):
            logprob_env_thresholds({"DRIFTSCOPE_LOGPROB_MSE": bad})
        with pytest.raises(UsageError, match="logprob threshold mse: .*finite number >= 0"):
            LogprobThresholds(mse=float(bad))
    for bad in (-1, True, "x"):
        table.write_text(json.dumps({"default": {"mse": 1e-3}, "m": {"k3_mean": bad}}))
        with pytest.raises(UsageError, match=f"{table}: m: k3_mean: "):
            load_threshold_table(table)
    table.write_text(json.dumps({"default": {"mse": 1e-3}, "m": {"k3_mean": None, "mse": "off"}}))
    assert load_threshold_table(table)["m"] == {"k3_mean": None, "mse": None}
