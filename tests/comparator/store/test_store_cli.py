"""``python -m comparator regress`` / ``store`` as CI runs them: real subprocesses, concurrent and killed writers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comparator.store import RunStatus, RunStore
from tests.conftest import run_cli, subprocess_env
from tests.storeutil import OTHER_GPU, edited_copy, synth_dump


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    return {"a": synth_dump(root / "a"), "a2": synth_dump(root / "a2"), "bad": synth_dump(root / "bad", bump=(2, 7))}


def popen_regress(run_dir: Path, store: Path, *args: str) -> subprocess.Popen[str]:
    env = subprocess_env()
    return subprocess.Popen(
        [sys.executable, "-m", "comparator", "regress", str(run_dir), "--store", str(store), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_regress_and_store_commands(dumps, tmp_path):
    store = tmp_path / "store"
    r = run_cli("comparator", "regress", dumps["a"], "--store", store)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--bootstrap" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    r = run_cli("comparator", "regress", dumps["a"], "--store", store, "--bootstrap")
    assert r.returncode == 0 and "BOOTSTRAP" in r.stdout, r.stdout + r.stderr
    base = RunStore(store).runs()[0].name
    r = run_cli("comparator", "regress", dumps["bad"], "--store", store, "--json", tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FIRST DIVERGENCE" in r.stdout and "DIVERGED at layer 2" in r.stdout and f"stays {base}" in r.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["label"] == "failed" and res["baseline_run"] == base and res["exit_code"] == 1
    assert res["report"]["first_divergent"]["token"] == 7
    failed = res["run_id"]
    r = run_cli("comparator", "regress", dumps["a2"], "--store", store, "--quiet", "--threshold", "1e-6")
    assert r.returncode == 0 and "PASS" in r.stdout and "layer" not in r.stdout, r.stdout + r.stderr
    r = run_cli("comparator", "store", "ls", store)
    assert r.returncode == 0, r.stderr
    assert base in r.stdout and failed in r.stdout and "FAIL at layer 2, token 7" in r.stdout
    assert "passed (current)" in r.stdout and "3 runs shown" in r.stdout
    r = run_cli("comparator", "store", "ls", store, "--label", "failed")
    assert failed in r.stdout and r.stdout.count(base) == 1 and "1 runs shown" in r.stdout  # base: as baseline only
    r = run_cli("comparator", "store", "show", store, failed)
    assert r.returncode == 0 and '"pass_label": "failed"' in r.stdout and "dump: 3 tensors" in r.stdout
    r = run_cli("comparator", "store", "promote", store, failed)
    assert r.returncode == 0 and "baseline now (was failed)" in r.stdout
    assert RunStore(store).get(failed).label == "baseline"
    r = run_cli("comparator", "store", "prune", store, "--keep", "1")
    assert r.returncode == 0 and "deleted 2 entries" in r.stdout, r.stdout + r.stderr
    for args in (
        ("show", store, "20261130T000000.000000000Z-abcdef"),
        ("ls", tmp_path / "nothing"),
        ("prune", store),
        ("promote", store, "../x"),
    ):
        r = run_cli("comparator", "store", *args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, args


def test_env_mismatch_from_the_cli(dumps, tmp_path):
    store = tmp_path / "store"
    assert run_cli("comparator", "regress", dumps["a"], "--store", store, "--bootstrap").returncode == 0
    gpu = edited_copy(dumps["a"], tmp_path / "gpu", environment=OTHER_GPU)
    r = run_cli("comparator", "regress", gpu, "--store", store)
    assert r.returncode == 2 and "device_name" in r.stderr and "--allow-env-mismatch" in r.stderr
    r = run_cli("comparator", "regress", gpu, "--store", store, "--allow-env-mismatch", "--quiet")
    assert r.returncode == 0 and "across environments" in r.stdout, r.stdout + r.stderr


def test_two_concurrent_writers_both_land_whole(dumps, tmp_path):
    store = tmp_path / "store"
    assert run_cli("comparator", "regress", dumps["a"], "--store", store, "--bootstrap").returncode == 0
    procs = [popen_regress(dumps["a2"], store, "--quiet"), popen_regress(dumps["bad"], store, "--quiet")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 1], outs
    entries = RunStore(store).runs()
    assert [e.status for e in entries] == [RunStatus.COMPLETE] * 3
    assert sorted(e.record.label for e in entries) == ["baseline", "failed", "passed"]
    for e in entries:
        assert (store / "runs" / e.name / "run.json").is_file() and (store / "runs" / e.name / "COMPLETE").is_file()
    assert not [n for n in os.listdir(store / "runs") if n.startswith(".")]


def test_sigkilled_writer_leaves_no_complete_run(tmp_path):
    big = synth_dump(tmp_path / "big", layers=1, rows=256, hidden=1024, passes=64)  # 64 files of 1 MiB
    store = tmp_path / "store"
    proc = popen_regress(big, store, "--bootstrap")
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        staging = [
            n for n in (os.listdir(store / "runs") if (store / "runs").is_dir() else []) if n.startswith(".tmp-")
        ]
        if staging and os.listdir(store / "runs" / staging[0]):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the upload finished before it could be killed"
    entries = RunStore(store).runs()
    assert not [e for e in entries if e.complete]
    assert [e.status for e in entries] == [RunStatus.STAGING]
    r = run_cli("comparator", "store", "ls", store)
    assert "STAGING" in r.stdout and "0 runs shown" in r.stdout
    r = run_cli("comparator", "regress", big, "--store", store)  # the dead writer left no baseline
    assert r.returncode == 2 and "no comparable baseline" in r.stderr
    r = run_cli("comparator", "regress", big, "--store", store, "--bootstrap")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [e.status for e in RunStore(store).runs()] == [RunStatus.STAGING, RunStatus.COMPLETE]
    r = run_cli("comparator", "store", "prune", store, "--keep", "1")  # a young staging folder may be running
    assert r.returncode == 0 and "younger than" in r.stderr
    assert RunStore(store).prune(1, grace_s=0).deleted[0].startswith(".tmp-")
    assert [e.status for e in RunStore(store).runs()] == [RunStatus.COMPLETE]
