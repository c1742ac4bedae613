"""Each real engine against HF fp32 on one tiny checkpoint: dump time, rel_diff and max |Δlogprob|.

    python bench/bench_engines.py [--init 0.02] [--engines vllm,llama.cpp,onnxruntime-genai] [--out DIR]

Builds the tests' tiny Llama (tests/engine_models.py; ``--init`` is the weights' std: 0.02 gives
near-uniform logits, 0.2 peaked ones as a trained model has), dumps the HF fp32 reference with
``python -m dumper run`` and every engine mode listed below with ``--engine``, each as one CLI
subprocess (so the wall time includes imports and engine start, as a user sees it), then judges
each against the reference with ``python -m comparator --json``. Prints one row per mode:
dump wall seconds (and the HF dump's, measured in the same run, as the baseline), the
self-attention input rel_diff range per layer, the largest per-token rel_diff, max |Δlogprob|
and the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engine_models import build_checkpoint, engine_missing, to_gguf  # noqa: E402

JOB = ["--layers", "all", "--logprobs", "--top-k", "5", "--quiet"]


def modes(work: Path, ckpt: Path) -> dict[str, tuple[str, list[str], str]]:
    """mode -> (engine, extra run args, what to prepare: '' | 'gguf:TYPE' | 'onnx:PRECISION')."""
    return {
        "vllm fp32": ("vllm", ["--model", str(ckpt)], ""),
        "vllm bf16": ("vllm", ["--model", str(ckpt), "--dtype", "bfloat16"], ""),
        "llama.cpp f32, f32 KV": (
            "llama.cpp",
            ["--model", str(work / "f32.gguf"), "--engine-arg", f"hf_dir={ckpt}"],
            "gguf:f32",
        ),
        "llama.cpp f32, f16 KV": (
            "llama.cpp",
            ["--model", str(work / "f32.gguf"), "--engine-arg", f"hf_dir={ckpt}", "--engine-arg", "kv=f16"],
            "gguf:f32",
        ),
        "llama.cpp q8_0": (
            "llama.cpp",
            ["--model", str(work / "q8_0.gguf"), "--engine-arg", f"hf_dir={ckpt}"],
            "gguf:q8_0",
        ),
        "onnxruntime-genai fp32": (
            "onnxruntime-genai",
            ["--model", str(work / "ort-fp32"), "--engine-arg", f"hf_dir={ckpt}"],
            "onnx:fp32",
        ),
        "onnxruntime-genai int8": (
            "onnxruntime-genai",
            ["--model", str(work / "ort-int8"), "--engine-arg", f"hf_dir={ckpt}"],
            "onnx:int8",
        ),
    }


def prepare(what: str, work: Path, ckpt: Path) -> None:
    kind, _, arg = what.partition(":")
    if kind == "gguf" and not (work / f"{arg}.gguf").exists():
        to_gguf(ckpt, work / f"{arg}.gguf", arg)
    elif kind == "onnx" and not (work / f"ort-{arg}").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(ckpt),
                "-o",
                str(work / f"ort-{arg}"),
                "-p",
                arg,
                "-e",
                "cpu",
                "-c",
                str(work / "ort-cache"),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )


def dump(args: list[str], out: Path) -> float:
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "dumper", "run", *args, *JOB, "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if r.returncode != 0:
        raise SystemExit(f"dump failed: {' '.join(args)}\n{r.stderr[-2000:]}")
    return time.perf_counter() - start


def judge(ref: Path, target: Path) -> dict:
    report = target.with_suffix(".json")
    subprocess.run(
        [sys.executable, "-m", "comparator", str(ref), str(target), "--json", str(report), "--quiet"],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    d = json.loads(report.read_text())
    layers: dict[int, list[float]] = {}
    for t in d["tensors"]:
        layers.setdefault(t["layer"], []).append(t["rel_diff"])
    return {
        "layers": {k: (min(v), max(v)) for k, v in sorted(layers.items())},
        "token_max": max(t["max_token_rel_diff"] for t in d["tensors"]),
        "max_dlogprob": ((d.get("logprobs") or {}).get("max_abs_err") or {}).get("value"),
        "passed": d["passed"],
        "first": d.get("first_divergent"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", type=float, default=0.02, help="weights' std (initializer_range)")
    ap.add_argument("--engines", default="vllm,llama.cpp,onnxruntime-genai")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    a = ap.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="bench-engines-"))
    ckpt = work / "ckpt"
    if not ckpt.exists():
        build_checkpoint(ckpt, initializer_range=a.init)
    wanted = set(a.engines.split(","))
    base = dump(["--model", str(ckpt)], work / "hf")
    print(f"checkpoint {ckpt} (std {a.init}); HF fp32 dump {base:.1f} s (baseline)")
    print(
        f"{'mode':26} {'dump s':>7} {'x HF':>5}  {'rel_diff per layer (min..max)':58} {'token max':>9} "
        f"{'max|dlp|':>9}  verdict"
    )
    for name, (engine, args, what) in modes(work, ckpt).items():
        if engine not in wanted:
            continue
        why = engine_missing(engine)
        if why:
            print(f"{name:26} skipped: {why}")
            continue
        prepare(what, work, ckpt)
        out = work / name.replace(" ", "_").replace(",", "")
        secs = dump(["--engine", engine, *args], out)
        r = judge(work / "hf", out)
        span = " ".join(f"{lo:.1e}..{hi:.1e}" for lo, hi in r["layers"].values())
        verdict = "PASS" if r["passed"] else f"DIVERGED at layer {(r['first'] or {}).get('layer')}"
        dlp = r["max_dlogprob"]
        print(
            f"{name:26} {secs:7.1f} {secs / base:5.2f}  {span:58} {r['token_max']:9.1e} "
            f"{dlp if dlp is None else format(dlp, '9.1e')}  {verdict}"
        )


if __name__ == "__main__":
    main()
