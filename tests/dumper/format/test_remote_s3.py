"""Dumps and the run store on a real S3 API server (moto's server mode on 127.0.0.1, :mod:`tests.s3_server`),
through the CLIs in subprocesses, with s3fs and ``AWS_ENDPOINT_URL`` as a user would have them.

A dump written to ``s3://`` and compared from there passes against the same dump written
locally; a writer killed before its manifest leaves nothing a reader takes for a dump; a hostile
manifest on the server is refused as its local twin is; the run store bootstraps, regresses and
lists on the server.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dumper.format import MANIFEST_NAME
from tests.conftest import ROOT, run_cli, subprocess_env
from tests.s3_server import make_bucket, s3_server, s3fs_of

pytestmark = pytest.mark.slow

PROMPT = "--input-ids", "1,5,9,22,40,7,8,9,10,11,12,13"


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env, make_bucket(env, "driftscope")


def _dump(out, env=None):
    r = run_cli("dumper", "run", "--layers", "all", *PROMPT, "--out", out, "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    return r


def test_a_dump_written_to_s3_compares_as_the_one_written_locally(s3, tmp_path):
    env, bucket = s3
    _dump(f"{bucket}/runs/a", env)
    _dump(tmp_path / "local")
    names = {p.rsplit("/", 1)[-1] for p in s3fs_of(env).ls("driftscope/runs/a")}
    assert MANIFEST_NAME in names and any(n.endswith(".safetensors") for n in names)
    for base, target in ((tmp_path / "local", f"{bucket}/runs/a"), (f"{bucket}/runs/a", tmp_path / "local")):
        r = run_cli("comparator", base, target, "--json", tmp_path / "r.json", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads((tmp_path / "r.json").read_text())
        assert report["passed"] and report["matched"] > 0
        assert max(t["rel_diff"] for t in report["tensors"]) == 0.0  # the same run, byte for byte
    r = run_cli("dumper", "run", "--layers", "all", *PROMPT, "--out", f"{bucket}/runs/a", "--quiet", env=env)
    assert r.returncode == 2 and "already holds a complete dump" in r.stderr  # nothing stored is lost


_KILLED_WRITER = """
import os, sys
import dumper.format.remote as remote
real = remote.url_fs
def dying(url):
    fs, root = real(url)
    opened = fs.open
    def open_(path, mode="rb", **kw):
        if mode == "wb" and path.endswith("/manifest.json"):
            os._exit(9)  # killed after its data files, before its manifest
        return opened(path, mode, **kw)
    fs.open = open_
    return fs, root
remote.url_fs = dying
from dumper.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_writer_killed_before_its_manifest_leaves_no_dump(s3, tmp_path):
    env, bucket = s3
    url = f"{bucket}/runs/killed"
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, "run", "--layers", "all", *PROMPT, "--out", url, "--quiet"],
        env=subprocess_env(**env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 9, r.stderr
    names = {p.rsplit("/", 1)[-1] for p in s3fs_of(env).ls("driftscope/runs/killed")}
    assert names and MANIFEST_NAME not in names  # its data files got there, its manifest never did
    _dump(tmp_path / "local")
    r = run_cli("comparator", tmp_path / "local", url, env=env)
    assert r.returncode == 2 and "not a complete dump" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("lie,words", [("outside", "plain"), ("size", "longer than the")])
def test_a_hostile_manifest_on_the_server_is_refused_as_its_local_twin(s3, tmp_path, lie, words):
    env, bucket = s3
    url = f"{bucket}/runs/hostile-{lie}"
    _dump(url, env)
    fs = s3fs_of(env)
    key = url.removeprefix("s3://")
    raw = json.loads(fs.cat_file(f"{key}/{MANIFEST_NAME}"))
    name = sorted(raw["files"])[0]
    if lie == "outside":  # an entry that points outside the dump's prefix
        raw["files"][f"../a/{name}"] = raw["files"].pop(name)
    else:  # the file is longer than the manifest says
        fs.pipe_file(f"{key}/{name}", fs.cat_file(f"{key}/{name}") + b"\0" * 128)
    fs.pipe_file(f"{key}/{MANIFEST_NAME}", json.dumps(raw).encode())
    _dump(tmp_path / "local")
    r = run_cli("comparator", tmp_path / "local", url, env=env)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_run_store_bootstraps_regresses_and_lists_on_the_server(s3, tmp_path):
    env, bucket = s3
    store = f"{bucket}/store"
    _dump(tmp_path / "base")
    _dump(f"{bucket}/runs/nightly", env)
    r = run_cli("comparator", "regress", tmp_path / "base", "--store", store, "--bootstrap", "--quiet", env=env)
    assert r.returncode == 0 and "BOOTSTRAP" in r.stdout, r.stdout + r.stderr
    r = run_cli("comparator", "regress", f"{bucket}/runs/nightly", "--store", store, "--quiet", env=env)
    assert r.returncode == 0 and "PASS: stored run" in r.stdout, r.stdout + r.stderr
    ls = run_cli("comparator", "store", "ls", store, env=env)
    assert ls.returncode == 0 and "2 runs shown" in ls.stdout and "passed" in ls.stdout, ls.stdout
    assert "testing" not in ls.stdout + ls.stderr  # credentials are never printed


def test_the_comparator_reads_s3_dumps_by_ranges_with_no_local_copy(s3, tmp_path):
    env, bucket = s3
    _dump(tmp_path / "a")
    r = run_cli("dumper", "run", "--layers", "all", *PROMPT, "--chunk-size", "5", "--out", tmp_path / "b", "--quiet")
    assert r.returncode == 0, r.stderr
    fs = s3fs_of(env)
    for name in ("a", "b"):
        fs.put(str(tmp_path / name), f"driftscope/ranged/{name}", recursive=True)
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    r = run_cli(
        "comparator",
        f"{bucket}/ranged/a",
        f"{bucket}/ranged/b",
        "--json",
        tmp_path / "s3.json",
        env={**env, "TMPDIR": str(tmp)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list(tmp.glob("driftscope-remote-*"))  # read in place: nothing fetched to disk
    r = run_cli("comparator", tmp_path / "a", tmp_path / "b", "--json", tmp_path / "local.json")
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("s3", "local"))
    assert got["baseline"] == f"{bucket}/ranged/a" and got["matched"] == want["matched"] > 0
    assert [t["rel_diff"] for t in got["tensors"]] == [t["rel_diff"] for t in want["tensors"]]
    assert any(t["rel_diff"] > 0 for t in want["tensors"])  # chunked against one pass: a real comparison
