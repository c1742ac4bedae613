"""vLLM as an engine: real vLLM (CPU build) on a tiny checkpoint the tests write, judged against HF fp32.

Every vLLM job of this module runs in one worker subprocess (:func:`_worker`), so that vLLM's
process-wide state (torch.distributed, thread settings, a frozen gc) never reaches the pytest
process, and vLLM is imported once. The worker runs ``python -m dumper run --engine vllm`` through
the CLI's own entry point for the dump jobs (vLLM's default multiprocess engine: the model runs
in its engine core process), and the library for the seeded bug; the user-script capture (the
in-process hook API) runs in a process of its own with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
beside the worker's later jobs (:func:`in_process`).
The seeded bug lives in vLLM's own code in the engine core: ``tests/vllm_seed/sitecustomize.py``
on the worker's ``PYTHONPATH`` patches it there when ``DRIFTSCOPE_TEST_SEED`` is set (:func:`seeded`).
The HF reference is ``python -m dumper run`` in a subprocess; verdicts come from
``python -m comparator`` subprocesses and their JSON reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from comparator import compare_dumps
from dumper.errors import UsageError
from dumper.format import load_manifest
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig
from tests.conftest import ROOT, run_cli
from tests.engine_models import build_checkpoint, engine_missing

_rng = np.random.default_rng(7)
PREFIX = [1] + _rng.integers(3, 300, 139).tolist()  # 140 tokens: one full 128-token KV block is shared
PROMPTS = [
    PREFIX + [7, 8, 9, 10, 11, 12],
    PREFIX + [20, 21, 22, 23, 24, 25, 26, 27, 28],
    [1] + _rng.integers(3, 300, 39).tolist(),
]
BUG_LAYER, BUG_PROMPT, BUG_TOKEN = 1, 1, 147
DECODE_BUG_PROMPTS = [PROMPTS[0], PROMPTS[2]]
"""The seeded engine's decode job: position BUG_TOKEN is prompt 0's decode step 1 (146 tokens), and no prompt's."""
assert [len(p) > BUG_TOKEN for p in PROMPTS] == [i == BUG_PROMPT for i in range(len(PROMPTS))]  # one prompt has it
N_LAYERS = 4
JOB = ("--layers", "all", "--engine-arg", "enable_prefix_caching=true", "--quiet")
LOGPROBS = ("--logprobs", "--top-k", "5")
SUBLAYER = "input,attn_output,mlp_input,mlp_output"
"""The points inside a layer (issue 34), with the attention input."""
CLI_JOBS = {  # name -> extra `python -m dumper run --engine vllm` args, in the order they run (engines reused)
    "fp32": LOGPROBS,
    "prefix": (),  # no --logprobs: vLLM never reads the prefix cache for a request asking prompt_logprobs
    "chunk": ("--chunk-size", "16", *LOGPROBS),
    "bf16": ("--dtype", "bfloat16", *LOGPROBS),
    "logits": ("--logprobs", "--top-k", "3", "--save-logits"),
    "decode": ("--new-tokens", "8", *LOGPROBS),  # the fp32 job's engine: greedy decode, every step recorded
}
NEW_TOKENS = 8


def need(name: str) -> None:
    why = engine_missing(name)
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


def _cfg(ckpt: Path, out: Path) -> RunConfig:
    """The fp32 CLI job as a RunConfig (the same engine settings, so the worker reuses its engine)."""
    return RunConfig(
        out=str(out),
        model=str(ckpt),
        input_ids=tuple(map(tuple, PROMPTS)),
        layers="all",
        logprobs=LogprobSpec(top_k=5),
        engine="vllm",
        engine_args=(("enable_prefix_caching", "true"),),
    )


SEED_DIR = ROOT / "tests" / "vllm_seed"
"""The test-only ``sitecustomize.py`` that seeds faults in the processes vLLM starts (see its docstring)."""
SEED_ENV, SEED_KEY = "DRIFTSCOPE_TEST_SEED", "test_seeded_bug"


def finish_worker(base: Path, results: dict) -> None:
    """End a vLLM worker's work: write ``base/results.json`` (what :func:`assert_worker_done` checks)."""
    (base / "results.json").write_text(json.dumps(results))


TEARDOWN_ABORT = "terminate called without an active exception"
"""What vLLM's and torch's native threads sometimes print as they abort a worker's interpreter teardown."""


def teardown_aborted(returncode: int, log: str, finished: bool) -> bool:
    """Whether a process that ran vLLM aborted in its interpreter teardown (SIGABRT after :data:`TEARDOWN_ABORT`,
    seen in the full suite) once ``finished`` says every job is done and its results are out."""
    return returncode == -6 and finished and log.rstrip().endswith(TEARDOWN_ABORT)


def assert_process_done(returncode: int, log: str, finished: bool) -> None:
    """A process that ran vLLM finished its work: exit 0, or :func:`teardown_aborted`; anything else fails."""
    assert returncode == 0 or teardown_aborted(returncode, log, finished), log[-4000:]


def assert_worker_done(returncode: int, log: str, base: Path) -> None:
    """A vLLM worker finished its work: :func:`assert_process_done` once ``base/results.json`` is written."""
    assert_process_done(returncode, log, (base / "results.json").is_file())


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM worker subprocess: the repo and the seed directory on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR))), **extra}


@contextlib.contextmanager
def seeded(seed: dict) -> Iterator[dict]:
    """Inside: every process vLLM starts has the fault ``seed`` (``DRIFTSCOPE_TEST_SEED``, read at its start-up).

    Yields the ``additional_config`` entry that gives a compiled engine with the seed its own
    compiled graph (vLLM's compile cache is keyed by the config, not by a patch; the seed refuses
    a compiled engine without it). Call from a process started with :func:`worker_env`.
    """
    assert str(SEED_DIR) in os.environ.get("PYTHONPATH", "").split(os.pathsep), "not a worker_env process"
    os.environ[SEED_ENV] = json.dumps(seed)
    try:
        yield {SEED_KEY: seed}
    finally:
        del os.environ[SEED_ENV]


def shared_checkpoint(kind: str = "ckpt", build: Callable[[Path], Path] = build_checkpoint) -> Path:
    """The tiny checkpoint ``build`` writes, at one fixed path per ``kind`` and version of the builders, written
    once (atomically).

    vLLM keys its compile cache by the engine config, the model's path included: a fixed path
    lets every vLLM test module, and every later run, reuse the graphs compiled for it.
    """
    digest = hashlib.sha256((ROOT / "tests" / "engine_models.py").read_bytes()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"driftscope-test-{kind}-{os.getuid()}-{digest}"
    if not path.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.", dir=path.parent))
        build(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another session wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _user_script(kwargs: str, out: str) -> None:
    """A user's own script on the in-process engine (its process has ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    ``capture(model_of(llm))`` around two ``generate`` calls that decode 3 tokens each; the
    engine is the fp32 job's (the same settings, so its compiled graph comes from vLLM's cache).
    """
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import dumper
    from dumper.engines.vllm.hooks import model_of

    llm = LLM(**json.loads(kwargs))
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with torch.inference_mode(), dumper.capture(model_of(llm), out, layers="all"):
        llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params, use_tqdm=False)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS[1:]], params, use_tqdm=False)


def in_process(code: str) -> subprocess.Popen:
    """``python -c code`` started now, with vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    and no spool directory: what a user script of the hook API runs as (stdout and stderr together)."""
    from dumper.settings import VLLM_SPOOL_ENV

    env = {k: v for k, v in worker_env(VLLM_ENABLE_V1_MULTIPROCESSING="0").items() if k != VLLM_SPOOL_ENV}
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, start: float, done: Path) -> dict:
    """A job's result from an :func:`in_process` process that writes ``done`` last: its exit code, seconds since
    ``start``, output's tail. An abort of its teardown once ``done`` is written counts as exit 0
    (:func:`teardown_aborted`), and ``teardown_abort`` says so."""
    log, _ = proc.communicate(timeout=900)
    aborted = teardown_aborted(proc.returncode, log, done.exists())
    return {
        "rc": 0 if aborted else proc.returncode,
        "teardown_abort": aborted,
        "seconds": time.perf_counter() - start,
        "stderr": log[-3000:],
    }


def _model_here() -> bool:
    """Whether the engine :func:`~dumper.engines.vllm.load_llm` keeps runs its model in this process."""
    from dumper.engines.vllm.engine import ENGINE
    from dumper.engines.vllm.hooks import model_runner_of

    try:
        model_runner_of(ENGINE.llm)
    except UsageError:
        return False
    return True


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

    run = ["run", "--engine", "vllm", "--model", ckpt, "--prompts", prompts, *JOB]
    timed("fp32", lambda: main([*run, *CLI_JOBS["fp32"], "--out", str(base / "fp32")]))
    results["fp32"]["in_process"] = _model_here()  # the engine the fp32 job kept (test_vllm_tp checks it)
    timed("prefix", lambda: main([*run, *CLI_JOBS["prefix"], "--out", str(base / "prefix")]))
    timed("decode", lambda: main([*run, *CLI_JOBS["decode"], "--out", str(base / "decode")]))
    timed(
        "decode-prefill",
        lambda: main(
            [
                "run",
                "--engine",
                "vllm",
                "--model",
                ckpt,
                *JOB,
                *LOGPROBS,
                "--tokens-from",
                str(base / "decode"),
                "--out",
                str(base / "decode-prefill"),
            ]
        ),
    )
    cfg = _cfg(Path(ckpt), base / "bug")
    kw = engine_kwargs(cfg, Path(ckpt), PROMPTS)  # the fp32 job's engine settings, its graph compiled by now
    user_start = time.perf_counter()
    user = in_process(
        f"from tests.dumper.engines.test_engine_vllm import _user_script; "
        f"_user_script({json.dumps(kw)!r}, {str(base / 'user')!r})"
    )  # beside the jobs below

    def seeded_job() -> int:
        with seeded({"layer": BUG_LAYER, "token": BUG_TOKEN}) as key:  # in the engine core vLLM starts here
            llm = load_llm({**kw, "additional_config": {**kw["additional_config"], **key}})
        dump_llm(llm, cfg, PROMPTS, Path(ckpt))
        return 0

    def seeded_decode() -> int:  # the seeded engine again: position BUG_TOKEN is prompt 0's decode step 1
        with seeded({"layer": BUG_LAYER, "token": BUG_TOKEN}) as key:
            llm = load_llm({**kw, "additional_config": {**kw["additional_config"], **key}})
        dump_llm(llm, replace(cfg, out=str(base / "bug-decode"), new_tokens=NEW_TOKENS), DECODE_BUG_PROMPTS, Path(ckpt))
        return 0

    def seeded_half(where: str) -> int:  # a bug inside layer BUG_LAYER (its MLP's or attention's output)
        seed = {"layer": BUG_LAYER, "token": BUG_TOKEN, "where": where}
        half_cfg = replace(cfg, out=str(base / f"bug-{where}"), points=tuple(SUBLAYER.split(",")), logprobs=None)
        half_kw = engine_kwargs(half_cfg, Path(ckpt), [PROMPTS[BUG_PROMPT]])
        with seeded(seed) as key:
            llm = load_llm({**half_kw, "additional_config": {**half_kw["additional_config"], **key}})
        dump_llm(llm, half_cfg, [PROMPTS[BUG_PROMPT]], Path(ckpt))
        return 0

    timed("bug", seeded_job)
    timed("bug-decode", seeded_decode)
    timed("bug-mlp", lambda: seeded_half("mlp"))
    timed("bug-attn", lambda: seeded_half("attn"))
    for name in ("chunk", "bf16", "logits"):
        timed(name, lambda name=name: main([*run, *CLI_JOBS[name], "--out", str(base / name)]))
    bad = base / "bad-ckpt"  # last: a failed engine start may leave vLLM's process state behind
    bad.mkdir()
    for f in Path(ckpt).iterdir():
        (bad / f.name).write_bytes(f.read_bytes()[:4096] if f.name == "model.safetensors" else f.read_bytes())
    timed(
        "bad",
        lambda: main(
            [
                "run",
                "--engine",
                "vllm",
                "--model",
                str(bad),
                "--input-ids",
                "1,5,9",
                "--out",
                str(base / "bad"),
                "--quiet",
            ]
        ),
    )
    results["user"] = finish(user, user_start, base / "user" / "manifest.json")
    finish_worker(base, results)


def base_runs(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(HF dump, vLLM job dirs, worker results): the HF reference and the worker run side by side.

    Once per session (the ``vllm_base`` fixture of ``tests/dumper/engines/conftest.py``): the
    fp32 and bf16 jobs and the HF fp32 reference are also :mod:`.test_vllm_compiled`'s and
    :mod:`.test_vllm_tp`'s (``tp1``), which link them (:func:`link_base`) instead of starting
    those engines again.
    """
    need("vllm")
    root = tmp_path_factory.mktemp("vllm")
    ckpt = shared_checkpoint()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from tests.dumper.engines.test_engine_vllm import _worker; "
            f"_worker({str(ckpt)!r}, {str(prompts)!r}, {str(root)!r})",
        ],
        cwd=ROOT,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    hf = run_cli(
        "dumper", "run", "--model", ckpt, "--prompts", prompts, "--out", root / "hf", *JOB[:2], *LOGPROBS, "--quiet"
    )
    hf_logits = run_cli(
        "dumper",
        "run",
        "--model",
        ckpt,
        "--prompts",
        prompts,
        "--out",
        root / "hf-logits",
        *JOB[:2],
        *CLI_JOBS["logits"],
        "--quiet",
    )
    log, _ = worker.communicate(timeout=900)
    assert hf.returncode == 0 and hf_logits.returncode == 0, hf.stderr + hf_logits.stderr
    assert_worker_done(worker.returncode, log, root)
    return root / "hf", root, json.loads((root / "results.json").read_text())


def link_base(base: tuple[Path, Path, dict], root: Path, jobs: dict[str, str]) -> dict[str, dict]:
    """Link the session's base jobs into ``root`` (``jobs``: name here -> base job, ``hf`` included) and return
    their base results by the name here; a base job that failed fails the caller's tests, not this link."""
    for here, there in jobs.items():
        (root / here).symlink_to(base[1] / there, target_is_directory=True)
    return {here: base[2][there] for here, there in jobs.items() if there in base[2]}


@pytest.fixture
def runs(vllm_base):
    """This module's jobs: the session's base run (:func:`base_runs`) itself."""
    return vllm_base


def _compare(runs, job: str, *, cli: bool = False, baseline: str = "hf") -> tuple[int, dict]:
    """(exit code, JSON report) of comparing the HF dump with ``job``'s: ``python -m comparator HF JOB --json``
    in a subprocess with ``cli``, else :func:`comparator.compare_dumps` here (the CLI's exit code rule)."""
    _, root, results = runs
    hf = root / baseline
    assert results[job]["rc"] == 0, results[job]["stderr"]
    if not cli:
        report = compare_dumps(hf, root / job)
        return int(not report.passed), json.loads(json.dumps(report.to_json()))
    path = root / f"{job}.report.json"
    r = run_cli("comparator", hf, root / job, "--json", path, "--quiet")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(path.read_text())


def _compiled(runs, job: str) -> bool:
    """Whether ``job``'s engine ran vLLM's compiled mode, as its manifest records."""
    return load_manifest(runs[1] / job).extra["engine"]["settings"]["compiled"]


def _max_rel(report: dict) -> float:
    return max(t["rel_diff"] for t in report["tensors"])


@pytest.mark.engine
def test_fp32_batch_matches_hf_hidden_states_and_logprobs(runs):
    rc, report = _compare(runs, "fp32", cli=True)
    assert rc == 0 and report["passed"], report
    assert report["matched"] == N_LAYERS * len(PROMPTS) and not report["unmatched_baseline"]
    assert _max_rel(report) < 1e-6
    lp = report["logprobs"]
    assert lp["passed"] and lp["compared_positions"] == sum(len(p) - 1 for p in PROMPTS), lp
    m = load_manifest(runs[1] / "fp32")
    hidden = [t for t in m.tensors if t.point == "input"]
    for layer in range(N_LAYERS):  # the engine core batches the requests as they arrive: one or more steps
        rows = [
            (s, p)
            for t in hidden
            if t.layer == layer
            for s, p in zip(t.row_sequence_ids().tolist(), t.row_positions().tolist(), strict=True)
        ]
        assert sorted(rows) == [(s, p) for s, prompt in enumerate(PROMPTS) for p in range(len(prompt))], layer
    assert len({t.forward_pass for t in hidden}) <= len(PROMPTS)
    env = m.environment
    assert env["engine"] == "vllm" and env["engine_dtype"] == "float32" and env["engine_attention_backend"]
    assert env["engine_prefix_caching"] is True and m.model["config_hash"] and _compiled(runs, "fp32")


@pytest.mark.engine
def test_a_bug_at_one_layer_and_token_is_localized_to_the_next_layer(runs):
    """The seeded bug (:func:`seeded`), compiled into the graph in vLLM's engine core, first shows in the next
    layer's input."""
    rc, report = _compare(runs, "bug")
    assert _compiled(runs, "bug")
    assert rc == 1 and not report["passed"]
    fd = report["first_divergent"]
    assert fd["layer"] == BUG_LAYER + 1 and fd["name"] == f"model.layers.{BUG_LAYER + 1}.self_attn.input"
    assert fd["sequence"] == BUG_PROMPT and fd["token"] == BUG_TOKEN and fd["failing_sequences"] == [BUG_PROMPT]
    assert all(t["passed"] for t in report["tensors"] if t["layer"] <= BUG_LAYER)


@pytest.mark.engine
@pytest.mark.parametrize(
    "where,point,name,agreeing",
    [
        ("mlp", "mlp_output", "mlp.output", ["input", "attn_output", "mlp_input"]),
        ("attn", "attn_output", "self_attn.output", ["input"]),
    ],
)
def test_a_bug_inside_a_layer_is_named_at_its_point_in_vllm(runs, tmp_path, where, point, name, agreeing):
    """The MLP (or the attention) of layer BUG_LAYER adds the seeded bug to its own output (compiled into vLLM's
    graph): with the points inside the layer captured, the verdict names that output, the layer's earlier points
    agreeing with an HF run of the same points, every earlier layer passing."""
    _, root, results = runs
    job = f"bug-{where}"
    assert results[job]["rc"] == 0, results[job]["stderr"]
    r = run_cli(
        "dumper",
        "run",
        "--model",
        shared_checkpoint(),
        "--layers",
        "all",
        "--points",
        SUBLAYER,
        "--input-ids",
        ",".join(map(str, PROMPTS[BUG_PROMPT])),
        "--out",
        tmp_path / "hf",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    report = compare_dumps(tmp_path / "hf", root / job)
    fd = report.first_divergent
    assert _compiled(runs, job) and not report.passed and fd is not None
    want = (BUG_LAYER, point, f"model.layers.{BUG_LAYER}.{name}", BUG_TOKEN)
    assert (fd.layer, fd.point, fd.name, fd.token) == want, fd
    assert fd.agreeing == agreeing
    assert all(t.passed for t in report.tensors if t.layer < BUG_LAYER)


@pytest.mark.engine
def test_chunked_prefill_matches_hf(runs):
    rc, report = _compare(runs, "chunk")
    assert rc == 0 and report["passed"] and report["logprobs"]["passed"], report
    m = load_manifest(runs[1] / "chunk")
    assert _compiled(runs, "chunk") and m.environment["engine_chunked_prefill"] is True
    assert m.environment["engine_max_num_batched_tokens"] == 16
    passes = {t.forward_pass for t in m.tensors if t.point == "input"}
    assert len(passes) >= sum(map(len, PROMPTS)) // 16  # 16 tokens per engine step
    assert max(t.shape[0] for t in m.tensors if t.point == "input") <= 16


@pytest.mark.engine
def test_a_prefix_cache_hit_matches_hf(runs):
    m = load_manifest(runs[1] / "prefix")
    assert _compiled(runs, "prefix")
    assert m.extra["prefix_cache_hits"] == [0, 128, 0]  # vLLM's own count: prompt 1 reused one 128-token block
    shared = [t for t in m.tensors if t.meta.get("shared_prefix")]
    assert len(shared) == N_LAYERS and all(set(t.row_sequence_ids().tolist()) == {1} for t in shared)
    assert all(t.row_positions().tolist() == list(range(128)) for t in shared)
    computed = [t for t in m.tensors if not t.meta.get("shared_prefix")]
    assert (
        min(p for t in computed for p, s in zip(t.row_positions(), t.row_sequence_ids(), strict=True) if s == 1) == 128
    )
    rc, report = _compare(runs, "prefix")
    assert rc == 0 and report["passed"] and report["matched"] == N_LAYERS * len(PROMPTS), report


@pytest.mark.engine
def test_the_hook_api_in_a_users_vllm_script_matches_hf(runs):
    """capture(vllm_model) around two generate calls with decoding: prompt rows only, prompt order, and the
    second call's prefix-cache hit on the first call's blocks filled in."""
    _, root, results = runs
    assert results["user"]["rc"] == 0, results["user"]["stderr"]
    m = load_manifest(root / "user")
    hidden = [t for t in m.tensors if t.point == "input"]
    assert [t.name for t in hidden[:N_LAYERS]] == [f"model.layers.{i}.self_attn.input" for i in range(N_LAYERS)]
    assert any(t.meta.get("shared_prefix") for t in hidden)
    batches = [set(t.row_sequence_ids().tolist()) for t in hidden if not t.meta.get("shared_prefix")]
    assert {1, 2} in batches  # the second call's two prompts in one engine step (in process: added, then run)
    for s, p in enumerate(PROMPTS):  # decode steps are not kept: each prompt's positions exactly
        pos = sorted(
            q
            for t in hidden[::N_LAYERS]
            for q, i in zip(t.row_positions(), t.row_sequence_ids(), strict=True)
            if i == s
        )
        assert pos == list(range(len(p))), s
    rc, report = _compare(runs, "user")
    assert rc == 0 and report["passed"] and report["matched"] == N_LAYERS * len(PROMPTS), report


@pytest.mark.engine
def test_bf16_is_measured_against_hf_fp32(runs, record_property):
    rc, report = _compare(runs, "bf16", cli=True)
    rel = sorted(t["rel_diff"] for t in report["tensors"])
    dlp = report["logprobs"]["max_abs_err"]["value"]
    record_property("bf16_rel_diff", [rel[0], rel[-1]])
    record_property("bf16_max_abs_dlogprob", dlp)
    print(f"vLLM bf16 vs HF fp32: rel_diff {rel[0]:.2e}..{rel[-1]:.2e}, max |dlogprob| {dlp:.3g}, exit {rc}")
    assert 1e-6 < rel[-1] < 5e-2 and 1e-4 < dlp < 2.0  # bf16 really ran (not fp32) and is not garbage
    assert rc == (0 if report["passed"] else 1)


@pytest.mark.engine
def test_bf16_passes_against_the_noise_of_hf_bf16_layouts(runs):
    """Calibrated from HF bf16 eager and SDPA against the HF fp32 reference, vLLM bf16 is within that noise."""
    _, root, results = runs
    prompts = root / "prompts.jsonl"
    for name, extra in (("hf-bf16", ()), ("hf-bf16-sdpa", ("--attn", "sdpa"))):
        r = run_cli(
            "dumper",
            "run",
            "--model",
            shared_checkpoint(),
            "--prompts",
            prompts,
            "--out",
            root / name,
            *JOB[:2],
            *LOGPROBS,
            "--dtype",
            "bfloat16",
            *extra,
            "--quiet",
        )
        assert r.returncode == 0, r.stderr
    r = run_cli(
        "comparator",
        "calibrate",
        root / "hf",
        root / "hf-bf16",
        root / "hf-bf16-sdpa",
        "--out",
        root / "bf16-noise.json",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert results["bf16"]["rc"] == 0, results["bf16"]["stderr"]
    path = root / "bf16-noise.report.json"
    r = run_cli(
        "comparator", root / "hf", root / "bf16", "--noise", root / "bf16-noise.json", "--json", path, "--quiet"
    )
    report = json.loads(path.read_text())
    ratios = [t["token_noise_ratio"] for t in report["tensors"]]
    assert r.returncode == 0 and report["passed"], r.stdout
    assert all(ratio is not None for ratio in ratios) and 0.05 < max(ratios) < 3, ratios  # bf16 noise, not zero
    assert report["logprobs"]["noise"] is not None and report["logprobs"]["passed"]


@pytest.mark.engine
def test_full_logits_rows_match_hf(runs):
    """--save-logits: vLLM's raw logits of every vocabulary id, compared row by row (KL needs whole rows)."""
    rc, report = _compare(runs, "logits", baseline="hf-logits")
    lp = report["logprobs"]
    assert rc == 0 and report["passed"] and not report["unmatched_baseline"] and not report["unmatched_target"], report
    assert lp["kl_max"]["value"] < 1e-9 and lp["compared_positions"] == sum(len(p) - 1 for p in PROMPTS), lp
    m = load_manifest(runs[1] / "logits")
    assert _compiled(runs, "logits")
    assert [t.shape for t in m.tensors if t.name == "logits"] == [(len(p) - 1, 512) for p in PROMPTS]


@pytest.mark.engine
def test_a_checkpoint_vllm_cannot_load_is_one_error_line(runs):
    _, root, results = runs
    bad = results["bad"]
    lines = [ln for ln in bad["stderr"].splitlines() if ln.startswith("error:")]
    assert bad["rc"] == 2 and len(lines) == 1, bad["stderr"]
    assert lines[0].startswith(f"error: {root / 'bad-ckpt'}: vLLM cannot load it (") and "Traceback" not in lines[0]
    assert not (root / "bad" / "manifest.json").exists()


def test_engine_args_are_checked_before_vllm_starts(tmp_path):
    """``--engine-arg`` parsing needs no engine: unknown keys and bad values are one-line usage errors."""
    from dumper.engines.vllm.engine import engine_kwargs

    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))

    def kwargs(*args: tuple[str, str], **cfg):
        return engine_kwargs(
            RunConfig(out="x", model=str(ckpt), engine="vllm", engine_args=args, **cfg), ckpt, [[1, 2, 3]]
        )

    kw = kwargs(("kv_cache_dtype", "fp8"), ("enable_prefix_caching", "false"), chunk_size=32)
    assert kw["kv_cache_dtype"] == "fp8" and kw["enable_prefix_caching"] is False and kw["enforce_eager"] is False
    assert kw["enable_chunked_prefill"] is True and kw["max_num_batched_tokens"] == 32 and kw["max_num_seqs"] == 32
    assert kw["skip_tokenizer_init"] is True and kw["max_model_len"] == 512
    with pytest.raises(UsageError, match="--engine-arg attn: --engine vllm does not take it"):
        kwargs(("attn", "x"))
    with pytest.raises(UsageError, match="enable_prefix_caching=yes: expected true or false"):
        kwargs(("enable_prefix_caching", "yes"))
    with pytest.raises(UsageError, match="max_num_seqs=64 is more than --chunk-size 16"):
        kwargs(("max_num_seqs", "64"), chunk_size=16)
    with pytest.raises(UsageError, match="max_num_seqs=0: expected a positive integer"):
        kwargs(("max_num_seqs", "0"))
    with pytest.raises(UsageError, match="--batch-size: --engine vllm batches every prompt itself"):
        kwargs(batch_size=4)
    with pytest.raises(UsageError, match="--attn sdpa: HF's attention setting"):
        kwargs(attn="sdpa")
    assert kwargs(("max_model_len", "1024"), ("max_num_seqs", "3"))["max_model_len"] == 1024
    # the context holds the longest prompt and what it generates, within the model's positions
    assert kwargs(new_tokens=600)["max_model_len"] == 603 and kwargs(new_tokens=4000)["max_model_len"] == 2048
    from dumper.jobs.sweep.engine import pinned_engine_args  # a sweep's engine holds its longest decode cell

    pinned = pinned_engine_args(
        RunConfig(out="x", model=str(ckpt), engine="vllm", input_ids=((1, 2, 3),)), {"new_tokens"}, new_tokens=600
    )
    assert pinned.engine_arg("max_model_len") == "603"


def _decode_counterpart(runs, job: str, tmp_path: Path) -> tuple[int, dict]:
    """(exit code, JSON report) of the HF prefill of the tokens ``job``'s decode fed back against ``job``."""
    _, root, results = runs
    assert results[job]["rc"] == 0, results[job]["stderr"]
    r = run_cli(
        "dumper",
        "run",
        "--model",
        shared_checkpoint(),
        "--tokens-from",
        root / job,
        *JOB[:2],
        *LOGPROBS,
        "--out",
        tmp_path / "hf",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("comparator", tmp_path / "hf", root / job, "--json", tmp_path / "report.json", "--quiet")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads((tmp_path / "report.json").read_text())


@pytest.mark.engine
def test_decode_steps_of_the_default_engine_match_an_hf_prefill_of_the_same_tokens(runs, tmp_path):
    """vLLM's default engine (compiled, multiprocess) decodes the three prompts in shared engine steps; every step's
    rows are recorded with their own sequence and position, and match HF's prefill of the same tokens in fp32."""
    rc, report = _decode_counterpart(runs, "decode", tmp_path)
    assert rc == 0 and report["passed"], report["first_divergent"]
    assert report["decode"] == {
        "passed": True,
        "sequences": 3,
        "steps": 3 * (NEW_TOKENS - 1),
        "forks": [],
        "missing": [],
    }
    assert report["matched"] == N_LAYERS * len(PROMPTS) and _max_rel(report) < 1e-6
    assert report["logprobs"]["compared_positions"] == sum(len(p) - 1 + NEW_TOKENS for p in PROMPTS)
    m = load_manifest(runs[1] / "decode")
    assert _compiled(runs, "decode") and [len(g) for g in m.extra["generated_ids"]] == [NEW_TOKENS] * 3
    decode_rows: dict[int, set[int]] = {}  # pass -> sequences with a decode row in it
    for t in m.tensors:
        if t.point == "input" and t.layer == 0:
            for s, p in zip(t.row_sequence_ids().tolist(), t.row_positions().tolist(), strict=True):
                if p >= len(PROMPTS[s]):
                    decode_rows.setdefault(t.forward_pass, set()).add(s)
    assert max(map(len, decode_rows.values())) >= 2  # a real decode batch: requests side by side in one step


@pytest.mark.engine
def test_a_bug_seeded_in_vllm_is_named_at_its_decode_step(runs, tmp_path):
    """The seeded engine's bug at position BUG_TOKEN, compiled into vLLM's graph, hits prompt 0 only in its decode
    step 1: the verdict names the next layer, that token, phase decode and the step."""
    rc, report = _decode_counterpart(runs, "bug-decode", tmp_path)
    fd = report["first_divergent"]
    assert rc == 1 and (fd["layer"], fd["token"], fd["sequence"]) == (BUG_LAYER + 1, BUG_TOKEN, 0), fd
    assert (
        fd["phase"] == "decode" and fd["decode_step"] == BUG_TOKEN - len(PROMPTS[0]) and fd["failing_sequences"] == [0]
    )
    assert all(t["passed"] for t in report["tensors"] if t["layer"] <= BUG_LAYER)


@pytest.mark.engine
def test_vllm_decode_matches_vllm_prefill_of_the_same_tokens(runs):
    """vLLM as its own counterpart (``--tokens-from`` on the same engine): its decode steps match its prefill of the
    tokens they fed; the last generated token's logprob, which a vLLM prefill does not score, is left out."""
    _, root, results = runs
    assert results["decode-prefill"]["rc"] == 0, results["decode-prefill"]["stderr"]
    report = compare_dumps(root / "decode-prefill", root / "decode")
    assert report.passed, (report.first_divergent, report.decode)
    assert report.decode is not None and report.decode.steps == 3 * (NEW_TOKENS - 1)
    assert report.logprobs is not None and report.logprobs.compared_positions == sum(
        len(p) - 1 + NEW_TOKENS - 1 for p in PROMPTS
    )
