"""Real engines on a real trained model: vLLM judged against its own benign noise, vLLM and llama.cpp against HF.

SmolLM2-135M-Instruct (:mod:`tests.real_model`: a float32 HF directory and the Q4_1 GGUF it was dequantized
from) on its three real prompts (``--prompts`` of ``write_prompts``), every layer, points
``input,attn_output,mlp_input,mlp_output``. One engine runs at a time, each vLLM job in a process of its own.

1. vLLM, compiled (its default), bfloat16. A baseline (all prompts batched in one step), three calibration
   variants from vLLM's own settings (chunked prefill of 16 tokens, ``max_num_seqs=1``, ``enforce_eager=true``;
   each one's largest per-token rel_diff is printed: 0 means bit-identical, no noise), then
   ``python -m comparator calibrate`` (pooled and per-row noise). Judged against that noise, with row noise
   and with the pooled noise alone (``dataclasses.replace(noise, rows=None)``):
   - benign variants outside the calibration (chunks of 24, compiled and eager): PASS or FALSE ALARM, and the
     worst token_noise_ratio;
   - bugs seeded inside vLLM's own code (``tests/vllm_seed``), each its own engine with the baseline's
     settings: LlamaMLP of layer 8 and LlamaAttention of layer 20 add a constant to every element of one
     token's row, sized to 5% of that row's norm in the baseline dump (add = 0.05 x norm / sqrt(576)):
     is each named at its layer, point and token?
   Each engine start (``vllm.LLM(...)``: load, compile or compile-cache hit, KV-cache profiling) is timed.
2. The HF float32 reference (``python -m dumper run --dtype float32``), vLLM's bfloat16 baseline and llama.cpp
   (the Q4_1 GGUF, ``hf_dir=``) judged against it with the fixed thresholds: the verdict line of
   ``python -m comparator REF TARGET --quiet`` (where it names the first divergence).

Prints the whole bench's wall time. Dumps already in ``--out`` are reused (their engine not started again).

    python bench/bench_real_engines.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.real_model import missing, real_prompt_ids, row_norms, smollm2_dir, smollm2_gguf, write_prompts

POINTS = "input,attn_output,mlp_input,mlp_output"
SEED_DIR = ROOT / "tests" / "vllm_seed"
MARK = "@@bench "
CALIBRATION = {"chunk-16": {"chunk_size": 16}, "seqs-1": {"max_num_seqs": 1}, "eager": {"enforce_eager": "true"}}
BENIGN = {"chunk-24": {"chunk_size": 24}, "eager-chunk-24": {"enforce_eager": "true", "chunk_size": 24}}
BUGS = {"mlp": (8, "mlp_output", 30), "attn": (20, "attn_output", 33)}
"""``where`` of the seed -> (layer, point it is named at, token). The MLP bug hits row ``token`` of the engine step
(position ``token`` of sequence 0 in the batched baseline), the attention bug position ``token`` of every prompt."""
FRACTION = 0.05


def _worker(spec: dict) -> None:
    """One vLLM job in this process: time ``LLM(...)`` and the capture; print them (or a one-line error)."""
    from dumper.engines.base import hf_identity, job_sequences
    from dumper.engines.vllm.engine import dump_llm, engine_kwargs, load_llm, release_llm
    from dumper.prefill.run import RunConfig

    try:
        ckpt = Path(spec["model"])
        cfg = RunConfig(
            out=spec["out"],
            model=str(ckpt),
            input_ids=tuple(map(tuple, spec["ids"])),
            layers="all",
            points=tuple(POINTS.split(",")),
            dtype="bfloat16",
            engine="vllm",
            chunk_size=spec.get("chunk_size"),
            engine_args=tuple((k, str(spec[k])) for k in ("max_num_seqs", "enforce_eager") if k in spec),
        )
        identity = hf_identity(ckpt, cfg.model)
        seqs = job_sequences(cfg, ckpt, int(identity.get("vocab_size") or 0))
        kw = engine_kwargs(cfg, ckpt, seqs)
        if "seed" in spec:  # a compiled engine with the seed needs its own graph (see tests/vllm_seed)
            kw["additional_config"] = {**kw["additional_config"], "test_seeded_bug": spec["seed"]}
        t = time.perf_counter()
        llm = load_llm(kw)
        start = time.perf_counter() - t
        dump_llm(llm, cfg, seqs, ckpt, identity=identity)
        print(MARK + json.dumps({"start": start, "dump": time.perf_counter() - t - start}), flush=True)
        del llm
        release_llm()
    except Exception as e:  # noqa: BLE001 - reported as one line by the parent
        line = (str(e) or type(e).__name__).strip().splitlines()[0]
        print(
            MARK + json.dumps({"error": f"{type(e).__name__}: {line}", "trace": traceback.format_exc()[-2000:]}),
            flush=True,
        )


def vllm_job(out: Path, name: str, model: Path, ids: list, **spec: object) -> dict:
    """Run :func:`_worker` in a subprocess (the seed in its environment); its result, with the process's wall time."""
    if (out / name / "manifest.json").is_file():
        print(f"vllm {name:14} reused {out / name}")
        return {"reused": True}
    env = dict(os.environ)
    if "seed" in spec:
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), str(SEED_DIR), env.get("PYTHONPATH")))),
            DRIFTSCOPE_TEST_SEED=json.dumps(spec["seed"]),
        )
    job = json.dumps({"out": str(out / name), "model": str(model), "ids": ids, **spec})
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, __file__, "--vllm-job", job], env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(MARK)]
    res = (
        json.loads(lines[-1][len(MARK) :])
        if lines
        else {"error": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"}
    )
    if "error" in res:
        print(f"vllm {name:14} FAILED after {wall:.1f}s: {res['error']}")
    else:
        print(
            f"vllm {name:14} engine start {res['start']:6.1f}s  capture {res['dump']:5.1f}s  "
            f"process {wall:6.1f}s (rc {r.returncode})"
        )
    return {**res, "wall": wall}


def cli(*args: str) -> tuple[int, str, float]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return r.returncode, (r.stdout + r.stderr).strip(), time.perf_counter() - t


def judge(base: Path, target: Path, noise: object) -> tuple[object, float]:
    """The report of ``target`` against ``base`` under ``noise`` and its worst token_noise_ratio."""
    from comparator import CompareConfig, compare_dumps

    report = compare_dumps(base, target, CompareConfig(noise=noise))
    ratios = [t.token_noise_ratio for t in report.tensors if t.token_noise_ratio is not None]
    return report, max(ratios, default=math.nan)


def where(fd: object) -> str:
    return "-" if fd is None else f"layer {fd.layer} {fd.point} seq {fd.sequence} token {fd.token}"


def calibrated(out: Path, model: Path, ids: list, hidden: int) -> None:
    """Part 1: vLLM's baseline, calibration, a benign variant and the seeded bugs, judged by row and pooled noise."""
    from comparator import load_noise

    print("== 1. vLLM compiled bfloat16 against its own noise")
    jobs = {"base": {}, **CALIBRATION}
    results = {name: vllm_job(out, name, model, ids, **spec) for name, spec in jobs.items()}
    if "error" in results["base"]:
        return print("vLLM cannot run the real model: part 1 skipped")
    ok = [out / n for n in CALIBRATION if "error" not in results[n]]
    (out / "N").mkdir(exist_ok=True)
    rc, text, took = cli(
        "comparator", "calibrate", str(out / "base"), *map(str, ok), "--out", str(out / "N" / "NOISE.json"), "--quiet"
    )
    print(f"calibrate ({len(ok)} variants): exit {rc}, {took:.1f}s" + (f": {text}" if rc else ""))
    if rc:
        return
    tensors = json.loads((out / "N" / "NOISE.json").read_text())["tensors"]
    print(
        "  largest per-token rel_diff vs base: "
        + ", ".join(f"{p.name} {max(t['by_variant'][i] for t in tensors):.2e}" for i, p in enumerate(ok))
    )
    noise = load_noise(out / "N" / "NOISE.json")
    rules = {"row noise": noise, "pooled noise": dataclasses.replace(noise, rows=None)}
    for name, spec in BENIGN.items():
        if "error" not in vllm_job(out, name, model, ids, **spec):
            for rule, n in rules.items():
                report, worst = judge(out / "base", out / name, n)
                verdict = "PASS" if report.passed else f"FALSE ALARM at {where(report.first_divergent)}"
                print(f"  benign {name} by {rule:12}: {verdict}; worst token_noise_ratio {worst:.2f}")
    for kind, (layer, point, token) in BUGS.items():
        norms = row_norms(out / "base", layer, point, token)
        add = FRACTION * norms[0] / math.sqrt(hidden)
        seed = {"layer": layer, "token": token, "add": round(add, 6), "where": kind}
        share = ", ".join(f"seq {s}: {add * math.sqrt(hidden) / v:.1%}" for s, v in sorted(norms.items()))
        name = f"bug-{kind}-L{layer}"
        print(
            f"{name}: add {seed['add']} per element = fraction of the row norm at {point} token {token}: "
            f"{share if kind == 'attn' else share.split(',')[0]}"
        )
        if "error" in vllm_job(out, name, model, ids, seed=seed):
            continue
        for rule, n in rules.items():
            report, _ = judge(out / "base", out / name, n)
            fd = report.first_divergent
            named = fd is not None and (fd.layer, fd.point, fd.token) == (layer, point, token)
            hit = [t for t in report.tensors if t.layer == layer and t.point == point and t.token_noise_ratio]
            ratio = max((t.token_noise_ratio for t in hit), default=math.nan)
            print(
                f"  by {rule:12}: {'NAMED' if named else 'MISSED' if fd is None else 'OTHER'} "
                f"(first divergence: {where(fd)}); its tensor's token_noise_ratio {ratio:.1f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="a folder of its own for the dumps (reused when present)")
    ap.add_argument("--vllm-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_job:
        return _worker(json.loads(args.vllm_job))
    if args.out is None:
        ap.error("--out is required")
    if missing():
        sys.exit(f"error: {missing()}")
    t_all = time.perf_counter()
    model, gguf, out = smollm2_dir(), smollm2_gguf(), args.out
    out.mkdir(parents=True, exist_ok=True)
    prompts, ids = write_prompts(out / "prompts.jsonl", model), real_prompt_ids(model)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    print(f"SmolLM2-135M-Instruct ({model}); prompts {[len(s) for s in ids]} tokens; points {POINTS}; all layers\n")

    calibrated(out, model, ids, hidden)

    print("\n== 2. against HF float32, fixed thresholds")
    dumps = {
        "hf-fp32": ("dumper", "run", "--model", str(model), "--dtype", "float32"),
        "llama-cpp": (
            "dumper",
            "run",
            "--engine",
            "llama.cpp",
            "--model",
            str(gguf),
            "--engine-arg",
            f"hf_dir={model}",
        ),
    }
    for name, cmd in dumps.items():
        if (out / name / "manifest.json").is_file():
            print(f"{name:14} reused {out / name}")
            continue
        rc, text, took = cli(
            *cmd, "--prompts", str(prompts), "--layers", "all", "--points", POINTS, "--quiet", "--out", str(out / name)
        )
        print(f"{name:14} dump {took:.1f}s" + (f" FAILED (exit {rc}): {text.splitlines()[-1]}" if rc else ""))
    for name in ("base", "llama-cpp"):
        if not (out / name / "manifest.json").is_file() or not (out / "hf-fp32" / "manifest.json").is_file():
            print(f"hf-fp32 vs {name}: no dump")
            continue
        rc, text, _ = cli("comparator", str(out / "hf-fp32"), str(out / name), "--quiet")
        print(f"hf-fp32 vs {'vllm-bf16' if name == 'base' else name} (exit {rc}):\n  " + text.replace("\n", "\n  "))
    print(f"\nwhole bench: {time.perf_counter() - t_all:.1f}s")


if __name__ == "__main__":
    main()
