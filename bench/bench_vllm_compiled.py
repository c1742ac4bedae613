"""Capture in compiled vLLM (the tap): overhead, compile time with and without it, eager-vs-compiled drift.

    python bench/bench_vllm_compiled.py [--reps 5] [--mib 32,256] [--tokens 512] [--layers 16]
                                        [--dtype float32] [--skip-overhead] [--skip-drift] [--reuse-cache] [--dir DIR]

(a) Overhead. One worker subprocess per engine (vLLM's process state stays in it), built from
    ``dumper.engines.vllm.engine_kwargs``: *plain* is ``tap=False``, *captured* is the tapped
    engine (``tap=True``, ``additional_config={"driftscope": {"layers": "all"}}``) with each
    ``generate`` inside ``dumper.capture(llm, ...)``; the engine config is otherwise the same.
    The checkpoint is ``tests.engine_models.build_checkpoint`` with ``--layers`` layers (hidden
    128), so that ``--mib`` MiB are captured per run from prompts of ``--tokens`` random ids
    (prefill only, ``max_tokens=1``; the prompt count is chosen to hit the target). The plain
    and captured workers of a mode are both alive and are timed alternately (plain, captured,
    plain, ...), the prefix cache emptied before each run; "captured" includes closing the
    capture (the last pass's write, fsync and manifest). Reported: median captured/plain over
    ``--reps`` runs (and minima), for vLLM's default compiled mode and, for reference, eager
    (``enforce_eager=True``). The goal in compiled mode is <= 1.05x.
(b) Compile time. Each worker's ``LLM(...)`` construction runs with a fresh ``VLLM_CACHE_ROOT``
    and ``TORCHINDUCTOR_CACHE_DIR`` (nothing cached): compiled plain vs compiled tapped is the
    tap's compile cost; the eager constructions are the load-only baseline.
(c) Drift. ``python -m dumper run --engine vllm --dtype bfloat16 --layers all --logprobs`` on the
    tests' default checkpoint (4 layers, hidden 128), two prompts of 96 tokens, once compiled and
    once with ``--engine-arg enforce_eager=true``; ``python -m comparator --json EAGER COMPILED``.
    Reported: the comparator's verdict and first divergent layer and token (with its onset), the
    first layer that is not bit-identical, the largest per-layer rel_diff and max |Δlogprob|.

Timings on a shared machine are noisy: read the medians as ratios measured in one run, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engine_models import build_checkpoint  # noqa: E402

HIDDEN = 128
MARK = "@@bench "
"""Prefix of the worker's result lines on stdout (vLLM may print there too)."""


# -- worker (one engine per process) ----------------------------------------------------------


def _prompts(count: int, tokens: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[1] + rng.integers(3, 300, tokens - 1).tolist() for _ in range(count)]


def worker(spec: dict[str, Any]) -> None:
    """Build one engine (timed), then answer ``{"prompts": n}`` lines on stdin with one timed ``generate``."""
    import torch

    import dumper
    from dumper.engines.vllm.engine import engine_kwargs, load_llm
    from dumper.prefill.run import RunConfig

    ckpt, tokens = Path(spec["ckpt"]), spec["tokens"]
    eager = (("enforce_eager", "true"),) if spec["eager"] else ()
    cfg = RunConfig(out="unused", model=str(ckpt), dtype=spec["dtype"], layers="all", engine="vllm", engine_args=eager)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # dumper.capture(llm): the in-process hook API
    start = time.perf_counter()
    llm = load_llm(engine_kwargs(cfg, ckpt, _prompts(1, tokens), tap=spec["tap"]))
    _reply({"construct_s": time.perf_counter() - start})
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    out = Path(spec["out"])
    for i, line in enumerate(sys.stdin):
        request = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(request["prompts"], tokens)]
        llm.reset_prefix_cache()
        captured = 0
        t0 = time.perf_counter()
        if spec["tap"] and request.get("capture", True):
            with torch.inference_mode(), dumper.capture(llm, out / f"d{i}", layers="all"):
                llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            captured = sum(f.stat().st_size for f in (out / f"d{i}").glob("*.safetensors"))
            shutil.rmtree(out / f"d{i}")
        else:
            llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
        _reply({"seconds": dt, "bytes": captured})


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    """A worker subprocess holding one engine; :meth:`run` times one ``generate`` in it."""

    def __init__(self, spec: dict[str, Any], root: Path, *, reuse_cache: bool = False) -> None:
        name = f"cache-{'eager' if spec['eager'] else 'compiled'}-{'tap' if spec['tap'] else 'plain'}"
        fresh = root / name if reuse_cache else Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "VLLM_CACHE_ROOT": str(fresh / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(fresh / "inductor"),
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.construct_s = self._read()["construct_s"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"worker exited with {self.proc.wait()} before answering")

    def run(self, prompts: int, *, capture: bool = True) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "capture": capture}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


# -- (a) and (b) ------------------------------------------------------------------------------


def overhead(args: argparse.Namespace, root: Path, ckpt: Path) -> tuple[list[tuple], dict[str, float]]:
    """Rows (mode, MiB, prompts, plain s, tapped s, captured s, captured/plain, ratio of minima), construct s."""
    elem = 4 if args.dtype == "float32" else 2
    per_prompt = args.tokens * args.layers * HIDDEN * elem
    rows, construct = [], {}
    for mode in ("compiled", "eager"):
        base = {"ckpt": str(ckpt), "tokens": args.tokens, "dtype": args.dtype, "eager": mode == "eager"}
        plain = Worker({**base, "tap": False, "out": str(root / "unused")}, root, reuse_cache=args.reuse_cache)
        tapped = Worker({**base, "tap": True, "out": str(root / f"dumps-{mode}")}, root, reuse_cache=args.reuse_cache)
        construct[f"{mode} plain"], construct[f"{mode} tapped"] = plain.construct_s, tapped.construct_s
        try:
            for mib in args.mib:
                n = max(1, round(mib * 2**20 / per_prompt))
                plain.run(n), tapped.run(n, capture=False), tapped.run(n)  # warm-up: first-call costs
                p, t, c, got = [], [], [], 0
                for _ in range(args.reps):  # interleaved, so that drift of the machine hits all three alike
                    p.append(plain.run(n)["seconds"])
                    t.append(tapped.run(n, capture=False)["seconds"])
                    res = tapped.run(n)
                    c.append(res["seconds"])
                    got = res["bytes"]
                mp, mt, mc = statistics.median(p), statistics.median(t), statistics.median(c)
                rows.append((mode, got / 2**20, n, mp, mt, mc, mc / mp, min(c) / min(p)))
                print(
                    f"  {mode} {got / 2**20:.0f} MiB, seconds: plain {_fmt(p)}; tapped {_fmt(t)}; captured {_fmt(c)}",
                    flush=True,
                )
        finally:
            plain.close(), tapped.close()
    return rows, construct


def _fmt(samples: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in samples)


def print_overhead(args: argparse.Namespace, rows: list[tuple], construct: dict[str, float]) -> None:
    print(
        f"\n(a) capture overhead, vLLM {args.dtype}, {args.layers} layers x hidden {HIDDEN}, "
        f"prompts of {args.tokens} tokens, median of {args.reps} (tapped: the tapped engine, no capture)"
    )
    print(
        f"{'mode':9} {'MiB':>6} {'prompts':>7} {'plain s':>8} {'tapped s':>8} {'capt. s':>8} "
        f"{'capt/plain':>10} {'of minima':>9}"
    )
    for mode, mib, n, mp, mt, mc, ratio, rmin in rows:
        print(f"{mode:9} {mib:6.1f} {n:7d} {mp:8.3f} {mt:8.3f} {mc:8.3f} {ratio:10.3f} {rmin:9.3f}")
    cached = " (REUSED caches: not compile times)" if args.reuse_cache else ", nothing cached (fresh VLLM_CACHE_ROOT)"
    print(f"\n(b) LLM() construction{cached}")
    for name, sec in construct.items():
        print(f"{name:16} {sec:7.1f} s")
    print(
        f"tap's compile cost: {construct['compiled tapped'] - construct['compiled plain']:+.1f} s "
        f"({construct['compiled tapped'] / construct['compiled plain']:.2f}x)"
    )


# -- (c) --------------------------------------------------------------------------------------


def drift(root: Path) -> dict[str, Any]:
    """Dump bf16 eager and compiled vLLM on the default checkpoint and summarize the comparator's JSON."""
    ckpt = build_checkpoint(root / "ckpt-default")
    prompts = root / "drift-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in _prompts(2, 96)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = [
        sys.executable,
        "-m",
        "dumper",
        "run",
        "--engine",
        "vllm",
        "--model",
        str(ckpt),
        "--dtype",
        "bfloat16",
        "--layers",
        "all",
        "--logprobs",
        "--prompts",
        str(prompts),
        "--quiet",
    ]
    for name, extra in (("eager", ["--engine-arg", "enforce_eager=true"]), ("compiled", [])):
        with open(root / f"{name}.log", "w") as log:
            subprocess.run(
                [*job, *extra, "--out", str(root / name)],
                env=env,
                check=True,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    report = root / "drift.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "comparator",
            "--json",
            str(report),
            "--quiet",
            str(root / "eager"),
            str(root / "compiled"),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode not in (0, 1):
        raise RuntimeError(res.stdout + res.stderr)
    summary = summarize(json.loads(report.read_text()))
    summary["first_differing_token"] = first_differing_token(
        root / "eager", root / "compiled", summary["first_nonzero_layer"]
    )
    return summary


def first_differing_token(base: Path, target: Path, layer: int | None) -> tuple[int, int] | None:
    """(sequence, position) of the earliest position whose row at ``layer`` is not bit-identical, if any."""
    import numpy as np

    from dumper.format.reader import DumpReader

    if layer is None:
        return None
    rb, rt = DumpReader(base), DumpReader(target)
    theirs = {(t.name, t.forward_pass): t for t in rb.manifest.tensors if t.layer == layer}
    found: list[tuple[int, int]] = []
    for t in rt.manifest.tensors:
        b = theirs.get((t.name, t.forward_pass))
        if b is None or t.layer != layer or b.row_positions().tolist() != t.row_positions().tolist():
            continue
        differs = np.any(rb.rows(b) != rt.rows(t), axis=1)
        found += [(int(s), int(p)) for s, p, d in zip(t.row_sequence_ids(), t.row_positions(), differs) if d]
    return min(found, key=lambda sp: (sp[1], sp[0])) if found else None


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Verdict, first divergence, first non-identical layer, largest per-layer rel_diff, max |Δlogprob|."""
    by_layer: dict[int, float] = {}
    for t in r["tensors"]:
        if t["layer"] is not None:
            by_layer[t["layer"]] = max(by_layer.get(t["layer"], 0.0), float(t["rel_diff"]))
    fd = r.get("first_divergent") or {}
    worst = max(by_layer, key=by_layer.get) if by_layer else None
    lp = (r.get("logprobs") or {}).get("max_abs_err") or {}
    return {
        "passed": r["passed"],
        "first_divergent_layer": fd.get("layer"),
        "token": fd.get("token"),
        "onset": fd.get("onset"),
        "first_nonzero_layer": next((k for k in sorted(by_layer) if by_layer[k] > 0), None),
        "worst_layer": worst,
        "worst_rel_diff": by_layer.get(worst),
        "worst_token": max(
            (t for t in r["tensors"] if t["layer"] == worst), key=lambda t: t["rel_diff"], default={}
        ).get("worst_token"),
        "max_abs_dlogprob": lp.get("value"),
        "dlogprob_at": (lp.get("sample"), lp.get("position")),
        "per_layer": by_layer,
    }


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=lambda s: [float(x) for x in s.split(",")], default=[32.0, 256.0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-drift", action="store_true")
    ap.add_argument(
        "--reuse-cache",
        action="store_true",
        help="keep each engine's compile cache under --dir between runs (then (b) is not a compile time)",
    )
    ap.add_argument("--dir", default=None, help="where to write checkpoints, caches and dumps (default: a temp dir)")
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    root = Path(args.dir or tempfile.mkdtemp(prefix="driftscope-bench-compiled-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if not args.skip_overhead:
            ckpt = build_checkpoint(
                root / "ckpt", hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=args.layers
            )
            print_overhead(args, *overhead(args, root, ckpt))
        if not args.skip_drift:
            d = drift(root)
            print("\n(c) vLLM bf16: eager (baseline) vs compiled (target), default test checkpoint")
            for key in (
                "passed",
                "first_divergent_layer",
                "token",
                "onset",
                "first_nonzero_layer",
                "first_differing_token",
                "worst_layer",
                "worst_rel_diff",
                "worst_token",
                "max_abs_dlogprob",
                "dlogprob_at",
            ):
                print(f"{key:22} {d[key]}")
            print("per-layer max rel_diff: " + ", ".join(f"{k}: {v:.3g}" for k, v in sorted(d["per_layer"].items())))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
