"""Comparator throughput and memory against ``cat`` of the same files, in the same run.

Writes a baseline dump of ``--gib`` GiB (float32 [tokens, hidden] tensors, one sequence per
tensor, 32 layers per forward pass) and two targets holding the baseline plus small noise:
one in the same layout and one prefilled in ``--chunks`` chunks (each chunk its own forward
pass, as chunked prefill dumps). It warms the page cache, times ``compare_dumps`` of each
target (best of 3, each in a fresh process that samples its own anonymous RSS every 2 ms), and
what a user waits for, ``python -m comparator BASELINE TARGET --quiet`` with its start-up and
imports, in ``--rounds`` rounds interleaved with ``cat FILES > /dev/null`` (so that a machine whose
speed drifts slows both alike; ``--baseline-tree`` times an older checkout's CLI in the same
rounds). It prints throughput, the ratios to ``cat`` (issue 31's goal for the CLI: >= 0.9x, the
median of the per-round ratios) and of chunked to same-layout, ``python -c pass`` and the import
time beside them, and peak anonymous memory against 2 x largest tensor + 300 MB.

    python bench/bench_comparator.py [--gib 2] [--chunks 8] [--rounds 9] [--dir /tmp/driftscope-bench] [--keep]
    python bench/bench_comparator.py --reuse --keep --baseline-tree /tmp/old-checkout   # before/after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "peak_anon_kib": mem.peak // 1024,
                "start_anon_kib": start_rss // 1024,
                "matched": report.matched,
                "passed": report.passed,
            }
        )
    )


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
                    cap.record(
                        name, t, layer=i % layers, point="input", positions=range(tokens), sequence_ids=[seq] * tokens
                    )
                pending.append((name, i % layers, seq, y))
            for start in range(0, tokens, step):  # chunk k of every layer is forward pass k
                for name, layer, seq, y in pending:
                    stop = min(tokens, start + step)
                    cc.record(
                        name,
                        y[start:stop],
                        layer=layer,
                        point="input",
                        positions=range(start, stop),
                        sequence_ids=[seq] * (stop - start),
                    )
                cc.step()
            cb.step()
            cs.step()
    return base, same, chunked, tensor_bytes


def data_files(d: Path) -> list[str]:
    return sorted(str(p) for p in d.glob("*.safetensors"))


def cli_env(tree: Path, pycache: Path) -> dict[str, str]:
    """The environment of a ``python -m comparator`` run from ``tree`` (first on ``PYTHONPATH``), bytecode cached
    under ``pycache`` (as an installed wheel has it), even where ``PYTHONDONTWRITEBYTECODE`` is set."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(
        PYTHONPYCACHEPREFIX=str(pycache),
        PYTHONPATH=os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def time_rounds(commands: dict[str, tuple[list[str], dict[str, str] | None]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of each command, run once per round in turn (output discarded), so that a machine
    whose speed drifts during the run slows every command of a round alike."""
    times: dict[str, list[float]] = {label: [] for label in commands}
    for _ in range(rounds):
        for label, (argv, env) in commands.items():
            t = time.perf_counter()
            subprocess.run(argv, env=env, cwd="/", stdout=subprocess.DEVNULL, check=False)
            times[label].append(time.perf_counter() - t)
    return times


def ratio_line(times: dict[str, list[float]], label: str) -> str:
    """``label``'s speed as a fraction of cat's: the median of the per-round ratios, and of the best times."""
    per_round = sorted(c / t for c, t in zip(times["cat"], times[label], strict=True))
    return (
        f"{label}: best {min(times[label]):.3f}s, median {statistics.median(times[label]):.3f}s; "
        f"{statistics.median(per_round):.2f}x of cat (median of {len(per_round)} rounds), "
        f"{min(times['cat']) / min(times[label]):.2f}x best to best"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="size of each dump in GiB (default 2)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/driftscope-bench")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the chunked target (default 8)")
    ap.add_argument("--keep", action="store_true", help="keep the dumps afterwards")
    ap.add_argument("--reuse", action="store_true", help="reuse dumps already in --dir")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of cat and the CLI, interleaved (default 9)")
    ap.add_argument("--baseline-tree", help="also time the CLI of this older checkout, in the same rounds")
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
    subprocess.run(["cat", *files, *data_files(chunked)], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    results = {}
    for label, target in (("same layout", same), (f"{args.chunks} chunks", chunked)):
        runs = []
        for _ in range(3):
            out = subprocess.run(
                [sys.executable, __file__, "--compare-only", str(base), str(target)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[label] = runs
    cli = ["-m", "comparator", str(base), str(same), "--quiet"]
    commands = {
        "cat": (["cat", *files], None),
        "python -m comparator": ([sys.executable, *cli], cli_env(ROOT, root / "pycache")),
    }
    if args.baseline_tree:  # an older checkout (its kernel built in place), timed in the same rounds
        commands["baseline tree"] = ([sys.executable, *cli], cli_env(Path(args.baseline_tree), root / "pycache-base"))
    times = time_rounds(commands, args.rounds)
    cat_s = min(times["cat"])
    start = time_rounds(
        {
            "python -c pass": ([sys.executable, "-c", "pass"], cli_env(ROOT, root / "pycache")),
            "import": ([sys.executable, "-c", "import comparator.cli.main"], cli_env(ROOT, root / "pycache")),
        },
        5,
    )
    python_s, import_s = min(start["python -c pass"]), min(start["import"])
    bound_mb = 2 * tensor_bytes / 2**20 + 300
    print(
        f"data: {total / 2**30:.2f} GiB in {len(files)} files (baseline + same-layout target), "
        f"tensors of {tensor_bytes / 2**20:.0f} MiB"
    )
    print(
        f"cat FILES > /dev/null (warm): best {cat_s:.3f}s of {args.rounds}, "
        f"median {statistics.median(times['cat']):.3f}s "
        f"= {total / cat_s / 1e9:.2f} GB/s"
    )
    best = {}
    for label, runs in results.items():
        b = best[label] = min(runs, key=lambda r: r["seconds"])
        peak_mb = max(r["peak_anon_kib"] for r in runs) / 1024
        print(
            f"compare_dumps, {label}: best {b['seconds']:.3f}s of {[round(r['seconds'], 3) for r in runs]} "
            f"= {total / b['seconds'] / 1e9:.2f} GB/s, {cat_s / b['seconds']:.2f}x of cat; "
            f"{b['matched']} comparisons, passed={b['passed']}; peak anonymous RSS {peak_mb:.0f} MiB"
        )
    print("BASE TARGET --quiet, same layout, with start-up (goal >= 0.9x of cat):")
    for label in commands:
        if label != "cat":
            print(f"  {ratio_line(times, label)}")
    print(f"  of it python -c pass {python_s:.3f}s, + import comparator.cli.main {import_s - python_s:.3f}s")
    labels = list(best)
    print(
        f"chunked / same-layout speed: {best[labels[0]]['seconds'] / best[labels[1]]['seconds']:.2f}x (target >= 0.8x)"
    )
    print(
        f"memory bound 2 x largest tensor + 300 MB = {bound_mb:.0f} MiB "
        f"(process start {results[labels[0]][0]['start_anon_kib'] / 1024:.0f} MiB)"
    )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
