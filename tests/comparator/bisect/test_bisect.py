"""``python -m comparator bisect``: real runs of real builds, each dump judged against a golden baseline.

The builds are folders on ``PYTHONPATH`` whose start-up seeds a bug into transformers' Llama
(:mod:`tests.bisect_ladder`): clean before build k, layer 2 perturbed at token 20 from k on, and
some that cannot start at all. Every run is a real ``python -m dumper run`` of the tiny-llama
preset in a subprocess the bisection starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from comparator.bisect.search import run_bound
from tests.bisect_ladder import PROMPT, dump_command, ladder, make_build
from tests.conftest import ROOT, run_cli, subprocess_env

pytestmark = pytest.mark.slow

LAYER, TOKEN = 2, 20


@pytest.fixture(scope="module")
def gold(tmp_path_factory):
    """The golden baseline: the tiny-llama preset dumped without any build on the path."""
    root = tmp_path_factory.mktemp("bisect-gold")
    r = run_cli(
        "dumper",
        "run",
        "--model",
        "tiny-llama",
        "--layers",
        "all",
        "--input-ids",
        PROMPT,
        "--out",
        root / "gold",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    return root / "gold"


def _builds_file(path, builds) -> str:
    path.write_text("# oldest first\n" + "\n".join(builds) + "\n\n")
    return str(path)


def _bisect(gold, tmp_path, builds, *extra, run=None):
    r = run_cli(
        "comparator",
        "bisect",
        gold,
        "--builds",
        _builds_file(tmp_path / "builds.txt", builds),
        "--run",
        run or dump_command(),
        "--work",
        tmp_path / "work",
        "--json",
        tmp_path / "out.json",
        *extra,
    )
    result = json.loads((tmp_path / "out.json").read_text()) if r.returncode == 0 else None
    return r, result


def test_a_ladder_with_a_broken_build_names_the_first_bad_one_within_the_bound(gold, tmp_path):
    n, bad_from, broken = 16, 11, 7  # 7 is the first middle build tried: a skip, never good or bad
    builds = ladder(tmp_path / "builds", n, bad_from=bad_from, broken=(broken,), layer=LAYER, token=TOKEN)
    r, result = _bisect(gold, tmp_path, builds)
    assert r.returncode == 0, r.stderr
    assert result["first_bad"] == builds[bad_from] and result["last_good"] == builds[bad_from - 1], result
    tested = {t["index"]: t for t in result["tested"]}
    assert tested[broken]["outcome"] == "skip" and tested[broken]["exit_code"] == 1
    assert "cannot start (ImportError: libdriftscope_7.so)" in tested[broken]["headline"]
    assert result["runs"] <= run_bound(n) + result["skipped"] and result["bound"] == run_bound(n) == 6
    fd = tested[bad_from]["first_divergent"]
    assert (fd["layer"], fd["token"]) == (LAYER + 1, TOKEN)  # layer 2's output is what enters layer 3
    assert result["verdict"]["first_divergent"]["layer"] == LAYER + 1 and not result["verdict"]["passed"]
    assert all(t["outcome"] == ("bad" if i >= bad_from else "good") for i, t in tested.items() if i != broken)
    assert f"first bad build: {builds[bad_from]!r} (line {bad_from + 1})" in r.stdout
    assert r.stderr.count("bisect run ") == result["runs"] and "at most 0 runs left" in r.stderr


def test_skips_next_to_the_first_bad_build_leave_candidates(gold, tmp_path):
    builds = ladder(tmp_path / "builds", 6, bad_from=4, broken=(2, 3))
    r, result = _bisect(gold, tmp_path, builds)
    assert r.returncode == 0, r.stderr
    assert result["first_bad"] is None and result["candidates"] == builds[2:5] and result["last_good"] == builds[1]
    assert "skipped builds hide which" in r.stdout


@pytest.mark.parametrize(
    "seeds,which",
    [
        ([{"layer": 2, "token": 20}, {}], "first build"),
        ([{}, {}], "last build"),
        ([{"broken": "no such venv"}, {"layer": 2, "token": 20}], "first build"),
    ],
)
def test_endpoints_that_do_not_hold_are_exit_2_naming_which(gold, tmp_path, seeds, which):
    builds = [str(make_build(tmp_path / f"b{i}", s)) for i, s in enumerate(seeds)]
    r, _ = _bisect(gold, tmp_path, builds, "--quiet")
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and f"the {which} " in line and "(line " in line, line


def test_resume_after_a_kill_does_not_rerun_finished_builds(gold, tmp_path):
    builds = ladder(tmp_path / "builds", 9, bad_from=6)
    ran = tmp_path / "ran.log"
    run = f"echo {{build}} >> {ran} && " + dump_command()
    args = [
        sys.executable,
        "-m",
        "comparator",
        "bisect",
        str(gold),
        "--builds",
        _builds_file(tmp_path / "builds.txt", builds),
        "--run",
        run,
        "--work",
        str(tmp_path / "work"),
    ]
    proc = subprocess.Popen(
        args,
        env=subprocess_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    state = tmp_path / "work" / "bisect.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill it while its third build runs, after two were judged
        judged = len(json.loads(state.read_text())["tested"]) if state.is_file() else 0
        if judged >= 2 and ran.is_file() and len(ran.read_text().splitlines()) == 3:
            break
        assert proc.poll() is None, "the bisection ended before it could be interrupted"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = ran.read_text().splitlines()
    r = run_cli(
        "comparator",
        "bisect",
        gold,
        "--builds",
        tmp_path / "builds.txt",
        "--run",
        run,
        "--work",
        tmp_path / "work",
        "--resume",
        "--json",
        tmp_path / "out.json",
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["first_bad"] == builds[6]
    lines = ran.read_text().splitlines()
    assert lines[:3] == before and before[:2] == [builds[0], builds[-1]]
    assert not set(lines[3:]) & set(before[:2]), lines  # the two judged before the kill never ran again
    assert len(lines) == len(set(lines)) + 1 and lines.count(before[2]) == 2  # the one in flight ran again
    again = run_cli(
        "comparator", "bisect", gold, "--builds", tmp_path / "builds.txt", "--run", run, "--work", tmp_path / "work"
    )
    assert again.returncode == 2 and "--resume" in again.stderr  # a finished bisection is never overwritten


def test_a_settings_ladder_finds_the_first_chunk_size_that_breaks_it(gold, tmp_path):
    """Bisection over engine settings: the same loop, each line a setting the command takes."""
    build = make_build(tmp_path / "chunk-bug", {"chunked": LAYER})
    sizes = ["64", "48", "40", "39", "32", "16", "8"]  # the prompt has 40 tokens: from 39 on it is cut
    run = (
        f"PYTHONPATH={build}${{PYTHONPATH:+:$PYTHONPATH}} {sys.executable} -m dumper run --model tiny-llama "
        f"--layers all --input-ids {PROMPT} --out {{out}} --quiet --chunk-size {{build}}"
    )
    r, result = _bisect(gold, tmp_path, sizes, run=run)
    assert r.returncode == 0, r.stderr
    assert result["first_bad"] == "39" and result["last_good"] == "40"


def test_git_bisect_exit_codes(gold, tmp_path):
    bug = make_build(tmp_path / "bug", {"layer": LAYER, "token": TOKEN})
    for name, path in (("good", ""), ("bad", str(bug))):
        r = run_cli(
            "dumper",
            "run",
            "--model",
            "tiny-llama",
            "--layers",
            "all",
            "--input-ids",
            PROMPT,
            "--out",
            tmp_path / name,
            "--quiet",
            env={"PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p)},
        )
        assert r.returncode == 0, r.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{not json")
    codes = {
        name: run_cli("comparator", gold, tmp_path / name, "--git-bisect", "--quiet").returncode
        for name in ("good", "bad", "missing", "broken")
    }
    assert codes == {"good": 0, "bad": 1, "missing": 125, "broken": 125}, codes
    r = run_cli("comparator", tmp_path / "missing", tmp_path / "good", "--git-bisect")  # no commit's fault: stop
    assert r.returncode == 128 and "git bisect: stopping" in r.stderr, r.stderr
    r = run_cli("comparator", gold, tmp_path / "good", "--git-bisect", "--threshold", "-1")
    assert r.returncode == 128, r.stderr


def test_regress_git_bisect_stores_bisect_runs_that_never_become_baselines(gold, tmp_path):
    store = tmp_path / "store"
    r = run_cli("comparator", "regress", gold, "--store", store, "--bootstrap", "--quiet")
    assert r.returncode == 0, r.stderr
    bug = make_build(tmp_path / "bug", {"layer": LAYER, "token": TOKEN})
    env = {"PYTHONPATH": os.pathsep.join((str(bug), str(ROOT)))}
    r = run_cli(
        "dumper",
        "run",
        "--model",
        "tiny-llama",
        "--layers",
        "all",
        "--input-ids",
        PROMPT,
        "--out",
        tmp_path / "bad",
        "--quiet",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    codes = [
        run_cli("comparator", "regress", d, "--store", store, "--git-bisect", "--build", label, "--quiet").returncode
        for d, label in (
            (gold, "good-commit"),
            (tmp_path / "bad", "bad-commit"),
            (tmp_path / "nothing", "broken-commit"),
        )
    ]
    assert codes == [0, 1, 125], codes
    ls = run_cli("comparator", "store", "ls", store, "--label", "bisect")
    assert (
        ls.returncode == 0 and "good-commit" in ls.stdout and "bad-commit" in ls.stdout and "2 runs shown" in ls.stdout
    )
    # a later regress is judged against the bootstrapped baseline, never against a bisect run
    r = run_cli("comparator", "regress", tmp_path / "bad", "--store", store, "--json", tmp_path / "r.json", "--quiet")
    baseline = json.loads((tmp_path / "r.json").read_text())["baseline_run"]
    shown = run_cli("comparator", "store", "show", store, baseline)
    assert r.returncode == 1 and '"pass_label": "baseline"' in shown.stdout, shown.stdout


def test_bisect_against_a_store_records_every_judged_build(gold, tmp_path):
    store = tmp_path / "store"
    assert run_cli("comparator", "regress", gold, "--store", store, "--bootstrap", "--quiet").returncode == 0
    builds = ladder(tmp_path / "builds", 4, bad_from=2)
    r = run_cli(
        "comparator",
        "bisect",
        "--store",
        store,
        "--builds",
        _builds_file(tmp_path / "b.txt", builds),
        "--run",
        dump_command(),
        "--work",
        tmp_path / "work",
        "--json",
        tmp_path / "out.json",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["first_bad"] == builds[2]
    ls = run_cli("comparator", "store", "ls", store, "--label", "bisect")
    assert f"{result['runs']} runs shown" in ls.stdout and all(t["run_id"] in ls.stdout for t in result["tested"])
