"""Noise of the tiny presets, how many benign variants calibration needs, and what it costs.

For each preset and dtype it dumps a baseline (eager, one pass per prompt) and benign variants
(SDPA, chunked prefill, padded batches, one thread), all with ``--layers all --logprobs``, then:

1. the noise table: ``calibrate`` with every variant (per layer: rel_diff and per-token max);
2. variants needed: calibrate with the first n variants and judge each variant NOT used
   (default factor) -- how many of them still fail, per n;
3. cost: calibrating with k variants against k plain comparisons, measured in the same run.

    python bench/bench_calibrate.py [--models tiny-llama,tiny-qwen2] [--dtypes float32,bfloat16]
    python bench/bench_calibrate.py --timing-gib 1     # cost only, on bench_comparator's synthetic dumps
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comparator import CompareConfig, compare_dumps  # noqa: E402
from comparator.noise.calibrate import calibrate  # noqa: E402

VARIANTS = [
    ("sdpa", ["--attn", "sdpa"], {}),
    ("chunk64", ["--chunk-size", "64"], {}),
    ("batch2", ["--batch-size", "2"], {}),
    ("chunk37-sdpa", ["--chunk-size", "37", "--attn", "sdpa"], {}),
    ("threads1", [], {"OMP_NUM_THREADS": "1"}),
    ("batch3-left", ["--batch-size", "3", "--padding-side", "left"], {}),
    ("chunk16", ["--chunk-size", "16"], {}),
]


def dump(out: Path, model: str, dtype: str, args: list[str], env: dict[str, str]) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "dumper",
        "run",
        "--model",
        model,
        "--dtype",
        dtype,
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "5",
        "--save-logits",
        "--quiet",
        "--out",
        str(out),
        *args,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, **env})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-llama,tiny-qwen2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--timing-gib",
        type=float,
        default=None,
        help="only time calibrate against plain comparisons on synthetic dumps of this size",
    )
    args = ap.parse_args()
    if args.timing_gib:
        return timing(args.timing_gib)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                root = Path(tmp) / f"{model}-{dtype}"
                base = dump(root / "base", model, dtype, [], {})
                variants = [(name, dump(root / name, model, dtype, a, e)) for name, a, e in VARIANTS]
                report(model, dtype, base, variants)


def report(model: str, dtype: str, base: Path, variants: list[tuple[str, Path]]) -> None:
    paths = [p for _, p in variants]
    t0 = time.perf_counter()
    noise = calibrate(base, paths)
    t_cal = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in paths:
        compare_dumps(base, p)
    t_cmp = time.perf_counter() - t0
    print(f"\n## {model} {dtype}: noise from {len(paths)} variants ({', '.join(n for n, _ in variants)})")
    print("| layer | rel_diff | per-token max | per-token p99 |")
    print("|---|---|---|---|")
    for t in noise.tensors.values():
        print(f"| {t.layer} | {t.rel_diff:.2e} | {t.token_max:.2e} | {t.token_p99:.2e} |")
    if noise.logprobs is not None:
        print("logprob noise: " + ", ".join(f"{k} {v:.2e}" for k, v in noise.logprobs.metrics.items() if v is not None))
    print(
        f"calibrate: {t_cal:.2f} s for {len(paths)} variants; {len(paths)} plain comparisons: {t_cmp:.2f} s "
        f"(ratio {t_cal / t_cmp:.2f}x per variant)"
    )
    for order, vs in (("listed order", variants), ("reversed order", variants[::-1])):
        held_out(base, vs, order)


def held_out(base: Path, variants: list[tuple[str, Path]], order: str) -> None:
    """Calibrate with the first n variants, judge the rest (default factor): how many still fail."""
    print(f"\nvariants in {order} ({', '.join(n for n, _ in variants)})")
    print("| variants used | held-out failing (hidden) | failing (logprobs) | worst held-out per-token / noise max |")
    print("|---|---|---|---|")
    for n in range(1, len(variants)):
        cal = calibrate(base, [p for _, p in variants[:n]])
        fails_h = fails_l = 0
        worst = 0.0
        for _, p in variants[n:]:
            r = compare_dumps(base, p, CompareConfig(noise=cal))
            fails_h += not all(t.passed for t in r.tensors)
            fails_l += r.logprobs is not None and not r.logprobs.passed
            for t in r.tensors:  # the held-out value over the calibrated max, floor aside
                noise = cal.tensor(t.name)
                if noise is not None and t.max_token_rel_diff > 0:
                    worst = max(worst, t.max_token_rel_diff / noise.token_max if noise.token_max else float("inf"))
        rest = len(variants) - n
        print(f"| {n} | {fails_h}/{rest} | {fails_l}/{rest} | {worst:.3g}x |")


def timing(gib: float) -> None:
    """calibrate with two variants (same layout, chunked) against the two plain comparisons, best of 3."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_comparator import make_dumps

    with tempfile.TemporaryDirectory() as tmp:
        base, same, chunked, _ = make_dumps(Path(tmp), gib, 4096, 1024, 8)
        plain = min(_timed(lambda: [compare_dumps(base, t) for t in (same, chunked)]) for _ in range(3))
        cal = min(_timed(lambda: calibrate(base, [same, chunked])) for _ in range(3))
        print(
            f"{gib:g} GiB baseline, 2 variants: calibrate {cal:.2f} s, 2 plain comparisons {plain:.2f} s "
            f"(ratio {cal / plain:.2f}x per variant)"
        )


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
