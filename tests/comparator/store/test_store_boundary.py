"""The run store's trust boundary: hostile paths, odd entries and bad records, one test per class.

Every store here holds real runs (real dumps from the dumper, stored by a real ``regress``). A
hostile entry is usually a *clone* of a sound run under a newer run id: if the store trusted it,
``regress`` would pick it as the baseline, so "the previous run is still the baseline" shows that
it was skipped. Reads are watched with an audit hook: nothing under ``outside/`` may be opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest

from comparator import regress
from comparator.cli.main import main
from comparator.results import MAX_REPORT_BYTES, load_report
from comparator.store import RunStatus, RunStore, StoreError
from comparator.store.backend import LocalBackend
from comparator.store.errors import CorruptRunError, UnsafePathError
from comparator.store.fsspec_backend import FsspecBackend
from comparator.store.record import RunRecord
from comparator.store.runid import new_run_id
from dumper.errors import EXIT_OK, UsageError
from dumper.format import MANIFEST_NAME, load_manifest
from tests.conftest import run_cli, subprocess_env
from tests.storeutil import synth_dump

# -- helpers (also used by test_fuzz_store.py) ---------------------------------------------------
_WATCHED: list[tuple[str, list[str]]] = []
_IN_HOOK = threading.local()


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _WATCHED or getattr(_IN_HOOK, "on", False):
        return
    path = args[0] if args else None
    if not isinstance(path, (str, bytes, os.PathLike)):
        return  # an open file descriptor
    _IN_HOOK.on = True
    try:
        real = os.path.realpath(os.fsdecode(path))
        for top, hits in _WATCHED:
            if real == top or real.startswith(top + os.sep):
                hits.append(real)
    finally:
        _IN_HOOK.on = False


sys.addaudithook(_audit)


@contextlib.contextmanager
def opens_under(folder: Path) -> Iterator[list[str]]:
    """Record every file opened (by real path, symlinks resolved) under ``folder`` while inside."""
    hits: list[str] = []
    item = (os.path.realpath(folder), hits)
    _WATCHED.append(item)
    try:
        yield hits
    finally:
        _WATCHED.remove(item)


class Hang(BaseException):
    """Raised by :func:`no_hang`; not an ``OSError`` (as ``TimeoutError`` is), so no handler can swallow it."""


@contextlib.contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """Fail instead of blocking forever (opening a FIFO for reading blocks until a writer comes)."""

    def _raise(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s: something blocked (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def cli(*args: str | os.PathLike[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """:func:`tests.conftest.run_cli` for ``python -m comparator``, with a short timeout: a FIFO opened by
    mistake blocks the child forever, and the test must fail in a minute, not in ten."""
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, "-m", "comparator", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


def make_store(root: Path, a: Path, a2: Path) -> tuple[Path, str, str]:
    """A local store with a bootstrapped baseline and a run that passed against it."""
    store = root / "store"
    base = regress(a, store, bootstrap=True)
    passed = regress(a2, store)
    assert base.exit_code == EXIT_OK and passed.exit_code == EXIT_OK and passed.baseline_run == base.run_id
    return store, base.run_id, passed.run_id


def clone_run(store: Path, src: str) -> str:
    """A whole copy of run ``src`` under a newer run id: the run ``regress`` would pick, if it is sound."""
    new = new_run_id()[0]
    runs = store / "runs"
    shutil.copytree(runs / src, runs / new, symlinks=True)
    d = json.loads((runs / new / "run.json").read_text())
    (runs / new / "run.json").write_text(json.dumps({**d, "run_id": new}))
    (runs / new / "COMPLETE").write_text(f"{new}\n")
    return new


def become(path: Path, kind: str, outside: Path) -> None:
    """Replace ``path`` (a file or folder) by ``kind``: dir, fifo, file, symlink-out (to a copy of it), dangling."""
    copy = outside / f"{path.name}-{uuid.uuid4().hex[:6]}"
    if os.path.lexists(path):
        shutil.move(path, copy)  # a symlink moves as itself
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_bytes(b"not a folder")
    elif kind == "symlink-out":
        os.symlink(copy, path)
    elif kind == "dangling":
        os.symlink(outside / "nothing-here", path)
    elif kind == "socket":
        with contextlib.chdir(path.parent), socket.socket(socket.AF_UNIX) as s:
            s.bind(path.name)  # relative: a full tmp path can exceed the 108-byte socket path limit
    else:
        raise AssertionError(kind)


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    return {"a": synth_dump(root / "a"), "a2": synth_dump(root / "a2"), "a3": synth_dump(root / "a3")}


@pytest.fixture
def world(dumps, tmp_path):
    """A store with two sound runs, and an ``outside/`` folder that nothing may read."""
    store, base, passed = make_store(tmp_path, dumps["a"], dumps["a2"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("never read me")
    return {
        "store": store,
        "runs": store / "runs",
        "base": base,
        "passed": passed,
        "outside": outside,
        "run": dumps["a3"],
    }


def status_of(store: Path, name: str) -> tuple[RunStatus, str]:
    e = {e.name: e for e in RunStore(store).runs()}[name]
    return e.status, e.problem or ""


def regress_picks(world) -> str | None:
    """Run ``regress`` on a new sound run; the baseline it compared against."""
    r = regress(world["run"], world["store"])
    assert r.exit_code == EXIT_OK, r.message
    return r.baseline_run


# -- 2. containment: `..`, absolute paths and symlinks out, in each place -----------------------
BAD_RELS = ("../x", "../../outside/secret", "/etc/passwd", "runs/../../x", "", "runs//x", "runs/./x", "a\\b", "a\0b")


@pytest.mark.parametrize("rel", BAD_RELS)
def test_store_paths_that_leave_the_root_are_refused_by_both_backends(rel, tmp_path):
    local = LocalBackend(tmp_path / "store", str(tmp_path / "store"))
    mem = FsspecBackend(fsspec.filesystem("memory"), f"/boundary-{uuid.uuid4().hex[:8]}", "memory://boundary")
    for backend in (local, mem):
        with pytest.raises(UnsafePathError, match="refusing path"):
            backend.read_bytes(rel)
        with pytest.raises(UnsafePathError):
            backend.write_bytes(rel, b"x")
        with pytest.raises(UnsafePathError):
            backend.remove_tree(rel)
    assert not (tmp_path / "x").exists() and not (tmp_path / "store").exists()


def test_run_folder_symlinked_out_is_skipped_never_followed(world):
    # outside/ holds a sound copy of a run: followed, it would be the newest baseline
    new = clone_run(world["store"], world["passed"])
    become(world["runs"] / new, "symlink-out", world["outside"])
    with opens_under(world["outside"]) as opened:
        status, problem = status_of(world["store"], new)
        assert status is RunStatus.CORRUPT and new in problem and "symlink" in problem
        assert regress_picks(world) == world["passed"]
        with pytest.raises(CorruptRunError, match="symlink"):
            RunStore(world["store"]).get(new)
        res = RunStore(world["store"]).prune(0)
        assert new not in res.deleted and any(new in s for s in res.skipped)
    assert opened == []
    assert (world["runs"] / new).is_symlink() and (world["runs"] / new / "run.json").is_file()  # left as it was


def test_runs_folder_symlinked_out_is_refused(world, capsys):
    become(world["runs"], "symlink-out", world["outside"])
    with opens_under(world["outside"]) as opened:
        assert main(["store", "ls", str(world["store"])]) == 2
        assert main(["regress", str(world["run"]), "--store", str(world["store"]), "--bootstrap"]) == 2
        r = run_cli("comparator", "store", "prune", world["store"], "--keep", "0")
    err = capsys.readouterr().err
    assert "outside the store" in err and "Traceback" not in err
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "outside the store" in r.stderr
    assert r.stderr.count("\n") == 1 and opened == []
    (copy,) = [p for p in world["outside"].iterdir() if p.name.startswith("runs-")]
    # nothing written (regress --bootstrap) or deleted (prune --keep 0) through the link
    assert sorted(p.name for p in copy.iterdir()) == sorted([world["base"], world["passed"]])


@pytest.mark.parametrize("name", ["run.json", "COMPLETE"])
def test_record_or_marker_symlinked_out_is_refused(world, name):
    new = clone_run(world["store"], world["passed"])
    become(world["runs"] / new / name, "symlink-out", world["outside"])  # same bytes, outside the store
    with opens_under(world["outside"]) as opened:
        status, problem = status_of(world["store"], new)
        assert regress_picks(world) == world["passed"]
    assert status is RunStatus.CORRUPT and f"{new}/{name}" in problem and "outside the store" in problem
    assert opened == []


def test_symlink_that_stays_inside_the_store_is_followed(world):
    """Only leaving the root is refused: a record kept elsewhere in the store is read."""
    new = clone_run(world["store"], world["passed"])
    (world["store"] / "records").mkdir()
    shutil.move(world["runs"] / new / "run.json", world["store"] / "records" / "r.json")
    os.symlink(world["store"] / "records" / "r.json", world["runs"] / new / "run.json")
    assert status_of(world["store"], new) == (RunStatus.COMPLETE, "")
    assert regress_picks(world) == new


def test_dump_folder_symlinked_out_is_refused(world, capsys):
    new = clone_run(world["store"], world["passed"])
    become(world["runs"] / new / "dump", "symlink-out", world["outside"])
    with opens_under(world["outside"]) as opened:
        status, problem = status_of(world["store"], new)
        assert status is RunStatus.CORRUPT and f"{new}/dump" in problem and "outside the store" in problem
        assert regress_picks(world) == world["passed"]
        with pytest.raises(UnsafePathError, match="outside the store"):
            with RunStore(world["store"]).local_dump(new):
                pass
        assert main(["store", "show", str(world["store"]), new]) == 2
    assert "outside the store" in capsys.readouterr().err
    assert opened == []


def test_dump_file_symlinked_out_is_refused_when_read_in_place(world, capsys):
    """A local store reads dumps in place: a data file linked out of the run folder is never opened."""
    new = clone_run(world["store"], world["passed"])
    dump = world["runs"] / new / "dump"
    (data,) = load_manifest(dump).files
    become(dump / data, "symlink-out", world["outside"])  # identical bytes: only containment can refuse it
    with opens_under(world["outside"]) as opened:
        assert status_of(world["store"], new)[0] is RunStatus.COMPLETE  # listings do not read manifests
        with pytest.raises(UnsafePathError, match=f"{data}: resolves to .*outside"):
            with RunStore(world["store"]).local_dump(new):
                pass
        assert main(["regress", str(world["run"]), "--store", str(world["store"]), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and data in err and "outside" in err and err.count("\n") == 1
    assert opened == []


@pytest.mark.parametrize("name", ["../../../outside/secret", "/etc/passwd", "sub/x.safetensors", ".", ""])
def test_manifest_names_leaving_the_dump_are_refused(world, name):
    new = clone_run(world["store"], world["passed"])
    mpath = world["runs"] / new / "dump" / MANIFEST_NAME
    m = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**m, "files": {**m["files"], name: 14}}))
    with opens_under(world["outside"]) as opened, opens_under(Path("/etc")) as etc:
        with pytest.raises(UnsafePathError, match="refusing file name"):
            with RunStore(world["store"]).local_dump(new):
                pass
    assert opened == [] and etc == []


@pytest.fixture
def memory_url():
    url = f"memory://boundary-{uuid.uuid4().hex[:8]}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.mark.parametrize("name", ["../../escaped", "/abs/escaped", "a/../../escaped"])
def test_remote_manifest_names_never_make_download_leave_its_folder(dumps, tmp_path, memory_url, name):
    base = regress(dumps["a"], memory_url, bootstrap=True)
    fs, root = fsspec.core.url_to_fs(memory_url)
    mrel = f"{root}/runs/{base.run_id}/dump/{MANIFEST_NAME}"
    m = json.loads(fs.cat_file(mrel))
    fs.pipe_file(mrel, json.dumps({**m, "files": {name: 3, **m["files"]}}).encode())
    fs.pipe_file(f"{root}/escaped", b"abc")
    cache = tmp_path / "deep" / "cache"
    with pytest.raises(UnsafePathError, match="refusing file name"):
        regress(dumps["a2"], memory_url, cache_dir=cache)
    assert not list(tmp_path.rglob("escaped")) and not Path("/abs").exists()
    assert not cache.exists() or not any(cache.iterdir())  # no half-filled cache entry


def test_remote_download_is_bounded_by_the_declared_size(dumps, tmp_path, memory_url):
    base = regress(dumps["a"], memory_url, bootstrap=True)
    fs, root = fsspec.core.url_to_fs(memory_url)
    (data,) = load_manifest(dumps["a"]).files
    fs.pipe_file(f"{root}/runs/{base.run_id}/dump/{data}", b"\0" * (64 << 20))  # 64 MiB behind a small size
    with pytest.raises(StoreError, match=f"{data}: .* over the .* bytes"):
        regress(dumps["a2"], memory_url, cache_dir=tmp_path / "cache")
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) < 1 << 20


def test_put_refuses_manifest_names_leaving_the_dump(dumps, tmp_path):
    m = load_manifest(dumps["a"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("x")
    bad = replace(m, files={**m.files, "../outside/secret": 1})
    store = RunStore(tmp_path / "store")
    with opens_under(outside) as opened, pytest.raises(UnsafePathError, match="refusing file name"):
        store.put(dumps["a"], model="synth", label="baseline", manifest=bad)
    assert opened == [] and not (tmp_path / "store").exists()


# -- 2. robust listings: FIFOs, directories where files belong, files where folders belong ------
@pytest.mark.parametrize("kind", ["fifo", "file", "dangling", "socket"])
def test_run_folder_of_another_kind_is_reported_and_skipped(world, kind):
    new = clone_run(world["store"], world["passed"])
    become(world["runs"] / new, kind, world["outside"])
    with no_hang():
        status, problem = status_of(world["store"], new)
        assert regress_picks(world) == world["passed"]
        res = RunStore(world["store"]).prune(0, grace_s=0)
    assert status is RunStatus.CORRUPT and new in problem and "where a run folder belongs" in problem
    assert new not in res.deleted and os.path.lexists(world["runs"] / new)


@pytest.mark.parametrize("kind", ["fifo", "dir", "socket"])
@pytest.mark.parametrize("name", ["run.json", "COMPLETE"])
def test_record_or_marker_that_is_not_a_regular_file_is_never_opened(world, name, kind, capsys):
    new = clone_run(world["store"], world["passed"])
    become(world["runs"] / new / name, kind, world["outside"])
    with no_hang(), opens_under(world["runs"] / new / name) as opened:
        status, problem = status_of(world["store"], new)
        assert regress_picks(world) == world["passed"]
        assert main(["store", "show", str(world["store"]), new]) == 2
        assert main(["store", "promote", str(world["store"]), new]) == 2
        assert main(["store", "ls", str(world["store"])]) == 0
    assert status is RunStatus.CORRUPT and f"{new}/{name}" in problem and "where a file belongs" in problem
    assert opened == []
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: {problem}" in err


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_runs_folder_that_is_not_a_folder_is_one_line_exit_2(world, kind, capsys):
    become(world["runs"], kind, world["outside"])
    with no_hang():
        assert main(["store", "ls", str(world["store"])]) == 2
        assert main(["regress", str(world["run"]), "--store", str(world["store"])]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 2 and "runs: not a folder" in err and "Traceback" not in err


def test_prune_never_deletes_outside_or_through_a_symlink(world):
    outside = world["outside"]
    (outside / "keep").mkdir()
    (outside / "keep" / "data").write_text("precious")
    # an abandoned upload (old, no COMPLETE) whose dump is a symlink to a folder outside
    old = new_run_id(1_600_000_000_000_000_000)[0]
    (world["runs"] / old).mkdir()
    os.symlink(outside / "keep", world["runs"] / old / "dump")
    os.utime(world["runs"] / old, (1_600_000_000, 1_600_000_000), follow_symlinks=False)
    # a "staging folder" that is a symlink out
    os.symlink(outside / "keep", world["runs"] / f".tmp-{old}-0badc0de")
    assert status_of(world["store"], old)[0] is RunStatus.INCOMPLETE
    assert status_of(world["store"], f".tmp-{old}-0badc0de")[0] is RunStatus.CORRUPT
    res = RunStore(world["store"]).prune(5, grace_s=0)
    assert res.deleted == (old,) and not os.path.lexists(world["runs"] / old)
    assert (outside / "keep" / "data").read_text() == "precious" and (outside / "secret").exists()
    assert os.path.islink(world["runs"] / f".tmp-{old}-0badc0de")


# -- 1. run records validated before use -----------------------------------------------------------
GARBAGE = {
    "empty": b"",
    "bad-utf8": b"\xff\xfe{}",
    "deep": b"[" * 100_000,
    "truncated": b'{"format_version": 1, "run_id": ',
    "null": b"null",
    "list": b"[1, 2]",
    "string": b'"run"',
    "too-big": b"{" + b" " * (2 << 20) + b"}",
    "nan": None,  # a sound record with NaN in it, filled in below
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_garbage_run_json_is_corrupt(world, kind):
    new = clone_run(world["store"], world["passed"])
    path = world["runs"] / new / "run.json"
    raw = GARBAGE[kind]
    if raw is None:
        raw = path.read_text().replace('"threshold": 0.001', '"threshold": NaN').encode()
        assert b"NaN" in raw
    path.write_bytes(raw)
    status, problem = status_of(world["store"], new)
    assert status is RunStatus.CORRUPT and f"{new}/run.json: corrupt run record" in problem and "\n" not in problem
    assert regress_picks(world) == world["passed"]


def _sound_record(world) -> dict:
    return json.loads((world["runs"] / world["passed"] / "run.json").read_text())


TYPE_CONFUSION = [
    ("format_version", True, "format version"),
    ("format_version", 1.0, "format version"),
    ("run_id", 12, "run_id"),
    ("run_id", "../../outside", "run_id"),
    ("created_at", 1700000000, "created_at"),
    ("model", ["synth"], "model"),
    ("model", "", "model"),
    ("pass_label", "great", "pass_label"),
    ("pass_label", True, "pass_label"),
    ("baseline_run", "../x", "baseline_run"),
    ("baseline_run", 3, "baseline_run"),
    ("summary", [], "summary"),
    ("summary", {"passed": 1, "matched": 3}, "summary.passed"),
    ("summary", {"passed": True, "matched": True}, "summary.matched"),
    ("summary", {"passed": True, "matched": "3"}, "summary.matched"),
    ("summary", {"passed": True}, "matched"),
    ("summary", {"passed": False, "matched": 3, "first_divergent": {"layer": "3"}}, "summary.first_divergent.layer"),
    ("summary", {"passed": False, "matched": 3, "error": 7}, "summary.error"),
    ("summary", {"passed": True, "matched": 3, "threshold": "1e-3"}, "summary.threshold"),
    ("capture_signature", [1], "capture_signature"),
    ("environment", "cpu", "environment"),
    ("environment", {"torch": ["2.4"]}, "environment.torch"),
    ("model_identity", None, "model_identity"),
    ("dump_format_version", "1", "dump_format_version"),
    ("dump_format_version", False, "dump_format_version"),
    ("dump_created_at", 5, "dump_created_at"),
    ("promoted", "yes", "promoted"),
    ("promoted", {"at": 1, "from": "failed"}, "promoted.at"),
    ("promoted", {"at": "now", "from": "great"}, "promoted.from"),
    ("promoted", {"at": "now"}, "promoted"),
    ("surprise", 1, "surprise"),
    ("capture_signature", {"a": "\udcff"}, "capture_signature.a"),
    ("capture_signature", json.loads("[" * 70 + "]" * 70), "capture_signature"),
]


@pytest.mark.parametrize(
    ("field", "value", "named"), TYPE_CONFUSION, ids=[f"{f}={json.dumps(v)[:20]}" for f, v, _ in TYPE_CONFUSION]
)
def test_type_confusion_in_run_json_names_the_field(world, field, value, named):
    new = clone_run(world["store"], world["passed"])
    d = {**_sound_record(world), "run_id": new, field: value}
    (world["runs"] / new / "run.json").write_text(json.dumps(d))
    status, problem = status_of(world["store"], new)
    assert status is RunStatus.CORRUPT and f"{new}/run.json" in problem and named in problem, problem
    assert "\n" not in problem
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        RunRecord.from_json(d, folder=new)
    assert regress_picks(world) == world["passed"]


def test_unknown_label_in_run_json_is_one_line_exit_2(world):
    """A record whose stored label is none this version knows: the run lists as corrupt, and reading it is exit 2
    with one line naming its run.json and the field."""
    new = clone_run(world["store"], world["passed"])
    record = world["runs"] / new / "run.json"
    record.write_text(json.dumps({**_sound_record(world), "run_id": new, "pass_label": "golden"}))
    r = cli("store", "show", world["store"], new)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert f"{new}/run.json: corrupt run record" in r.stderr and "pass_label" in r.stderr, r.stderr
    r = cli("store", "ls", world["store"])
    assert r.returncode == 0 and "CORRUPT" in r.stdout and f"{new}/run.json" in r.stderr, r.stdout + r.stderr
    assert status_of(world["store"], new)[0] is RunStatus.CORRUPT


def test_run_status_prints_and_serializes_as_its_word():
    """``store ls`` and anything that writes a status show the same words as before the enum."""
    assert [s.value for s in RunStatus] == ["complete", "incomplete", "corrupt", "staging"]
    for s in RunStatus:
        assert s == s.value and str(s) == f"{s}" == s.value and json.dumps(s) == f'"{s.value}"'
    assert [s for s in RunStatus if s.warned] == [RunStatus.INCOMPLETE, RunStatus.CORRUPT]
    assert [s for s in RunStatus if s.unfinished] == [RunStatus.INCOMPLETE, RunStatus.STAGING]


def test_missing_keys_and_folder_mismatch_are_named(world):
    d = _sound_record(world)
    for key in ("run_id", "model", "pass_label", "capture_signature", "environment", "created_at"):
        with pytest.raises(ValueError, match=f"missing key '{key}'"):
            RunRecord.from_json({k: v for k, v in d.items() if k != key})
    with pytest.raises(ValueError, match="field 'run_id': says run id .* but the folder is"):
        RunRecord.from_json(d, folder=world["base"])
    rec = RunRecord.from_json(d, folder=world["passed"])
    assert RunRecord.from_json(json.loads(rec.dumps()), folder=rec.run_id) == rec


def test_a_stored_report_has_the_limit_of_any_report(world):
    """``report.json`` in a store is refused over the size ``load_report`` refuses, unread (sparse: no disk used)."""
    run = world["passed"]
    path = world["runs"] / run / "report.json"
    assert RunStore(world["store"]).report_json(run) is not None
    with open(path, "r+b") as f:
        f.truncate(MAX_REPORT_BYTES + 1)
    with pytest.raises(
        StoreError, match=f"{run}/report.json: {MAX_REPORT_BYTES + 1} bytes, over the {MAX_REPORT_BYTES} bytes"
    ):
        RunStore(world["store"]).report_json(run)
    with pytest.raises(UsageError, match=f"exceeds the {MAX_REPORT_BYTES >> 20} MiB limit"):
        load_report(path)


def test_run_ids_are_exact(world):
    """A name that only looks like a run id (a trailing newline, non-ASCII digits) is not one."""
    good = world["passed"]
    for name in (good + "\n", good.replace("2", "\u0662", 1), " " + good, good[:-1] + "G"):
        with pytest.raises(StoreError, match="not a run id"):
            RunStore(world["store"]).get(name)


# -- through the real CLI, as CI runs it --------------------------------------------------------
def test_cli_on_a_hostile_store(world):
    runs, outside = world["runs"], world["outside"]
    fifo = clone_run(world["store"], world["passed"])
    become(runs / fifo / "run.json", "fifo", outside)
    linked = clone_run(world["store"], world["passed"])
    become(runs / linked, "symlink-out", outside)
    dirrec = clone_run(world["store"], world["passed"])
    become(runs / dirrec / "run.json", "dir", outside)
    marked = clone_run(world["store"], world["base"])  # a sound run of another model, with markup in its name
    rec = json.loads((runs / marked / "run.json").read_text())
    (runs / marked / "run.json").write_text(json.dumps({**rec, "model": "m[/]"}))
    (runs / "[bold]notes").mkdir()
    os.mkdir(os.fsencode(runs) + b"/odd\xff\nname")
    store = world["store"]
    r = cli("store", "ls", store)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for name in (fifo, linked, dirrec, "[bold]notes", "odd\\udcff\\nname"):
        assert name in r.stdout, name
    assert "m[/]" in r.stdout and "3 runs shown; 5 incomplete, corrupt or staging entries" in r.stdout
    for args in (("show", store, fifo), ("promote", store, linked), ("show", store, dirrec)):
        r = cli("store", *args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    r = cli("store", "prune", store, "--keep", "1")
    assert r.returncode == 0 and "left alone" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.path.lexists(runs / fifo / "run.json") and os.path.islink(runs / linked) and (outside / "secret").exists()
    r = cli("regress", world["run"], "--store", store, "--quiet")
    assert r.returncode == 0 and "PASS" in r.stdout and "warning: " in r.stderr, r.stdout + r.stderr
