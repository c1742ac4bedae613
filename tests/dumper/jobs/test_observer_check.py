"""``python -m dumper run --observer-check``: the job again without capture, logprobs compared bit for bit.

Real runs only: the CLI in subprocesses on the tiny-llama preset (eager and ``--compile``), the
library with a perturbation that acts only under capture (so the check must flag it, and must
not flag one acting in both runs), the comparison on real dump files (NaN, signed zero,
bfloat16), and real vLLM, eager and compiled, in one worker subprocess (see
tests/dumper/engines/test_engine_vllm.py for why), where the perturbation is seeded in vLLM's
engine core (tests/vllm_seed/sitecustomize.py) on the tapped engine only.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dumper
from dumper.errors import InternalError, UsageError
from dumper.format import LOGITS, LOGITS_POINT, LOGPROB_POINT, LOGPROB_TOP_VALUE, LOGPROB_VALUE, load_manifest
from dumper.hooks.capture import Capture
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.observer import NON_FINITE_DIFF, ObserverCheck, ObserverResult, mark_observer
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import ROOT, run_cli, tiny_llama
from tests.dumper.engines.test_engine_vllm import assert_worker_done, finish_worker, shared_checkpoint, worker_env
from tests.engine_models import engine_missing

PROMPTS = ([1, 17, 33, 90, 5, 61, 7, 140, 9, 12], [1] + [(13 * i) % 300 + 3 for i in range(23)])
"""Two prompts (10 and 24 tokens): only the second has a position PERTURB_AT."""
PERTURB_LAYER, PERTURB_AT = 1, 15


def _float_values(path: Path, *, logits: bool) -> int:
    """How many logprob (and logits) values the dump at ``path`` holds: what the check must have compared."""
    names = (LOGPROB_VALUE, LOGPROB_TOP_VALUE) + ((LOGITS,) if logits else ())
    return sum(math.prod(t.shape) for t in load_manifest(path).tensors if t.name in names)


# -- the comparison itself, on real dump files ----------------------------------------------------


def _dump(path: Path, values: torch.Tensor, logits: torch.Tensor) -> None:
    """A dump holding one pass of logprobs (rows at sequence 0, positions 1..n) and their logits rows."""
    meta = {"positions": torch.arange(1, values.shape[0] + 1), "sequence_ids": torch.zeros(values.shape[0])}
    with Capture(None, path) as cap:
        cap.record(LOGPROB_VALUE, values[:, None], point=LOGPROB_POINT, **meta)
        cap.record(LOGITS, logits, point=LOGITS_POINT, **meta)


def _check(path: Path, values: torch.Tensor, logits: torch.Tensor) -> ObserverResult:
    check = ObserverCheck(path, logits=True)
    meta = {"positions": torch.arange(1, values.shape[0] + 1), "sequence_ids": torch.zeros(values.shape[0])}
    check.record(LOGITS, logits, point=LOGITS_POINT, **meta)
    check.record(LOGPROB_VALUE, values[:, None], point=LOGPROB_POINT, **meta)
    return check.result()


def test_bits_decide_nan_equals_itself_and_a_signed_zero_differs(tmp_path):
    values = torch.tensor([-1.5, float("nan"), 0.0, -3.0])
    logits = torch.linspace(-4, 4, 4 * 6).reshape(4, 6).to(torch.bfloat16)
    _dump(tmp_path / "a", values, logits)
    same = _check(tmp_path / "a", values.clone(), logits.clone())
    assert same and same.values == 4 + 4 * 6 and same.max_abs_diff == 0.0 and same.position is None
    signed = values.clone()
    signed[2] = -0.0
    zero = _check(tmp_path / "a", signed, logits)
    assert not zero and zero.max_abs_diff == 0.0 and (zero.sequence, zero.position) == (0, 3)
    bumped = logits.clone()
    bumped[3, 1] += 0.25
    worst = _check(tmp_path / "a", values, bumped)
    assert not worst and worst.position == 4 and worst.max_abs_diff == float(bumped[3, 1]) - float(logits[3, 1])
    non_finite = _check(tmp_path / "a", torch.where(torch.isnan(values), 2.0, values), logits)
    assert non_finite.max_abs_diff == NON_FINITE_DIFF and non_finite.position == 2
    assert "non-finite" in non_finite.summary()
    assert ObserverResult.from_json(json.loads(json.dumps(worst.to_json()))) == worst


def test_a_row_only_one_run_recorded_is_a_driftscope_bug(tmp_path):
    values, logits = torch.tensor([-1.0, -2.0]), torch.zeros(2, 3)
    _dump(tmp_path / "a", values, logits)
    check = ObserverCheck(tmp_path / "a", logits=False)
    check.record(LOGPROB_VALUE, values[:1, None], positions=torch.tensor([1]), sequence_ids=torch.tensor([0]))
    with pytest.raises(InternalError, match="sequence 0, position 2"):
        check.result()
    with pytest.raises(InternalError, match="does not hold"):
        check.record(LOGPROB_VALUE, values[:1, None], positions=torch.tensor([1]), sequence_ids=torch.tensor([0]))


def test_the_mark_rewrites_only_the_manifest(tmp_path):
    _dump(tmp_path / "a", torch.tensor([-1.0]), torch.zeros(1, 3))
    before = load_manifest(tmp_path / "a")
    marked = mark_observer(tmp_path / "a", ObserverResult(True, "logprobs", 1))
    assert marked.extra["observer"] == {
        "checked": True,
        "bit_exact": True,
        "compared": "logprobs",
        "values": 1,
        "max_abs_diff": 0.0,
        "sequence": None,
        "position": None,
    }
    assert load_manifest(tmp_path / "a") == marked and marked.tensors == before.tensors


# -- HF: the CLI, and a perturbation under capture -------------------------------------------------


def test_without_logprobs_or_with_an_out_of_process_engine_it_is_a_usage_error(tmp_path):
    r = run_cli("dumper", "run", "--observer-check", "--out", tmp_path / "a", "--quiet")
    assert r.returncode == 2 and "add --logprobs" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "a").exists()
    with pytest.raises(UsageError, match="llama.cpp"):
        RunConfig(out=str(tmp_path / "b"), engine="llama.cpp", logprobs=LogprobSpec(), observer_check=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_hf_capture_is_bit_exact(tmp_path, mode):
    extra = ("--compile",) if mode == "compile" else ("--top-k", "3", "--save-logits")
    r = run_cli("dumper", "run", "--layers", "all", "--logprobs", *extra, "--observer-check", "--out", tmp_path / "a")
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_manifest(tmp_path / "a")
    logits = mode == "eager"
    obs = m.extra["observer"]
    assert obs == {
        "checked": True,
        "bit_exact": True,
        "compared": "logprobs+logits" if logits else "logprobs",
        "values": _float_values(tmp_path / "a", logits=logits),
        "max_abs_diff": 0.0,
        "sequence": None,
        "position": None,
    }
    assert obs["values"] > 0 and m.extra["compiled"] is (mode == "compile")
    assert any(t.point == "input" for t in m.tensors)  # the hidden states were captured
    what = "logprobs and logits" if logits else "logprobs"
    assert r.stdout.strip().splitlines()[-1] == f"observer check: bit-exact ({obs['values']} values: {what})"


def _perturb_hf(model: torch.nn.Module, *, always: bool) -> torch.utils.hooks.RemovableHandle:
    """Add 1e-3 to decoder layer PERTURB_LAYER's input at position PERTURB_AT, only under capture unless ``always``."""

    def pre(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if (not always and dumper.active_capture() is None) or hidden.shape[1] <= PERTURB_AT:
            return None
        bumped = hidden.clone()
        bumped[:, PERTURB_AT] += 1e-3
        return ((bumped, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": bumped})

    return model.model.layers[PERTURB_LAYER].register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.parametrize("always", [False, True], ids=["under-capture-only", "in-both-runs"])
def test_hf_a_perturbation_only_under_capture_is_caught(tmp_path, always):
    model, _ = tiny_llama()
    handle = _perturb_hf(model, always=always)
    cfg = RunConfig(out=str(tmp_path / "a"), layers="all", logprobs=LogprobSpec(top_k=2), observer_check=True)
    try:
        m = dump_sequences(model, [list(p) for p in PROMPTS], cfg)
    finally:
        handle.remove()
    obs = ObserverResult.from_json(m.extra["observer"])
    assert obs.values == _float_values(tmp_path / "a", logits=False)
    if always:  # the model's own change, in both runs: not an observer effect
        assert obs and obs.max_abs_diff == 0.0
        return
    assert not obs and obs.max_abs_diff > 0 and obs.sequence == 1 and obs.position > PERTURB_AT
    assert load_manifest(tmp_path / "a").extra["observer"]["bit_exact"] is False  # the dump stays, marked


def test_hf_cli_exits_1_when_capture_changed_the_logprobs(tmp_path, monkeypatch, capsys):
    """The CLI in this process, its model loader wrapped to add the perturbation: exit 1 and one line."""
    import dumper.prefill.run as run_module
    from dumper.cli.main import main

    load = run_module.load_model

    def perturbed_load(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        _perturb_hf(model, always=False)
        return model, tok

    monkeypatch.setattr(run_module, "load_model", perturbed_load)
    ids = [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]
    rc = main(
        ["run", *ids, "--layers", "all", "--logprobs", "--observer-check", "--quiet", "--out", str(tmp_path / "a")]
    )
    line = capsys.readouterr().out.strip()
    obs = load_manifest(tmp_path / "a").extra["observer"]
    assert rc == 1 and not obs["bit_exact"] and obs["sequence"] == 1 and obs["position"] > PERTURB_AT
    assert (
        line == f"observer check: capture changed the logprobs (largest |Δ| {obs['max_abs_diff']:.3g} at "
        f"sequence 1, position {obs['position']}, of {obs['values']} values)"
    )


# -- vLLM: eager and compiled, one worker process ---------------------------------------------------

VLLM_JOBS = ("perturbed", "eager", "compiled")
"""The worker's CLI jobs, in order; ``perturbed`` (eager) first, so that its tapped engine is a fresh one."""


def need(name: str) -> None:
    why = engine_missing(name)
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


PERTURB_SEED = {"layer": PERTURB_LAYER - 1, "token": PERTURB_AT, "tapped_only": True}
"""vLLM's decoder layer PERTURB_LAYER - 1 adds 0.5 to its output (layer PERTURB_LAYER's input) at position
PERTURB_AT, in a tapped engine only (``tests/vllm_seed/sitecustomize.py``, in vLLM's engine core)."""


def _worker(ckpt: str, out: str) -> None:
    """The vLLM jobs through the CLI's entry point; writes ``out/results.json`` (exit code, output per job).

    ``perturbed`` runs with :data:`PERTURB_SEED` in the processes vLLM starts, so the perturbation
    is in the tapped engine only (the reference engine has no tap); it runs eager, where vLLM
    keeps no compiled graph, so no cached graph can stand in for the perturbed model.
    """
    from dumper.cli.main import main
    from tests.dumper.engines.test_engine_vllm import seeded

    base, results = Path(out), {}
    ids = [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]
    run = [
        "run",
        "--engine",
        "vllm",
        "--model",
        ckpt,
        *ids,
        "--layers",
        "all",
        "--points",
        "input,k_cache,v_cache",  # the cache points read the engine's cache after each step: bit-exact too
        "--logprobs",
        "--observer-check",
        "--quiet",
    ]
    for name in VLLM_JOBS:
        stdout, stderr, start = io.StringIO(), io.StringIO(), time.perf_counter()
        with (
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            seeded(PERTURB_SEED) if name == "perturbed" else contextlib.nullcontext(),
        ):
            rc = main(
                [
                    *run,
                    *(() if name == "compiled" else ("--engine-arg", "enforce_eager=true")),
                    "--out",
                    str(base / name),
                ]
            )
        results[name] = {
            "rc": rc,
            "seconds": time.perf_counter() - start,
            "stdout": stdout.getvalue()[-2000:],
            "stderr": stderr.getvalue()[-3000:],
        }
    finish_worker(base, results)


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """(job directory root, worker results)."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-observer")
    ckpt = shared_checkpoint()  # the fixed path vLLM's compile cache already knows
    worker = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.dumper.jobs.test_observer_check import _worker; _worker({str(ckpt)!r}, {str(root)!r})",
        ],
        cwd=ROOT,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert_worker_done(worker.returncode, worker.stdout, root)
    return root, json.loads((root / "results.json").read_text())


@pytest.mark.engine
@pytest.mark.parametrize("job", ["eager", "compiled"])
def test_vllm_capture_is_bit_exact(vllm_runs, job, record_property):
    root, results = vllm_runs
    r = results[job]
    record_property(f"vllm_{job}_seconds", r["seconds"])
    assert r["rc"] == 0, r["stdout"] + r["stderr"]
    m = load_manifest(root / job)
    obs = m.extra["observer"]
    assert obs["bit_exact"] is True and obs["max_abs_diff"] == 0.0 and obs["compared"] == "logprobs"
    assert obs["values"] == _float_values(root / job, logits=False) == sum(len(p) - 1 for p in PROMPTS)
    assert m.extra["engine"]["settings"]["compiled"] is (job == "compiled")
    assert {t.point for t in m.tensors} >= {"input", "k_cache", "v_cache"}
    assert m.extra["kv_cache"]["readback"]["checked"] > 0 and m.extra["kv_cache"]["readback"]["failed"] == 0
    assert r["stdout"].strip() == f"observer check: bit-exact ({obs['values']} values: logprobs)"


@pytest.mark.engine
def test_vllm_a_perturbation_on_the_tapped_engine_is_caught(vllm_runs):
    root, results = vllm_runs
    r = results["perturbed"]
    assert r["rc"] == 1, r["stdout"] + r["stderr"]
    obs = load_manifest(root / "perturbed").extra["observer"]
    assert obs["bit_exact"] is False and obs["max_abs_diff"] > 0
    assert obs["sequence"] == 1 and obs["position"] > PERTURB_AT  # only prompt 1 reaches that position
    assert f"sequence 1, position {obs['position']}" in r["stdout"] and "capture changed the logprobs" in r["stdout"]
