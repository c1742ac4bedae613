"""The invariance sweep on real vLLM: benign noise per axis, wall time per cell, and what engine reuse saves.

    python bench/bench_vllm_sweep.py [--dtypes float32,bfloat16] [--dir DIR] [--eager] [--grid KEY=V1,V2 ...]

For each dtype: a baseline ``python -m dumper run --engine vllm`` of two prompts (300 and 200
tokens, every layer, logprobs) in vLLM's default layout, then ``python -m dumper sweep`` over
``chunk_size=none,64 x max_num_seqs=1,4 x enable_prefix_caching=false,true x lengths=block``
(block = vLLM's KV block size, 128 on CPU: lengths 127, 128, 129, 255, 256, 257) against it.
Reported per axis value (every cell with that value): the largest per-token rel_diff over all
layers and the largest |Δlogprob| (prefix-caching cells have no logprobs: vLLM skips its cache
for prompt-logprob requests), which is the benign noise a calibration of these layouts needs;
and the sweep's wall time per cell, split into cells that started an engine and cells that
reused one (the lengths axis), with the time reuse saved (reused cells x the mean engine-start
cell time, minus what the reused cells took).

Uses the tests' checkpoint (4 layers, hidden 128). ``--eager`` runs the engines eager (as the
tests do); the default is vLLM's compiled mode. ``--grid`` replaces the grid above (e.g.
``--grid tensor_parallel_size=1,2`` for the noise of the tensor-parallel split).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tests.dumper.engines.test_engine_vllm import shared_checkpoint  # noqa: E402

GRID = ("chunk_size=none,64", "max_num_seqs=1,4", "enable_prefix_caching=false,true", "lengths=block")
_rng = np.random.default_rng(11)
PROMPTS = [[1] + _rng.integers(3, 300, 299).tolist(), [1] + _rng.integers(3, 300, 199).tolist()]


def _cli(*args: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, env=env)
    if r.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(map(str, args[:3]))} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def _noise(result: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per ``axis=value``: the largest per-token rel_diff and |Δlogprob| over the cells with that value."""
    out: dict[str, dict[str, float | None]] = defaultdict(lambda: {"max_token_rel_diff": 0.0, "max_abs_logprob": None})
    for cell in result["cells"]:
        report = json.loads(Path(cell["report"]).read_text())
        token = max((t.get("max_token_rel_diff") or 0.0 for t in report["tensors"]), default=0.0)
        lp = (cell.get("logprobs") or {}).get("max_abs_err")
        for key, value in cell["settings"].items():
            row = out[f"{key}={value}"]
            row["max_token_rel_diff"] = max(row["max_token_rel_diff"], token)
            if lp is not None:
                row["max_abs_logprob"] = max(row["max_abs_logprob"] or 0.0, lp)
    return dict(out)


def _times(result: dict[str, Any]) -> dict[str, float]:
    started = [c["wall_s"] for c in result["cells"] if not c["engine_reused"]]
    reused = [c["wall_s"] for c in result["cells"] if c["engine_reused"]]
    mean_start = statistics.mean(started) if started else 0.0
    return {
        "cells": len(result["cells"]),
        "engine_starts": len(started),
        "reused": len(reused),
        "mean_start_cell_s": mean_start,
        "mean_reused_cell_s": statistics.mean(reused) if reused else 0.0,
        "saved_s": len(reused) * mean_start - sum(reused),
        "sweep_wall_s": result["wall_s"],
    }


def run(dtype: str, work: Path, eager: bool, grid: tuple[str, ...] = GRID) -> dict[str, Any]:
    ckpt = shared_checkpoint()
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    mode = ("--engine-arg", "enforce_eager=true") if eager else ()
    base = work / f"base-{dtype}"
    _cli(
        "dumper",
        "run",
        "--engine",
        "vllm",
        "--model",
        ckpt,
        "--prompts",
        prompts,
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "5",
        "--dtype",
        dtype,
        "--engine-arg",
        "enable_prefix_caching=false",
        *mode,
        "--out",
        base,
        "--quiet",
    )
    out = work / f"sweep-{dtype}"
    start = time.perf_counter()
    r = _cli(
        "dumper",
        "sweep",
        "--engine",
        "vllm",
        "--model",
        ckpt,
        "--baseline",
        base,
        "--logprobs",
        "--top-k",
        "5",
        *mode,
        *(a for g in grid for a in ("--grid", g)),
        "--out",
        out,
        "--json",
        work / f"{dtype}.json",
        "--quiet",
    )
    result = json.loads((work / f"{dtype}.json").read_text())
    return {
        "dtype": dtype,
        "exit": r.returncode,
        "passed": result["passed"],
        "wall_s": time.perf_counter() - start,
        "failing": [c["name"] for c in result["cells"] if not c["passed"]],
        "noise": _noise(result),
        "times": _times(result),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--grid", action="append", default=None, help="a sweep axis KEY=V1,V2 (repeatable)")
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-vllm-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):
        res = run(dtype, work, args.eager, tuple(args.grid) if args.grid else GRID)
        t = res["times"]
        print(
            f"{dtype}: exit {res['exit']}, {t['cells']} cells in {t['sweep_wall_s']:.0f} s; "
            f"{t['engine_starts']} engine starts ({t['mean_start_cell_s']:.1f} s/cell), {t['reused']} reused "
            f"({t['mean_reused_cell_s']:.2f} s/cell): reuse saved {t['saved_s']:.0f} s; failing: {res['failing']}"
        )
        for axis, row in sorted(res["noise"].items()):
            lp = row["max_abs_logprob"]
            print(
                f"  {axis:32s} max per-token rel_diff {row['max_token_rel_diff']:.3e}   "
                f"max |dlogprob| {'n/a' if lp is None else f'{lp:.3e}'}"
            )
        (work / f"summary-{dtype}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
