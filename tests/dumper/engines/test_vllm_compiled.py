"""Capture in what users ship: vLLM's default compiled mode, through the tap its model loader installs.

Real vLLM (CPU build; torch.compile with inductor) on the tiny checkpoint of
:mod:`tests.dumper.engines.test_engine_vllm`, at the same fixed path and with the same engine
settings where it can, so that a graph compiled for that module is loaded from vLLM's compile
cache here instead of compiled again (every distinct engine config compiles once, ~30-120 s).
All vLLM work runs in one worker subprocess (:func:`_worker`): ``python -m dumper run`` through
the CLI's entry point (vLLM's default multiprocess engine), a user script in its own process for
the ``vllm.general_plugins`` entry point, and, beside them in a process of their own, the plain
(untapped) engines in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where the hook API's refusal of
a compiled model is given). HF fp32 is the reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from comparator import compare_dumps
from dumper.format import load_manifest
from dumper.format.manifest import LOGPROB_TOP_ID, LOGPROB_TOP_VALUE, LOGPROB_VALUE
from dumper.format.reader import DumpReader
from tests.conftest import ROOT, subprocess_env
from tests.dumper.engines.test_engine_vllm import (
    JOB,
    LOGPROBS,
    N_LAYERS,
    PROMPTS,
    _cfg,
    assert_process_done,
    assert_worker_done,
    finish,
    finish_worker,
    in_process,
    link_base,
    need,
    shared_checkpoint,
)

SUBSET = (1, 3)
SKETCH_K = 32
CLI_JOBS = {  # name -> `python -m dumper run --engine vllm` args after JOB (`--layers` given twice: the last wins)
    "fp32": LOGPROBS,  # test_engine_vllm's fp32 job, run once a session (link_base)
    "bf16": ("--dtype", "bfloat16", *LOGPROBS),  # test_engine_vllm's bf16 job, likewise
    "subset": ("--layers", ",".join(map(str, SUBSET)), *LOGPROBS),
    "eager": ("--engine-arg", "enforce_eager=true", *LOGPROBS),
    "sketch": ("--sketch", str(SKETCH_K), *LOGPROBS),  # compiled, the projection made in vLLM's process
}
BAD_TAPS = {"layer-range": {"layers": [N_LAYERS + 3]}}
"""Hand-made ``additional_config["driftscope"]`` entries the loader must refuse in one line: only what needs the
model (its layer count); every entry refused without one (an unknown key, a bad sketch) is
:func:`test_the_driftscope_entry_is_checked_before_any_engine`'s, which the loader calls first."""
TAP_LOG = "driftscope: tapped {n} points of LlamaForCausalLM ("
_USER_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

kwargs, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"SCRIPT pid={os.getpid()}")
llm = LLM(**kwargs)  # the tap comes from the vllm.general_plugins entry point, in vLLM's engine process
params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=0)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
print("LOGPROBS " + json.dumps([[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], p[1:])]
                                for o, p in zip(outs, prompts)]))
"""
"""A user's own script: ``vllm.LLM`` with the tap asked for in ``additional_config``, nothing of driftscope imported."""


def _raw_prompt_logprobs(outs, prompts, top_k: int) -> dict[str, list]:
    """``"seq,pos"`` -> [logprob of the token, top-k ids, top-k logprobs], as vLLM returned them."""
    raw = {}
    for s, (o, ids) in enumerate(zip(outs, prompts, strict=True)):
        for j in range(1, len(ids)):
            top = sorted(o.prompt_logprobs[j].items(), key=lambda kv: kv[1].rank)[:top_k]
            raw[f"{s},{j}"] = [o.prompt_logprobs[j][ids[j]].logprob, [t for t, _ in top], [e.logprob for _, e in top]]
    return raw


def _plain_engine(ckpt: Path, dtype: str, out: Path) -> dict:
    """The compiled engine of ``dtype`` without the tap: its raw prompt logprobs, and what ``dumper.capture`` says."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import dumper
    from dumper.engines.vllm.engine import engine_kwargs, load_llm
    from dumper.errors import DriftscopeError

    cfg = dataclasses.replace(_cfg(ckpt, out), dtype=dtype)
    llm = load_llm(engine_kwargs(cfg, ckpt, PROMPTS, tap=False))
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=cfg.logprobs.top_k)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    refused = None
    try:
        with dumper.capture(llm, out / "refused", layers="all"):
            pass
    except DriftscopeError as e:
        refused = [type(e).__name__, str(e)]
    return {"logprobs": _raw_prompt_logprobs(outs, PROMPTS, cfg.logprobs.top_k), "refused": refused}


def _plain_engines(ckpt: str, out: str) -> None:
    """:func:`_plain_engine` of fp32 and bf16, in a process whose engine runs in process (the hook API's
    refusal is about that engine); writes ``out/plain.json``."""
    base, results = Path(out), {}
    for name, dtype in (("plain-fp32", "float32"), ("plain-bf16", "bfloat16")):
        start = time.perf_counter()
        results[name] = {
            "value": _plain_engine(Path(ckpt), dtype, base / name),
            "stderr": "",
            "seconds": time.perf_counter() - start,
        }
    (base / "plain.json").write_text(json.dumps(results))


def _user_script(ckpt: Path, out: Path) -> dict:
    """The user script in its own process, vLLM's engine core in another (``VLLM_ENABLE_V1_MULTIPROCESSING=1``)."""
    from dumper.engines.vllm.engine import engine_kwargs
    from dumper.engines.vllm.serve import CPU_DEFAULTS

    kw = {**engine_kwargs(_cfg(ckpt, out), ckpt, PROMPTS), "additional_config": {"driftscope": {"layers": "all"}}}
    # vLLM's CPU settings as a CPU user sets them (its KV cache space, else vLLM wants 92% of free memory)
    env = {**CPU_DEFAULTS, **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    r = subprocess.run(
        [sys.executable, "-c", _USER_SCRIPT, json.dumps(kw), json.dumps(PROMPTS)],
        env=env,
        cwd=out,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("LOGPROBS ")]
    return {"rc": r.returncode, "log": r.stdout + r.stderr, "logprobs": json.loads(lines[0][9:]) if lines else None}


def _worker(ckpt: str, prompts: str, out: str) -> None:
    """All vLLM jobs in one process; writes ``out/results.json``."""
    from dumper.cli.main import main
    from dumper.engines.vllm.engine import engine_kwargs, load_llm
    from dumper.errors import DriftscopeError

    base, results = Path(out), {}

    def timed(name, fn):
        err, start = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stderr(err):
            value = fn()
        results[name] = {"value": value, "seconds": time.perf_counter() - start, "stderr": err.getvalue()[-3000:]}

    run = ["run", "--engine", "vllm", "--model", ckpt, "--prompts", prompts, *JOB]
    plain_start = time.perf_counter()  # the untapped engines' own process, beside the jobs below
    plain = in_process(
        f"from tests.dumper.engines.test_vllm_compiled import _plain_engines; _plain_engines({ckpt!r}, {out!r})"
    )
    timed("user", lambda: _user_script(Path(ckpt), base))
    for name in ("subset", "eager", "sketch"):
        timed(name, lambda name=name: main([*run, *CLI_JOBS[name], "--out", str(base / name)]))
    kw = engine_kwargs(_cfg(Path(ckpt), base), Path(ckpt), PROMPTS)
    for name, spec in BAD_TAPS.items():  # last: each fails at load, after vLLM read the weights

        def refused(spec=spec):
            try:
                load_llm({**kw, "additional_config": {"driftscope": spec}})
            except DriftscopeError as e:
                return [type(e).__name__, str(e)]
            return None

        timed(name, refused)
    done = finish(plain, plain_start, base / "plain.json")
    assert done["rc"] == 0, done["stderr"]
    results.update(json.loads((base / "plain.json").read_text()))
    finish_worker(base, results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_base):
    """(job dirs root, worker results): this module's worker, and the session's HF fp32 reference (``root/hf``)
    and fp32 and bf16 jobs (the same engines as test_engine_vllm's, started once), linked in."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-compiled")
    base = {
        name: {"value": r["rc"], "seconds": r["seconds"], "stderr": r["stderr"]}
        for name, r in link_base(vllm_base, root, {"hf": "hf", "fp32": "fp32", "bf16": "bf16"}).items()
    }
    ckpt = shared_checkpoint()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    worker = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.dumper.engines.test_vllm_compiled import _worker; "
            f"_worker({str(ckpt)!r}, {str(prompts)!r}, {str(root)!r})",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1500,
    )
    assert_worker_done(worker.returncode, worker.stdout, root)
    return root, {**json.loads((root / "results.json").read_text()), **base}


def _job(runs, name: str):
    """(value, stderr) of worker job ``name``; a CLI job must have exited 0."""
    result = runs[1][name]
    if name in CLI_JOBS:
        assert result["value"] == 0, result["stderr"]
    return result["value"], result["stderr"]


def _settings(runs, job: str) -> dict:
    _job(runs, job)
    return load_manifest(runs[0] / job).extra["engine"]["settings"]


def _dump_logprobs(path: Path) -> dict[str, list]:
    """``"seq,pos"`` -> [logprob, top-k ids, top-k logprobs] as the dump stores them (float32)."""
    reader = DumpReader(path)
    out: dict[str, dict] = {}
    for rec in reader.manifest.tensors:
        if rec.name in (LOGPROB_VALUE, LOGPROB_TOP_ID, LOGPROB_TOP_VALUE):
            for row, s, p in zip(reader.array(rec), rec.row_sequence_ids(), rec.row_positions(), strict=True):
                out.setdefault(f"{s},{p}", {})[rec.name] = row.tolist()
    return {k: [v[LOGPROB_VALUE][0], v[LOGPROB_TOP_ID], v[LOGPROB_TOP_VALUE]] for k, v in out.items()}


def _bits(values) -> np.ndarray:
    """The float32 bits of ``values`` (each exactly a float32, as vLLM's logprobs are)."""
    a = np.asarray(values, dtype=np.float64)
    assert np.array_equal(a.astype(np.float32).astype(np.float64), a)
    return a.astype(np.float32).view(np.uint32)


@pytest.mark.engine
def test_compiled_fp32_matches_hf_fp32(runs):
    root, _ = runs
    assert _settings(runs, "fp32")["compiled"] is True and _settings(runs, "fp32")["cuda_graphs"] is False
    report = compare_dumps(root / "hf", root / "fp32")
    assert report.passed and report.matched == N_LAYERS * len(PROMPTS) and not report.unmatched_baseline, report
    assert max(t.rel_diff for t in report.tensors) < 1e-6
    assert report.logprobs.passed and report.logprobs.compared_positions == sum(len(p) - 1 for p in PROMPTS)


@pytest.mark.engine
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_tap_does_not_change_a_compiled_engines_logprobs(runs, dtype):
    """The captured run's prompt logprobs (token and top-k) are bit for bit those of the same engine untapped."""
    root, _ = runs
    plain, _ = _job(runs, f"plain-{dtype}")
    captured = _dump_logprobs(root / dtype)
    assert _settings(runs, dtype)["compiled"] is True
    assert sorted(captured) == sorted(plain["logprobs"]) and len(captured) == sum(len(p) - 1 for p in PROMPTS)
    keys = sorted(captured)
    assert [captured[k][1] for k in keys] == [plain["logprobs"][k][1] for k in keys]  # top-k ids
    for i in (0, 2):  # the token's logprob, the top-k logprobs
        assert np.array_equal(_bits([captured[k][i] for k in keys]), _bits([plain["logprobs"][k][i] for k in keys]))


@pytest.mark.engine
def test_bf16_hidden_states_are_stored_as_bf16(runs):
    root, _ = runs
    _job(runs, "bf16")
    m = load_manifest(root / "bf16")
    hidden = [t for t in m.tensors if t.point == "input"]
    assert {t.dtype for t in hidden} == {"BF16"}  # safetensors' code: 2-byte bf16 bits
    assert m.environment["engine_dtype"] == "bfloat16"
    reader = DumpReader(root / "bf16")
    for layer in range(N_LAYERS):  # one record per engine step: the engine core batches requests as they arrive
        raw = [reader.array(t) for t in hidden if t.layer == layer]
        assert raw and all(a.dtype == np.uint16 and a.shape[1:] == (128,) for a in raw)
        assert sum(a.shape[0] for a in raw) == sum(map(len, PROMPTS))


@pytest.mark.engine
def test_a_compiled_engine_without_the_tap_is_refused_in_one_line(runs):
    plain, _ = _job(runs, "plain-fp32")
    kind, message = plain["refused"]
    assert kind == "UsageError" and "\n" not in message, message
    assert "compiled (vLLM's torch.compile)" in message
    assert 'additional_config={"driftscope": {"layers": "all"}}' in message and "enforce_eager=true" in message


@pytest.mark.engine
def test_a_layer_subset_is_tapped_and_matches_hf(runs):
    root, _ = runs
    assert _settings(runs, "subset")["compiled"] is True
    m = load_manifest(root / "subset")
    assert sorted({t.layer for t in m.tensors if t.point == "input"}) == list(SUBSET)
    report = compare_dumps(root / "hf", root / "subset")
    assert report.passed and report.matched == len(SUBSET) * len(PROMPTS) and report.logprobs.passed, report
    assert len(report.unmatched_baseline) == (N_LAYERS - len(SUBSET)) * len(PROMPTS)  # HF's other layers


@pytest.mark.engine
def test_eager_still_captures_and_matches_hf(runs):
    root, _ = runs
    settings = _settings(runs, "eager")
    assert settings["compiled"] is False and settings["cuda_graphs"] is False
    report = compare_dumps(root / "hf", root / "eager")
    assert report.passed and report.matched == N_LAYERS * len(PROMPTS) and report.logprobs.passed, report


@pytest.mark.engine
def test_a_sketch_of_the_compiled_engine_matches_hf_and_changes_no_logprob(runs):
    """``--sketch``: the tapped rows are projected in vLLM's own process; the estimates pass against HF's full rows,
    and the engine's logprobs are the unsketched fp32 job's, bit for bit."""
    root, _ = runs
    assert _settings(runs, "sketch")["compiled"] is True
    m = load_manifest(root / "sketch")
    hidden = [t for t in m.tensors if t.point == "input"]
    assert m.capture_signature["sketch"] == {"kind": "rademacher", "k": SKETCH_K, "seed": 0}
    assert hidden and all(
        t.sketch == {"hidden": 128, "dtype": "F32"} and t.shape[-1] == SKETCH_K and t.dtype == "F32" for t in hidden
    )
    report = compare_dumps(root / "hf", root / "sketch")
    assert report.passed and report.matched == N_LAYERS * len(PROMPTS) and report.logprobs.passed, report
    assert report.sketch["target"] and not report.sketch["baseline"]
    sketched, full = _dump_logprobs(root / "sketch"), _dump_logprobs(root / "fp32")
    keys = sorted(full)
    assert sorted(sketched) == keys
    assert np.array_equal(_bits([sketched[k][0] for k in keys]), _bits([full[k][0] for k in keys]))


@pytest.mark.engine
def test_the_entry_point_taps_the_model_in_vllms_engine_process(runs):
    """A user script's ``LLM`` with vLLM's engine core in a spawned process: the plugin taps the model there."""
    user, _ = _job(runs, "user")
    assert_process_done(user["rc"], user["log"], user["logprobs"] is not None)  # vLLM's teardown may abort
    lines = [ln for ln in user["log"].splitlines() if TAP_LOG.format(n=N_LAYERS) in ln]
    assert len(lines) == 1, user["log"][-3000:]
    script_pid = re.search(r"^SCRIPT pid=(\d+)$", user["log"], re.M).group(1)
    tapped_pid = re.match(r"\(\w+ pid=(\d+)\) INFO ", lines[0])  # vLLM prefixes its processes' log lines
    assert tapped_pid and tapped_pid.group(1) != script_pid, lines[0]  # the tap is in vLLM's process, not the script
    assert f"budget {load_manifest(runs[0] / 'fp32').environment['engine_max_num_batched_tokens']} tokens" in lines[0]
    captured = _dump_logprobs(runs[0] / "fp32")  # the in-process tapped engine of the same settings
    assert [len(r) for r in user["logprobs"]] == [len(p) - 1 for p in PROMPTS]
    assert np.array_equal(
        _bits([v for s, r in enumerate(user["logprobs"]) for v in r]),
        _bits([captured[f"{s},{j}"][0] for s, p in enumerate(PROMPTS) for j in range(1, len(p))]),
    )


@pytest.mark.engine
@pytest.mark.parametrize("name, says", [("layer-range", f"layer {N_LAYERS + 3} is out of range")])
def test_a_bad_driftscope_entry_is_one_error_line(runs, name, says):
    refused, _ = _job(runs, name)
    assert refused is not None, f"vLLM loaded additional_config {BAD_TAPS[name]}"
    kind, message = refused
    assert kind == "UsageError" and "\n" not in message and "Traceback" not in message, message
    assert message.startswith("additional_config 'driftscope': ") and says in message, message


def test_the_driftscope_entry_is_checked_before_any_engine():
    """``tap_config`` writes what ``tap_spec`` reads; anything else is one line naming the key (no vLLM needed)."""
    from dumper.engines.vllm.tap import sketch_of, tap_config, tap_spec
    from dumper.errors import UsageError
    from dumper.format.sketch import SketchSpec

    assert tap_spec(tap_config("all")) == {"layers": "all"} and tap_spec({"other": 1}) is None
    assert tap_spec(tap_config([1, 3], points="input")) == {"layers": [1, 3], "points": "input"}
    spec = tap_spec(tap_config("all", sketch=SketchSpec(k=8, seed=2)))
    assert spec == {"layers": "all", "sketch": {"kind": "rademacher", "k": 8, "seed": 2}}
    assert sketch_of(spec) == SketchSpec(k=8, seed=2) and sketch_of({"layers": "all"}) is None
    for entry, says in (
        ({"layerz": "all", "pointz": "x"}, "unknown key 'layerz' (and 1 more); it takes layers, points, sketch"),
        ("all", "expected an object with keys layers, points, sketch"),
        ({"layers": [1.5]}, "'driftscope'.layers: expected a spec string or a list"),
        ({"layers": "all", "sketch": 8}, "'driftscope'.sketch: expected an object of k, seed"),
        ({"layers": "all", "sketch": {"k": 0}}, "sketch K (--sketch) must be an integer >= 1"),
        ({"layers": "all", "sketch": {"k": 8, "seed": "1"}}, "sketch seed (--sketch-seed) must be an integer"),
    ):
        with pytest.raises(UsageError, match=re.escape(says)):
            tap_spec({"driftscope": entry})


def test_the_vllm_plugin_entry_point_is_installed():
    """``pip install`` registers the tap's loader hook where vLLM looks for plugins in every process it starts."""
    from importlib.metadata import entry_points

    found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "driftscope"]
    assert found == ["dumper.engines.vllm.tap:register"]
