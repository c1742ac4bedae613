"""The hook API into an fsspec URL: ``dumper.capture(model, "s3://...")`` (:mod:`dumper.hooks.remote`).

In one process on fsspec's memory filesystem: the dump sent to the URL holds exactly the bytes a
local capture writes; a body that raises, an empty capture and a URL that already holds a dump
leave nothing complete-looking there and the staging directory gone. Under torch.distributed,
two real gloo ranks, each with its own staging directory (no shared disk), send their files
straight to moto's S3 server on 127.0.0.1, and rank 0's manifest, written last, joins them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import tempfile
import uuid

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dumper
from comparator import compare_dumps
from dumper.errors import DumpError
from dumper.format import MANIFEST_NAME, DumpReader, load_manifest
from dumper.format.remote import fetched
from tests.conftest import prompt_ids, tiny_llama
from tests.s3_server import make_bucket, s3_server, s3fs_of


@pytest.fixture
def url():
    name = f"memory://driftscope-hook-{uuid.uuid4().hex}/dumps/a"
    yield name
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(name.split("://")[1].split("/")[0], recursive=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _staging() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "driftscope-staging-*")))


def _capture(model, out, ids, **kw):
    with torch.inference_mode(), dumper.capture(model, out, layers="all", **kw):
        model(input_ids=ids)


def test_a_capture_sent_to_a_url_holds_the_bytes_of_a_local_one(model, url, tmp_path):
    m, tok = model
    ids = prompt_ids(tok, 24)
    before = _staging()
    _capture(m, tmp_path / "local", ids)
    _capture(m, url, ids)
    assert _staging() == before  # the staging directory is gone with the capture
    local = load_manifest(tmp_path / "local")
    with fetched(url) as copy:
        remote = load_manifest(copy)
        assert remote.files == local.files and len(remote.tensors) == len(local.tensors) > 0
        a, b = DumpReader(tmp_path / "local"), DumpReader(copy)
        for ra, rb in zip(local.tensors, remote.tensors, strict=True):
            assert (ra.name, ra.forward_pass) == (rb.name, rb.forward_pass)
            assert a.array(ra).tobytes() == b.array(rb).tobytes()
        report = compare_dumps(tmp_path / "local", copy)
    assert report.passed and report.matched == len(local.tensors)


def test_a_body_that_raises_or_records_nothing_sends_nothing(model, url):
    m, tok = model
    fs = fsspec.filesystem("memory")
    before = _staging()
    with pytest.raises(ValueError, match="boom"):
        with torch.inference_mode(), dumper.capture(m, url, layers="all"):
            m(input_ids=prompt_ids(tok, 16))
            raise ValueError("boom")
    assert not fs.exists(url)  # nothing at all: the data go up only after a clean exit
    with pytest.raises(DumpError, match="recorded no tensors"):
        with dumper.capture(m, url, layers="all"):
            pass
    assert not fs.exists(url) and _staging() == before


def test_a_url_that_holds_a_dump_is_refused_and_kept(model, url):
    m, tok = model
    _capture(m, url, prompt_ids(tok, 16))
    fs = fsspec.filesystem("memory")
    held = fs.cat_file(f"{url}/{MANIFEST_NAME}")
    with pytest.raises(DumpError, match="already holds a complete dump"):
        _capture(m, url, prompt_ids(tok, 20))
    assert fs.cat_file(f"{url}/{MANIFEST_NAME}") == held


# -- torch.distributed ranks, each sending its own files to S3 -------------------------------

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str, env: dict[str, str], spy: str) -> None:
    os.environ.update(env)
    tempfile.tempdir = os.path.join(spy, f"rank{rank}")  # a staging directory of each rank's own: no shared disk
    os.makedirs(tempfile.tempdir)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model, tok = tiny_llama()
        with torch.inference_mode(), dumper.capture(model, out, layers="1,3") as cap:
            cap.set_sequence_ids([rank])
            model(input_ids=prompt_ids(tok, 24 + 8 * rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torch_distributed_ranks_send_their_own_files_to_s3(tmp_path):
    with s3_server() as env:
        bucket = make_bucket(env, "hooks")
        out = f"{bucket}/dist/a"
        mp.start_processes(
            _rank, args=(_free_port(), out, env, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True
        )
        fs = s3fs_of(env)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(out.removeprefix("s3://")))
        os.environ.update(env)
        try:
            with fetched(out) as copy:
                m = load_manifest(copy)
        finally:
            for k in env:
                os.environ.pop(k, None)
    assert sorted({f.split("-")[0] for f in m.files}) == ["r0", "r1"]  # each rank's own files
    assert {(t.layer, t.rank, t.shape[1]) for t in m.tensors} == {(k, r, 24 + 8 * r) for k in (1, 3) for r in (0, 1)}
    assert MANIFEST_NAME in names and "index-r0.json" in names and "index-r1.json" in names
    for rank in (0, 1):  # every staging directory removed (libraries may leave their own caches there)
        assert [n for n in os.listdir(tmp_path / f"rank{rank}") if n.startswith("driftscope-")] == []


# -- an engine's spool at a URL: each rank's part sent there, the client joins it ----------------


def test_parts_sent_to_a_url_spool_join_into_the_dump_a_local_capture_writes(model, url, tmp_path):
    """What vLLM's workers do with ``DRIFTSCOPE_VLLM_SPOOL=URL`` (one rank here): data, then the part, at the URL;
    the client waits for the part there, streams the files down and writes the manifest."""
    from dumper.engines.base import EngineInfo
    from dumper.engines.vllm.parts import join_dump, remove_spool, wait_parts
    from dumper.hooks.remote import RemoteCapture

    m, tok = model
    ids = prompt_ids(tok, 24)
    _capture(m, tmp_path / "local", ids)
    spool = f"{url}/spool/c0123"
    with torch.inference_mode(), RemoteCapture(m, spool, layers="all", part=True):
        m(input_ids=ids)
    fs = fsspec.filesystem("memory")
    assert MANIFEST_NAME not in {
        p.rsplit("/", 1)[-1] for p in fs.ls(spool, detail=False)
    }  # a part never looks complete
    parts = wait_parts(spool, timeout_s=5)
    joined = join_dump(
        tmp_path / "joined",
        parts,
        model_name=None,
        identity={"model_type": "llama"},
        engine=EngineInfo("test", None, "tiny"),
        job_extra={},
    )
    remove_spool(spool)
    assert not fs.exists(spool)
    local = load_manifest(tmp_path / "local")
    assert joined.files == local.files and len(joined.tensors) == len(local.tensors)
    a, b = DumpReader(tmp_path / "local"), DumpReader(tmp_path / "joined")
    assert all(a.array(x).tobytes() == b.array(y).tobytes() for x, y in zip(local.tensors, joined.tensors, strict=True))


def test_a_part_at_a_url_spool_that_names_a_file_outside_is_refused(url, tmp_path):
    from dumper.engines.base import EngineInfo
    from dumper.engines.vllm.parts import join_dump, wait_parts
    from dumper.errors import CorruptDumpError

    spool = f"{url}/spool/c0bad"
    fs = fsspec.filesystem("memory")
    for where in (f"{spool}/evil", f"{url}/spool/evil"):  # what ``../evil`` names, in either reading
        fs.pipe_file(where, b"abc")
    fs.pipe_file(
        f"{spool}/index-r0.json", json.dumps({"files": {"../evil": 3}, "tensors": [], "world_size": 1}).encode()
    )
    parts = wait_parts(spool, timeout_s=5)
    with pytest.raises(CorruptDumpError, match="expected a plain file name"):
        join_dump(
            tmp_path / "out" / "d", parts, model_name=None, identity={}, engine=EngineInfo("t", None, "x"), job_extra={}
        )
    assert not (tmp_path / "out" / "evil").exists()


def test_a_rank_that_failed_at_a_url_spool_is_one_line(url):
    from dumper.engines.vllm.parts import wait_parts
    from dumper.engines.vllm.spool import leave_failure

    spool = f"{url}/spool/c0fail"
    leave_failure(spool, 1, "OSError: [Errno 28] No space left on device")
    with pytest.raises(DumpError, match=r"failed on rank r1: OSError: \[Errno 28\] No space left"):
        wait_parts(spool, timeout_s=5)
