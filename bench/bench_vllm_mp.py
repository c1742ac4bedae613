"""Capture in vLLM's default multiprocess engine: TP=2 vs TP=1 wall time, and capture overhead.

    python bench/bench_vllm_mp.py [--reps 5] [--mib 32] [--tokens 512] [--dtype float32] [--skip-tp]
                                  [--fresh-cache] [--dir DIR] [--hidden H --layers L | --prompts N]
                                  [--new-tokens T] [--points input,...]

Every engine is ``dumper.engines.vllm.engine_kwargs`` of one prefill job (``max_tokens=1``, no
logprobs, every layer captured) on the tests' checkpoint
(``tests.dumper.engines.test_engine_vllm.shared_checkpoint``: 4 layers, hidden 128, fp32), or with
``--hidden``/``--layers`` a random Llama of that size (heads of 64, half as many KV heads, MLP
2.75x hidden; written once under the temp dir, so that vLLM's compile cache keeps its graphs), in
vLLM's default mode (multiprocess, compiled), each in a worker subprocess of its own that answers
timed requests on stdin. The job is prompts of ``--tokens`` random ids: ``--prompts`` of them, or
as many as make ``--mib`` MiB of captured ``self_attn.input`` rows on one rank.

The issue's realistic case: ``--hidden 1024 --layers 8 --prompts 32 --tokens 512 --skip-tp``
(fp32 and ``--dtype bfloat16``), where a forward pass costs what it costs for a model of that size.
``--new-tokens T`` makes every job a greedy decode of T tokens per prompt (``max_tokens=T``), its
T-1 decode steps captured too (docs/decode.md): (b) is then decode capture against a plain
``generate`` of the same T tokens.

(a) TP=2 vs TP=1. The tapped engine with ``tensor_parallel_size`` 1 and 2: engine start
    (``LLM(...)``: spawning the engine core and workers, loading, compiling or loading the
    compiled graph from vLLM's cache) and one captured job (``dump_llm``: marked requests, every
    rank's part waited for, joined, manifest written), reported apart and summed. Engine start
    loads the compiled graph from vLLM's cache when an earlier run left it; ``--fresh-cache``
    gives every engine an empty cache, so that it includes compiling.
(b) Capture overhead, TP=1. *captured*: ``dump_llm``'s steps on the tapped engine, each timed (the
    outputs back, the ranks' parts waited for, the dump joined); *tapped*: the same
    engine's ``generate`` of the same prompts without the marker (the tap is in the graph, no
    request is recorded); *plain*: an engine built without the tap (``tap=False``), otherwise the
    same. The three are timed in turn (plain, tapped, captured, ...) after one warm-up each, the
    prefix cache emptied before every run (a run that still hit it is an error: every run is a full
    prefill); medians over ``--reps`` and their ratios.

Timings on a shared machine are noisy: read the ratios, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
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

MARK = "@@bench "
"""Prefix of the worker's result lines on stdout (vLLM may print there too)."""
LAYERS, HIDDEN = 4, 128
"""The tests' checkpoint (tests/engine_models.py)."""
KV_GIB = "4"
"""``VLLM_CPU_KVCACHE_SPACE`` of a bigger model's engines: room for every prompt of the job at once."""


# -- worker (one engine per process) ----------------------------------------------------------


def _prompts(count: int, tokens: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[1] + rng.integers(3, 300, tokens - 1).tolist() for _ in range(count)]


def worker(spec: dict[str, Any]) -> None:
    """Build one engine (timed), then answer ``{"run": "captured"|"generate"}`` lines with one timed job each."""
    from dumper.engines.vllm.engine import _generate, _join, engine_kwargs, load_llm
    from dumper.engines.vllm.parts import new_token, remove_spool, spool_root, wait_parts
    from dumper.prefill.run import RunConfig

    ckpt, seqs, out = Path(spec["ckpt"]), _prompts(spec["prompts"], spec["tokens"]), Path(spec["out"])
    args = (("tensor_parallel_size", str(spec["tp"])),)
    cfg = RunConfig(
        out="unused",
        model=str(ckpt),
        dtype=spec["dtype"],
        layers="all",
        engine="vllm",
        engine_args=args,
        new_tokens=spec.get("new_tokens", 0),
        points=tuple(spec.get("points", "input").split(",")),
    )
    start = time.perf_counter()
    llm = load_llm(engine_kwargs(cfg, ckpt, seqs, tap=spec["tap"]))
    _reply({"construct_s": time.perf_counter() - start})
    for i, line in enumerate(sys.stdin):
        what = json.loads(line)["run"]
        target = out / f"d{i}"
        t0 = time.perf_counter()
        if what == "captured":  # dump_llm's steps, each timed: outputs back, every part written, the dump joined
            llm.reset_prefix_cache()
            directory = spool_root() / new_token()
            outs = _generate(llm, cfg, seqs, token=directory.name)
            t1 = time.perf_counter()
            parts = wait_parts(directory)
            t2 = time.perf_counter()
            m = _join(dataclasses.replace(cfg, out=str(target)), seqs, ckpt, parts, outs, None)
            remove_spool(directory)
            dt = time.perf_counter() - t0
            rows = [t for t in m.tensors if t.point == "input"]
            got = {
                "bytes": sum(t.nbytes for t in rows),
                "ranks": len({t.rank for t in rows}),
                "phases": (t1 - t0, t2 - t1, dt - (t2 - t0)),
            }
            shutil.rmtree(target)
            cached = sum(m.extra["prefix_cache_hits"])
        else:
            llm.reset_prefix_cache()
            outs = _generate(llm, cfg, seqs, logprobs=False)
            dt, got = time.perf_counter() - t0, {}
            cached = sum(int(o.num_cached_tokens or 0) for o in outs)
        if cached:
            raise RuntimeError(f"{cached} prompt tokens came from the prefix cache: not a full prefill")
        _reply({"seconds": dt, **got})


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    """A worker subprocess holding one engine; :meth:`run` times one job in it."""

    def __init__(self, spec: dict[str, Any], fresh_cache: Path | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if spec["hidden"] != HIDDEN:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_GIB)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the model in other processes
        if fresh_cache is not None:  # nothing compiled before: the engine start includes compiling
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=fresh_cache))
            env.update(VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
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

    def run(self, what: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"run": what}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


# -- (a) and (b) ------------------------------------------------------------------------------


def _median_of(worker: Worker, what: str, reps: int) -> tuple[float, list[float], dict[str, Any]]:
    samples, last = [], {}
    for _ in range(reps):
        last = worker.run(what)
        samples.append(last["seconds"])
    return statistics.median(samples), samples, last


def overhead(args: argparse.Namespace, base: dict[str, Any]) -> tuple[dict[str, Any], Worker]:
    """(b): medians of plain, tapped and captured runs, interleaved; returns the tapped TP=1 worker for (a)."""
    plain = Worker({**base, "tap": False, "tp": 1}, args.fresh)
    tapped = Worker({**base, "tap": True, "tp": 1}, args.fresh)
    try:
        first = tapped.run("captured")  # warm-ups: first-call costs
        plain.run("generate"), tapped.run("generate")
        p, t, c, got, phases = [], [], [], {}, []
        for _ in range(args.reps):  # interleaved, so that drift of the machine hits all three alike
            p.append(plain.run("generate")["seconds"])
            t.append(tapped.run("generate")["seconds"])
            got = tapped.run("captured")
            c.append(got["seconds"])
            phases.append(got["phases"])
    except BaseException:
        tapped.close()
        raise
    finally:
        plain.close()
    print(f"  seconds: plain {_fmt(p)}; tapped {_fmt(t)}; captured {_fmt(c)}", flush=True)
    return {
        "plain": p,
        "tapped": t,
        "captured": c,
        "bytes": got["bytes"],
        "first_captured": first["seconds"],
        "phases": [statistics.median(x) for x in zip(*phases, strict=True)],
        "construct": tapped.construct_s,
        "construct_plain": plain.construct_s,
    }, tapped


def tensor_parallel(args: argparse.Namespace, base: dict[str, Any], tp1: Worker, res: dict[str, Any]) -> dict:
    """(a): the TP=2 tapped engine's start and captured job, beside TP=1's (the worker of (b))."""
    tp2 = Worker({**base, "tap": True, "tp": 2}, args.fresh)
    try:
        first2 = tp2.run("captured")
        c1, c2 = [], []
        for _ in range(args.reps):
            c1.append(tp1.run("captured")["seconds"])
            got = tp2.run("captured")
            c2.append(got["seconds"])
    finally:
        tp2.close()
    print(f"  captured seconds: TP=1 {_fmt(c1)}; TP=2 {_fmt(c2)}", flush=True)
    return {
        "construct": (res["construct"], tp2.construct_s),
        "first": (res["first_captured"], first2["seconds"]),
        "median": (statistics.median(c1), statistics.median(c2)),
        "minimum": (min(c1), min(c2)),
        "bytes2": got["bytes"],
        "ranks2": got["ranks"],
    }


def _fmt(samples: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in samples)


def report(args: argparse.Namespace, n: int, res: dict[str, Any], tp: dict[str, Any] | None) -> None:
    mp, mt, mc = (statistics.median(res[k]) for k in ("plain", "tapped", "captured"))
    lp, lt, lc = (min(res[k]) for k in ("plain", "tapped", "captured"))
    decode = f", then {args.new_tokens} greedy tokens each" if args.new_tokens else ""
    print(
        f"\nvLLM {args.dtype}, multiprocess engine, compiled; {n} prompts x {args.tokens} tokens{decode}; "
        f"{res['bytes'] / 2**20:.1f} MiB of captured rows per job (TP=1); {os.cpu_count()} CPUs"
    )
    print(f"\n(b) capture overhead, TP=1, {args.reps} runs each (minima: the runs least disturbed by the machine)")
    print(
        f"{'':8} {'plain s':>8} {'tapped s':>8} {'capt. s':>8} {'capt/tapped':>11} {'capt/plain':>10} "
        f"{'tapped/plain':>12}"
    )
    for name, (a, b, c) in (("median", (mp, mt, mc)), ("minimum", (lp, lt, lc))):
        print(f"{name:8} {a:8.3f} {b:8.3f} {c:8.3f} {c / b:11.3f} {c / a:10.3f} {b / a:12.3f}")
    gen, wait, join = res["phases"]
    print(
        f"captured job (medians): generate {gen:.3f} s (outputs back), parts {wait:.3f} s (the ranks' last "
        f"writes), join {join:.3f} s (data files moved in, manifest)"
    )
    cache = "each compiling anew (--fresh-cache)" if args.fresh_cache else "vLLM's compile cache as it was"
    print(f"engine start ({cache}): tapped {res['construct']:.1f} s, plain {res['construct_plain']:.1f} s")
    if tp is None:
        return
    print(
        f"\n(a) TP=2 vs TP=1, tapped engine, captured job (TP=2: {tp['bytes2'] / 2**20:.1f} MiB on "
        f"{tp['ranks2']} ranks)"
    )
    print(f"{'':26} {'TP=1 s':>8} {'TP=2 s':>8} {'TP2/TP1':>8}")
    rows = (
        ("engine start", tp["construct"]),
        ("captured job (median)", tp["median"]),
        ("captured job (minimum)", tp["minimum"]),
        ("start + first captured job", tuple(a + b for a, b in zip(tp["construct"], tp["first"], strict=True))),
    )
    for name, (one, two) in rows:
        print(f"{name:26} {one:8.2f} {two:8.2f} {two / one:8.2f}")


# -- main -------------------------------------------------------------------------------------


def checkpoint(hidden: int, layers: int) -> Path:
    """The tests' checkpoint, or a random Llama of ``hidden`` x ``layers`` (built once, at a fixed path)."""
    from tests.dumper.engines.test_engine_vllm import shared_checkpoint
    from tests.engine_models import build_checkpoint

    if (hidden, layers) == (HIDDEN, LAYERS):
        return shared_checkpoint()
    heads = max(1, hidden // 64)
    size = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": hidden // heads,
    }
    return shared_checkpoint(f"bench-h{hidden}-l{layers}", lambda out: build_checkpoint(out, **size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=float, default=32.0, help="captured MiB per job on one rank (default 32)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per prompt (default 512)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-tp", action="store_true", help="only (b)")
    ap.add_argument(
        "--fresh-cache",
        action="store_true",
        help="each engine compiles anew (its own empty VLLM_CACHE_ROOT); default: vLLM's usual cache",
    )
    ap.add_argument("--dir", default=None, help="where to write dumps (default: a temp dir)")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN}: the tests' model)")
    ap.add_argument("--layers", type=int, default=LAYERS, help=f"decoder layers (default {LAYERS})")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per job (default: as many as --mib makes)")
    ap.add_argument(
        "--points",
        default="input",
        help="capture points, comma-separated (default input; "
        "input,attn_output,mlp_input,mlp_output: the points inside a layer too)",
    )
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        help="greedy tokens per prompt, decode steps captured too (default 0: a prefill, max_tokens=1)",
    )
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    root = Path(args.dir or tempfile.mkdtemp(prefix="driftscope-bench-mp-"))
    root.mkdir(parents=True, exist_ok=True)
    per_prompt = (
        len(args.points.split(",")) * args.tokens * args.layers * args.hidden * (4 if args.dtype == "float32" else 2)
    )
    n = args.prompts or max(1, round(args.mib * 2**20 / per_prompt))
    base = {
        "ckpt": str(checkpoint(args.hidden, args.layers)),
        "tokens": args.tokens,
        "prompts": n,
        "dtype": args.dtype,
        "out": str(root),
        "hidden": args.hidden,
        "new_tokens": args.new_tokens,
        "points": args.points,
    }
    args.fresh = root if args.fresh_cache else None
    try:
        res, tp1 = overhead(args, base)
        try:
            tp = None if args.skip_tp else tensor_parallel(args, base, tp1, res)
        finally:
            tp1.close()
        report(args, n, res, tp)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
