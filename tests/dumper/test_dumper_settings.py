"""dumper.settings: each variable it documents, parsed from a given environment; a bad value is one line."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from dumper.errors import UsageError
from dumper.settings import EnvSettings, env_settings
from tests.conftest import run_cli
from tests.storeutil import synth_dump


def test_an_empty_environment_gives_the_defaults():
    assert env_settings({}) == EnvSettings(dump_dir=None, debug=False, json_memory_mib=None)


def test_it_holds_the_dumper_and_shared_variables_only():
    """The comparator's thresholds are read by comparator.settings, not here."""
    assert {f.name for f in dataclasses.fields(EnvSettings)} == {"dump_dir", "debug", "json_memory_mib", "vllm_spool"}
    s = env_settings({"DRIFTSCOPE_DIFF_THRESHOLD": "nan", "DRIFTSCOPE_LOGPROB_KL_MAX": "abc"})
    assert s == EnvSettings()  # not read, so not refused either


@pytest.mark.parametrize(("raw", "expected"), [("/data/dumps", "/data/dumps"), ("rel/dir", "rel/dir"), ("", None)])
def test_dump_dir(raw, expected):
    assert env_settings({"DRIFTSCOPE_DUMP_DIR": raw}).dump_dir == expected


@pytest.mark.parametrize(("raw", "expected"), [("/tmp/ds-spool", "/tmp/ds-spool"), ("", None)])
def test_vllm_spool(raw, expected):
    assert env_settings({"DRIFTSCOPE_VLLM_SPOOL": raw}).vllm_spool == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("no", False),
        ("", False),
    ],
)
def test_debug(raw, expected):
    assert env_settings({"DRIFTSCOPE_DEBUG": raw}).debug is expected


@pytest.mark.parametrize(("raw", "expected"), [("432", 432), (" 64 ", 64), ("1", 1), ("", None), ("  ", None)])
def test_json_memory_mib(raw, expected):
    assert env_settings({"DRIFTSCOPE_JSON_MEMORY_MIB": raw}).json_memory_mib == expected


@pytest.mark.parametrize("raw", ["0", "-5", "1.5", "abc", "1e3", "64MiB"])
def test_a_bad_json_memory_mib_is_one_line_naming_the_variable(raw):
    with pytest.raises(UsageError) as e:
        env_settings({"DRIFTSCOPE_JSON_MEMORY_MIB": raw})
    msg = str(e.value)
    assert msg.startswith("DRIFTSCOPE_JSON_MEMORY_MIB=") and repr(raw.strip()) in msg and "\n" not in msg


def test_os_environ_is_read_by_default(monkeypatch):
    monkeypatch.setenv("DRIFTSCOPE_DUMP_DIR", "/from/the/env")
    monkeypatch.setenv("DRIFTSCOPE_JSON_MEMORY_MIB", "7")
    monkeypatch.delenv("DRIFTSCOPE_DEBUG", raising=False)
    assert env_settings() == EnvSettings(dump_dir="/from/the/env", debug=False, json_memory_mib=7)


def test_both_clis_refuse_a_bad_shared_variable_in_one_line(tmp_path):
    """DRIFTSCOPE_JSON_MEMORY_MIB is read when a manifest is read, by the dumper and the comparator alike."""
    a = synth_dump(tmp_path / "a", layers=1)
    b = shutil.copytree(a, tmp_path / "b")
    env = {"DRIFTSCOPE_JSON_MEMORY_MIB": "lots"}
    for r in (run_cli("dumper", "ls", a, env=env), run_cli("comparator", a, b, "--quiet", env=env)):
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.count("\n") == 1 and "DRIFTSCOPE_JSON_MEMORY_MIB='lots'" in r.stderr, r.stderr
    assert run_cli("dumper", "ls", a, env={"DRIFTSCOPE_JSON_MEMORY_MIB": "64"}).returncode == 0
