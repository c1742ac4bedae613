"""Comparator throughput and memory against ``cat`` of the same files, in the same run.

Writes a baseline dump of ``--gib`` GiB (float32 [tokens, hidden] tensors, one sequence per
tensor, 32 layers per forward pass) and two targets holding the baseline plus small noise:
one in the same layout and one prefilled in ``--chunks`` chunks (each chunk its own forward
pass, as chunked prefill dumps). It warms the page cache, times ``cat FILES > /dev/null``
(best of 3) and ``compare_dumps`` of each target (best of 3, each in a fresh process that
samples its own anonymous RSS every 2 ms), and prints throughput, the ratios to ``cat`` and
of chunked to same-layout, and peak anonymous memory against 2 x largest tensor + 300 MB.
It also times what a user waits for, ``python -m comparator BASELINE TARGET --quiet`` with
its start-up and imports (best of 5, beside ``python -c pass`` on the same interpreter), and
its ratio to ``cat`` (issue 31's goal: >= 0.9x).

    python bench/bench_comparator.py [--gib 2] [--chunks 8] [--dir /tmp/driftscope-bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compare_only(base: str, target: str) -> None:
    """Child process: one timed comparison with anonymous-RSS sampling; prints JSON."""
    sys.path.insert(0, str(ROOT))
    from anonpeak import AnonPeak  # bench/ is on sys.path when run as a script

    from comparator import compare_dumps

    with AnonPeak() as mem:
        start_rss = mem.peak
        t = time.perf_counter()
        report = compare_dumps(base, target)
        elapsed = time.perf_counter() - t
    print(json.dumps({"seconds": elapsed, "peak_anon_kib": mem.peak // 1024, "start_anon_kib": start_rss // 1024,
                      "matched": report.matched, "passed": report.passed}))


def make_dumps(root: Path, gib: float, tokens: int, hidden: int, chunks: int) -> tuple[Path, Path, Path, int]:
    import torch

    import dumper

    torch.set_num_threads(2)
    tensor_bytes = tokens * hidden * 4
    count = max(1, int(round(gib * 2**30 / tensor_bytes)))
    gen = torch.Generator().manual_seed(0)
    base, same, chunked = root / "baseline", root / "target", root / "target-chunked"
    for path in (base, same, chunked):
        shutil.rmtree(path, ignore_errors=True)
    step = -(-tokens // chunks)
    layers = 32
    with dumper.capture(None, base) as cb, dumper.capture(None, same) as cs, dumper.capture(None, chunked) as cc:
        for group in range(0, count, layers):  # one group = one sequence through `layers` layers
            pending = []
            for i in range(group, min(count, group + layers)):
                x = torch.randn(tokens, hidden, generator=gen)
                y = x + 1e-4 * torch.randn(tokens, hidden, generator=gen)
                name, seq = f"model.layers.{i % layers}.self_attn.input", group // layers
                for cap, t in ((cb, x), (cs, y)):
                    cap.record(name, t, layer=i % layers, point="input", positions=range(tokens),
                               sequence_ids=[seq] * tokens)
                pending.append((name, i % layers, seq, y))
            for start in range(0, tokens, step):  # chunk k of every layer is forward pass k
                for name, layer, seq, y in pending:
                    stop = min(tokens, start + step)
                    cc.record(name, y[start:stop], layer=layer, point="input", positions=range(start, stop),
                              sequence_ids=[seq] * (stop - start))
                cc.step()
            cb.step()
            cs.step()
    return base, same, chunked, tensor_bytes


def data_files(d: Path) -> list[str]:
    return sorted(str(p) for p in d.glob("*.safetensors"))


def time_cli(argv: list[str], pycache: Path, repeat: int = 5) -> float:
    """Best wall time of ``python argv...`` with this tree first on ``PYTHONPATH``, output discarded; bytecode
    cached under ``pycache`` (as an installed wheel has it), even where ``PYTHONDONTWRITEBYTECODE`` is set."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPYCACHEPREFIX=str(pycache),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, *argv], env=env, cwd="/", stdout=subprocess.DEVNULL, check=False)
        best = min(best, time.perf_counter() - t)
    return best


def time_cat(files: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="size of each dump in GiB (default 2)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/driftscope-bench")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the chunked target (default 8)")
    ap.add_argument("--keep", action="store_true", help="keep the dumps afterwards")
    ap.add_argument("--reuse", action="store_true", help="reuse dumps already in --dir")
    ap.add_argument("--compare-only", nargs=2, metavar=("BASE", "TARGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare_only:
        compare_only(*args.compare_only)
        return
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    base, same, chunked = root / "baseline", root / "target", root / "target-chunked"
    tensor_bytes = args.tokens * args.hidden * 4
    if not (args.reuse and (chunked / "manifest.json").exists()):
        t = time.perf_counter()
        make_dumps(root, args.gib, args.tokens, args.hidden, args.chunks)
        print(f"wrote three dumps in {time.perf_counter() - t:.1f}s")
    files = data_files(base) + data_files(same)
    total = sum(os.path.getsize(f) for f in files)
    time_cat(files + data_files(chunked))  # warm the page cache
    cat_s = time_cat(files)
    results = {}
    for label, target in (("same layout", same), (f"{args.chunks} chunks", chunked)):
        runs = []
        for _ in range(3):
            out = subprocess.run([sys.executable, __file__, "--compare-only", str(base), str(target)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[label] = runs
    cli_s = time_cli(["-m", "comparator", str(base), str(same), "--quiet"], root / "pycache")
    python_s = time_cli(["-c", "pass"], root / "pycache")
    import_s = time_cli(["-c", "import comparator.cli.main"], root / "pycache")
    bound_mb = 2 * tensor_bytes / 2**20 + 300
    print(f"data: {total / 2**30:.2f} GiB in {len(files)} files (baseline + same-layout target), "
          f"tensors of {tensor_bytes / 2**20:.0f} MiB")
    print(f"cat FILES > /dev/null (warm): {cat_s:.3f}s = {total / cat_s / 1e9:.2f} GB/s")
    best = {}
    for label, runs in results.items():
        b = best[label] = min(runs, key=lambda r: r["seconds"])
        peak_mb = max(r["peak_anon_kib"] for r in runs) / 1024
        print(f"compare_dumps, {label}: best {b['seconds']:.3f}s of {[round(r['seconds'], 3) for r in runs]} "
              f"= {total / b['seconds'] / 1e9:.2f} GB/s, {cat_s / b['seconds']:.2f}x of cat; "
              f"{b['matched']} comparisons, passed={b['passed']}; peak anonymous RSS {peak_mb:.0f} MiB")
    print(f"python -m comparator BASE TARGET --quiet, same layout: best {cli_s:.3f}s, {cat_s / cli_s:.2f}x of cat "
          f"(goal >= 0.9x); of it python -c pass {python_s:.3f}s, + import comparator.cli.main "
          f"{import_s - python_s:.3f}s")
    labels = list(best)
    print(f"chunked / same-layout speed: {best[labels[0]]['seconds'] / best[labels[1]]['seconds']:.2f}x "
          "(target >= 0.8x)")
    print(f"memory bound 2 x largest tensor + 300 MB = {bound_mb:.0f} MiB "
          f"(process start {results[labels[0]][0]['start_anon_kib'] / 1024:.0f} MiB)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
