"""comparator.settings: each threshold variable, parsed from a given environment; a bad value is one line."""

from __future__ import annotations

import shutil

import pytest

from comparator.judging.logprob_metrics import metric_names
from comparator.judging.logprob_thresholds import logprob_env_thresholds
from comparator.settings import ComparatorSettings, comparator_settings
from dumper.errors import UsageError
from tests.conftest import run_cli
from tests.storeutil import synth_dump

FIXED = ("DRIFTSCOPE_DIFF_THRESHOLD", "DRIFTSCOPE_TOKEN_THRESHOLD")


def test_an_empty_environment_sets_nothing():
    assert comparator_settings({}) == ComparatorSettings(
        diff_threshold=None, token_threshold=None, logprob_thresholds={}
    )


def test_it_reads_only_its_own_variables():
    """The dumper's and the shared variables (dumper.settings) are not read here, nor other programs'."""
    env = {"DRIFTSCOPE_DEBUG": "1", "DRIFTSCOPE_JSON_MEMORY_MIB": "abc", "DRIFTSCOPE_DUMP_DIR": "/d", "THRESHOLD": "x"}
    assert comparator_settings(env) == ComparatorSettings()


@pytest.mark.parametrize("var", FIXED)
@pytest.mark.parametrize(("raw", "expected"), [("2e-4", 2e-4), (" 0 ", 0.0), ("1", 1.0), ("", None), (" ", None)])
def test_fixed_thresholds(var, raw, expected):
    s = comparator_settings({var: raw})
    field = "diff_threshold" if var == "DRIFTSCOPE_DIFF_THRESHOLD" else "token_threshold"
    assert getattr(s, field) == expected
    other = "token_threshold" if field == "diff_threshold" else "diff_threshold"
    assert getattr(s, other) is None


@pytest.mark.parametrize("var", FIXED)
@pytest.mark.parametrize("raw", ["nan", "-1", "inf", "abc", "off", "1e-3,2e-3"])
def test_a_bad_fixed_threshold_is_one_line_naming_the_variable(var, raw):
    """A NaN or negative threshold would make a check that never fails; 'off' is not allowed for these."""
    with pytest.raises(UsageError) as e:
        comparator_settings({var: raw})
    msg = str(e.value)
    assert msg.startswith(f"{var}: ") and "\n" not in msg


def test_logprob_thresholds_are_read_by_lower_case_name():
    env = {"DRIFTSCOPE_LOGPROB_KL_MAX": " 1e-3 ", "DRIFTSCOPE_LOGPROB_MSE": "off", "DRIFTSCOPE_LOGPROB_K3_MEAN": ""}
    assert comparator_settings(env).logprob_thresholds == {"kl_max": "1e-3", "mse": "off"}
    assert logprob_env_thresholds(env) == {"kl_max": 1e-3, "mse": None}


@pytest.mark.parametrize("name", metric_names())
def test_every_logprob_metric_has_its_variable(name):
    assert logprob_env_thresholds({f"DRIFTSCOPE_LOGPROB_{name.upper()}": "0.25"}) == {name: 0.25}


@pytest.mark.parametrize(
    ("var", "raw", "says"),
    [
        ("DRIFTSCOPE_LOGPROB_KL_MAX", "abc", "is not a number"),
        ("DRIFTSCOPE_LOGPROB_MSE", "-1", "finite number >= 0"),
        ("DRIFTSCOPE_LOGPROB_K3_MEAN", "nan", "finite number >= 0"),
        ("DRIFTSCOPE_LOGPROB_KLMAX", "1", "is not a logprob threshold"),
    ],
)
def test_a_bad_logprob_variable_is_one_line_naming_it(var, raw, says):
    with pytest.raises(UsageError) as e:
        logprob_env_thresholds({var: raw})
    msg = str(e.value)
    assert var in msg and says in msg and "\n" not in msg


def test_the_cli_refuses_a_bad_variable_and_a_flag_wins_over_a_sound_one(tmp_path):
    a = synth_dump(tmp_path / "a", layers=2)
    b = synth_dump(tmp_path / "b", layers=2, bump=(1, 3))  # one token of layer 1 far off
    r = run_cli("comparator", a, b, "--quiet", env={"DRIFTSCOPE_DIFF_THRESHOLD": "nan"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "DRIFTSCOPE_DIFF_THRESHOLD" in r.stderr, r.stderr
    loose = {"DRIFTSCOPE_DIFF_THRESHOLD": "1e300", "DRIFTSCOPE_TOKEN_THRESHOLD": "1e300"}
    assert run_cli("comparator", a, b, "--quiet", env=loose).returncode == 0  # the env loosens both
    r = run_cli("comparator", a, b, "--quiet", "--token-threshold", "1e-3", env=loose)
    assert r.returncode == 1 and r.stdout.startswith("DIVERGED"), r.stdout + r.stderr  # the flag wins
    shutil.rmtree(b)
