"""Dumps read at fsspec URLs in place, by ranged reads (:mod:`dumper.format.remote_read`), on fsspec's in-memory
filesystem (the real S3 API server: ``test_remote_s3.py``).

A URL dump compares exactly as its local copy does (hidden states, chunked prefill, decode steps,
logprobs, MoE routing; either side a URL), through ``compare_dumps`` and the CLI with every report
file. Reads are ranges of the files the manifest lists and nothing else (a decoy under the prefix is
never touched), each byte read at most once while the cache holds it, and no more kept than the cache
allows. Hostile manifests and files are refused in one line naming the URL, as their local twins are.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pytest

from comparator import compare_dumps
from comparator.cli.main import main
from comparator.reports.files import json_text
from dumper.errors import CorruptDumpError
from dumper.format import MANIFEST_NAME, DumpReader, load_manifest
from dumper.format.remote import upload_dump
from dumper.format.remote_read import LoadCache, RemoteDump, dump_manifest
from dumper.format.validate import MAX_HEADER_BYTES
from tests.conftest import run_cli

RUN = ("--layers", "all", "--logprobs", "--top-k", "2", "--new-tokens", "2", "--quiet")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Real dumps: ``a`` and ``b`` (the same prompts prefilled in chunks of 4; both decode 2 steps, with
    logprobs), ``bf16``, and two tiny-Mixtral routing dumps (eager and sdpa attention)."""
    from tests.routing_dumps import router_dump

    root = tmp_path_factory.mktemp("remote-read")
    for name, extra in (("a", ()), ("b", ("--chunk-size", "4")), ("bf16", ("--dtype", "bfloat16"))):
        r = run_cli("dumper", "run", "--out", root / name, *RUN, *extra)
        assert r.returncode == 0, r.stderr
    router_dump(root / "moe-eager")
    router_dump(root / "moe-sdpa", attn="sdpa")
    return root


@pytest.fixture(scope="module")
def remote(local):
    """Every dump of ``local`` uploaded under one memory:// bucket, with a decoy file under each prefix."""
    bucket = f"driftscope-read-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for d in local.iterdir():
        upload_dump(d, f"memory://{bucket}/{d.name}")
        fs.pipe_file(f"/{bucket}/{d.name}/decoy.safetensors", b"\xff" * 64)
    yield f"memory://{bucket}"
    fs.rm(f"/{bucket}", recursive=True)


@pytest.fixture
def reads(monkeypatch):
    """What the memory filesystem is asked: every path touched (any call) and the bytes each ranged read gave."""
    fs = fsspec.filesystem("memory")
    touched: set[str] = set()
    nbytes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def wrap(name):
        real = getattr(fs, name)

        def call(path, *args, **kwargs):
            out = real(path, *args, **kwargs)
            with lock:
                touched.add(fs._strip_protocol(path))
                if name == "cat_file":
                    nbytes[fs._strip_protocol(path)] += len(out)
            return out

        monkeypatch.setattr(fs, name, call)

    for name in ("open", "cat_file", "cat", "info", "size", "exists", "ls", "find", "glob", "walk"):
        wrap(name)
    return touched, nbytes


def _json(report) -> dict:
    out = json.loads(json_text(report))
    out.pop("baseline"), out.pop("target")
    return out


@pytest.mark.parametrize("pair", [("a", "b"), ("moe-eager", "moe-sdpa")])
def test_a_url_dump_compares_exactly_as_its_local_copy(local, remote, pair):
    b, t = pair
    want = compare_dumps(local / b, local / t)
    assert want.matched > 0 and (
        want.logprobs is not None and want.decode is not None if b == "a" else want.router is not None
    )
    assert any(x.rel_diff > 0 for x in want.tensors)  # a real comparison, not two copies of one run
    for base, target in (
        (f"{remote}/{b}", f"{remote}/{t}"),
        (local / b, f"{remote}/{t}"),
        (f"{remote}/{b}", local / t),
    ):
        got = compare_dumps(base, target)
        assert (got.baseline, got.target) == (str(base), str(target))
        assert got.matched == want.matched
        assert [x.rel_diff for x in got.tensors] == [x.rel_diff for x in want.tensors]
        assert _json(got) == _json(want)


def test_reads_are_ranges_of_the_listed_files_only(local, remote, reads):
    touched, nbytes = reads
    report = compare_dumps(f"{remote}/a", f"{remote}/b")
    assert report.matched > 0
    listed: set[str] = set()
    for name in ("a", "b"):
        prefix = f"{remote.removeprefix('memory://')}/{name}"
        files = load_manifest(local / name).files
        listed |= {f"/{prefix}/{f}" for f in (*files, MANIFEST_NAME)}
        for f, size in files.items():
            assert nbytes[f"/{prefix}/{f}"] <= size  # headers and tensors, each range once
        assert 0 < sum(nbytes[f"/{prefix}/{f}"] for f in files) <= sum(files.values())
    assert touched <= listed  # no listing, no decoy, nothing of another dump


def test_threads_sharing_a_reader_read_each_range_once(local, remote, reads):
    _, nbytes = reads
    url_reader, local_reader = DumpReader(f"{remote}/a"), DumpReader(local / "a")
    recs = [r for r in url_reader.manifest.tensors for _ in range(3)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(url_reader.rows, recs))
    for rec, a in zip(recs, got, strict=True):
        want = local_reader.rows(rec)
        assert a.dtype == want.dtype and a.shape == want.shape and np.array_equal(a, want, equal_nan=True)
        assert not a.flags.writeable
    assert sum(nbytes.values()) <= sum(url_reader.manifest.files.values())


def test_the_cache_keeps_no_more_than_its_bytes(remote, reads):
    _, nbytes = reads
    recs = DumpReader(f"{remote}/a").manifest.tensors
    biggest = max(r.nbytes for r in recs)
    kept = DumpReader(f"{remote}/a")
    for _ in range(2):
        for rec in recs:
            kept.rows(rec)
    once = sum(nbytes.values())
    nbytes.clear()
    bounded = DumpReader(f"{remote}/a", cache_bytes=biggest)  # room for one tensor at a time
    for _ in range(2):
        for rec in recs:
            assert np.array_equal(bounded.rows(rec), kept.rows(rec), equal_nan=True)
            assert bounded._arrays.held <= biggest
    assert sum(nbytes.values()) > once  # what was let go is read again, not held


def test_a_bf16_url_dump_reads_the_same_bits(local, remote):
    url_reader, local_reader = DumpReader(f"{remote}/bf16"), DumpReader(local / "bf16")
    bf16 = [r for r in url_reader.manifest.tensors if r.dtype == "BF16"]
    assert bf16
    for rec in url_reader.manifest.tensors:
        a, want = url_reader.array(rec), local_reader.array(rec)
        assert a.dtype == want.dtype and np.array_equal(a.view(np.uint8), want.view(np.uint8))
    assert url_reader.array(bf16[0]).dtype == np.uint16


def test_the_cli_compares_urls_with_every_output(local, remote, tmp_path, capsys):
    outs = {}
    for side, (base, target) in (("local", (local / "a", local / "b")), ("url", (f"{remote}/a", f"{remote}/b"))):
        d = tmp_path / side
        d.mkdir()
        rc = main(
            [
                str(base),
                str(target),
                "--tensors",
                "--json",
                str(d / "r.json"),
                "--csv",
                str(d / "r.csv"),
                "--html",
                str(d / "r.html"),
                "--markdown",
                str(d / "r.md"),
            ]
        )
        outs[side] = (rc, capsys.readouterr().out, d)
        assert main(["logprobs", str(base), str(target), "--json", str(d / "l.json"), "--quiet"]) == 0
    (rc_l, _, dl), (rc_u, text_u, du) = outs["local"], outs["url"]
    assert rc_l == rc_u == 0
    assert f"{remote}/a" in text_u and "model.layers.1" in text_u  # --tensors rows, the URL as given
    jl, ju = (json.loads((d / "r.json").read_text()) for d in (dl, du))
    assert ju["baseline"] == f"{remote}/a" and {**ju, "baseline": 0, "target": 0} == {**jl, "baseline": 0, "target": 0}
    assert (du / "r.csv").read_text() == (dl / "r.csv").read_text()
    assert f"{remote}/a" in (du / "r.html").read_text() and (du / "r.md").read_text()
    ll, lu = (json.loads((d / "l.json").read_text()) for d in (dl, du))
    assert lu == ll and lu["passed"]
    assert main([f"{remote}/a", f"{remote}/b", "--git-bisect", "--quiet"]) == 0
    assert main([f"{remote}/a", f"{remote}/a/", "--quiet"]) == 2  # a dump against itself tests nothing
    assert "same dump" in capsys.readouterr().err


def _hostile(local, lie):
    """(manifest JSON, {name: bytes}) of dump ``a`` with ``lie`` told about its first data file."""
    raw = json.loads((local / "a" / MANIFEST_NAME).read_text())
    objects = {n: (local / "a" / n).read_bytes() for n in raw["files"]}
    name = sorted(raw["files"])[0]
    data = objects[name]
    n = int.from_bytes(data[:8], "little")
    if lie in ("outside", "slash"):
        objects[f"../x/{name}" if lie == "outside" else f"x/{name}"] = data
        raw["files"] = {f"../x/{name}" if lie == "outside" else f"x/{name}": raw["files"].pop(name), **raw["files"]}
    elif lie in ("entry-short", "entry-long"):
        raw["files"][name] += -64 if lie == "entry-short" else 64
    elif lie == "missing":
        del objects[name]
    elif lie in ("header-beyond", "header-huge"):
        n = len(data) - 7 if lie == "header-beyond" else MAX_HEADER_BYTES + 1
        objects[name] = n.to_bytes(8, "little") + data[8:]
    elif lie == "range-beyond":  # a header claiming a tensor longer than the file holds, the size entry true
        header = json.loads(data[8 : 8 + n])
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        header[last]["data_offsets"][1] += 4096
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        objects[name] = len(text).to_bytes(8, "little") + text + data[8 + n :]
        raw["files"][name] = len(objects[name])
    return raw, objects, name


@pytest.mark.parametrize(
    "lie,words",
    [
        ("outside", "plain"),
        ("slash", "plain"),
        ("entry-short", "longer than the"),
        ("entry-long", "but the manifest says"),
        ("missing", "listed in the manifest but missing"),
        ("header-beyond", "truncated safetensors header"),
        ("header-huge", "exceeds the"),
        ("range-beyond", "data_offsets"),
    ],
)
def test_a_hostile_url_dump_is_refused_in_one_line(local, lie, words, reads):
    touched, _ = reads
    url = f"memory://driftscope-hostile-{uuid.uuid4().hex}/dumps/a"
    fs = fsspec.filesystem("memory")
    raw, objects, name = _hostile(local, lie)
    for n, data in objects.items():
        fs.pipe_file(f"{url}/{n}", data)
    fs.pipe_file(f"{url}/{MANIFEST_NAME}", json.dumps(raw).encode())
    touched.clear()
    try:
        with pytest.raises(CorruptDumpError, match=words) as e:
            compare_dumps(local / "a", url)
        msg = str(e.value)
        assert "\n" not in msg and url in msg  # the URL as given: its "//" intact
        if lie not in ("outside", "slash"):
            assert f"{url}/{name}" in msg
        assert not any("/x/" in p for p in touched)  # an entry outside the prefix is never asked for
    finally:
        fs.rm(url.split("://")[1].split("/")[0], recursive=True)


def test_dump_manifest_reads_either_kind(local, remote):
    assert dump_manifest(f"{remote}/a") == dump_manifest(local / "a") == load_manifest(local / "a")


class _Pending(dict):
    """A LoadCache's table of loads under way that counts the threads finding a load there (they then wait)."""

    waiting = 0

    def get(self, key, default=None):
        found = super().get(key, default)
        self.waiting += found is not None
        return found


def test_a_load_is_shared_by_the_threads_that_wait_for_it_and_so_is_its_error():
    cache: LoadCache[np.ndarray] = LoadCache(1 << 20, lambda a: a.nbytes)
    for value in (7, None):
        calls, pending = [], _Pending()
        cache._loading = pending

        def load(value=value, calls=calls, pending=pending):
            calls.append(value)
            deadline = time.monotonic() + 30
            while pending.waiting < 3 and time.monotonic() < deadline:  # the other three wait on this load
                time.sleep(0.01)
            if value is None:
                raise CorruptDumpError("x: unreadable")
            return np.full(4, value)

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(cache.get, value, load) for _ in range(4)]
        assert len(calls) == 1 and pending.waiting == 3  # one load for four threads
        if value is None:
            assert all(isinstance(f.exception(), CorruptDumpError) for f in futures)
        else:
            assert all(f.result() is futures[0].result() for f in futures)
    assert cache.get(None, lambda: np.ones(4))[0] == 1  # a failed load is not kept: the next asks again


def test_a_long_range_comes_as_parts_exactly_and_a_short_answer_is_refused():
    url = f"memory://driftscope-parts-{uuid.uuid4().hex}/d"
    fs = fsspec.filesystem("memory")
    data = np.random.default_rng(0).integers(0, 256, 21 << 20, dtype=np.uint8).tobytes()  # over two 8 MiB parts
    fs.pipe_file(f"{url}/f.safetensors", data)
    try:
        dump = RemoteDump(url)
        assert bytes(dump.read("f.safetensors", 3, len(data) - 5)) == data[3:-5]
        with pytest.raises(CorruptDumpError, match="changed while it was read") as e:
            dump.read("f.safetensors", len(data) - 100, len(data) + 100)
        assert "\n" not in str(e.value) and f"{url}/f.safetensors" in str(e.value)
    finally:
        fs.rm(url.split("://")[1].split("/")[0], recursive=True)
