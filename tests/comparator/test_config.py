"""CompareConfig: a flag beats its env var, which beats the default; bad values are one-line UsageErrors."""

from __future__ import annotations

import json
import math

import pytest
import torch

import dumper
from comparator.config import DEFAULT_THRESHOLD, DEFAULT_TOKEN_THRESHOLD, MAX_THREADS, CompareConfig
from dumper.errors import UsageError

ENV = {"DRIFTSCOPE_DIFF_THRESHOLD": "0.25", "DRIFTSCOPE_TOKEN_THRESHOLD": "0.5"}


def test_defaults_without_flags_or_env():
    c = CompareConfig.resolve(env={})
    assert (c.threshold, c.token_threshold, c.threads, c.fixed_explicit) == (
        DEFAULT_THRESHOLD,
        DEFAULT_TOKEN_THRESHOLD,
        2,
        False,
    )


def test_env_beats_default_and_flag_beats_env_for_each_threshold():
    c = CompareConfig.resolve(env=ENV)
    assert (c.threshold, c.token_threshold, c.fixed_explicit) == (0.25, 0.5, True)
    c = CompareConfig.resolve(threshold=0.125, env=ENV)
    assert (c.threshold, c.token_threshold) == (0.125, 0.5)
    c = CompareConfig.resolve(token_threshold=0.0, env=ENV)  # 0 is a value, not "unset"
    assert (c.threshold, c.token_threshold) == (0.25, 0.0)
    c = CompareConfig.resolve(token_threshold=0.75, env={"DRIFTSCOPE_DIFF_THRESHOLD": "1e-2"})
    assert (c.threshold, c.token_threshold, c.fixed_explicit) == (1e-2, 0.75, True)


def test_a_flag_alone_marks_the_thresholds_explicit():
    assert CompareConfig.resolve(threshold=1e-3, env={}).fixed_explicit
    assert not CompareConfig.resolve(threads=4, env={}).fixed_explicit


def test_blank_env_values_are_unset():
    c = CompareConfig.resolve(env={"DRIFTSCOPE_DIFF_THRESHOLD": "", "DRIFTSCOPE_TOKEN_THRESHOLD": "  "})
    assert (c.threshold, c.token_threshold, c.fixed_explicit) == (DEFAULT_THRESHOLD, DEFAULT_TOKEN_THRESHOLD, False)


def test_os_environ_is_read_when_no_env_is_given(monkeypatch):
    monkeypatch.setenv("DRIFTSCOPE_DIFF_THRESHOLD", "0.03")
    monkeypatch.delenv("DRIFTSCOPE_TOKEN_THRESHOLD", raising=False)
    c = CompareConfig.resolve()
    assert (c.threshold, c.token_threshold) == (0.03, DEFAULT_TOKEN_THRESHOLD)


@pytest.mark.parametrize("var", ["DRIFTSCOPE_DIFF_THRESHOLD", "DRIFTSCOPE_TOKEN_THRESHOLD"])
@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "1e-3x"])
def test_a_bad_env_value_is_a_one_line_usage_error_naming_the_variable(var, value):
    with pytest.raises(UsageError) as e:
        CompareConfig.resolve(env={var: value})
    assert str(e.value).startswith(f"{var}: ") and "\n" not in str(e.value)


def test_a_bad_env_value_is_refused_even_when_a_flag_overrides_it():
    with pytest.raises(UsageError, match="DRIFTSCOPE_DIFF_THRESHOLD"):
        CompareConfig.resolve(threshold=0.1, env={"DRIFTSCOPE_DIFF_THRESHOLD": "oops"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": math.nan}, "threshold must be a finite number >= 0"),
        ({"token_threshold": -1.0}, "token_threshold must be a finite number >= 0"),
        ({"threshold": math.inf}, "threshold must be a finite number >= 0"),
        ({"threads": 0}, f"threads must be between 1 and {MAX_THREADS}"),
        ({"threads": MAX_THREADS + 1}, f"threads must be between 1 and {MAX_THREADS}"),
        ({"noise_floor": -1e-9}, "noise_floor must be a finite number >= 0"),
    ],
)
def test_bad_values_are_refused_when_the_config_is_made(kwargs, message):
    with pytest.raises(UsageError, match=message):
        CompareConfig(**kwargs)


def test_the_cli_follows_the_same_precedence(tmp_path, cli):
    for side in ("a", "b"):
        with dumper.capture(None, tmp_path / side):
            dumper.dump("t", torch.ones(3, 4))
    env = {"DRIFTSCOPE_DIFF_THRESHOLD": "0.25", "DRIFTSCOPE_TOKEN_THRESHOLD": "0.5"}
    out = cli("comparator", tmp_path / "a", tmp_path / "b", "--threshold", "0.125", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["threshold"], report["token_threshold"]) == (0.125, 0.5)
    bad = cli("comparator", tmp_path / "a", tmp_path / "b", env={"DRIFTSCOPE_TOKEN_THRESHOLD": "nan"})
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "DRIFTSCOPE_TOKEN_THRESHOLD" in bad.stderr
