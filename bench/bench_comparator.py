"""Comparator throughput and memory against ``cat`` of the same files, in the same run.

Writes two dumps of ``--gib`` GiB each (float32 [tokens, hidden] tensors; the target is the
baseline plus small noise), warms the page cache, times ``cat FILES > /dev/null`` (best of 3)
and ``compare_dumps`` (best of 3, each in a fresh process that samples its own anonymous RSS
every 2 ms), and prints throughput, the ratio to ``cat``, and peak anonymous memory against
the bound 2 x largest tensor + 300 MB.

    python bench/bench_comparator.py [--gib 2] [--dir /tmp/driftscope-bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def compare_only(base: str, target: str) -> None:
    """Child process: one timed comparison with anonymous-RSS sampling; prints JSON."""
    sys.path.insert(0, str(ROOT))
    from comparator import compare_dumps

    peak = [_rss_anon_kib()]
    start_rss = peak[0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon_kib())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    report = compare_dumps(base, target)
    elapsed = time.perf_counter() - t
    stop.set()
    th.join()
    peak[0] = max(peak[0], _rss_anon_kib())
    print(json.dumps({"seconds": elapsed, "peak_anon_kib": peak[0], "start_anon_kib": start_rss,
                      "matched": report.matched, "passed": report.passed}))


def make_dumps(root: Path, gib: float, tokens: int, hidden: int) -> tuple[Path, Path, int]:
    import torch

    import dumper

    torch.set_num_threads(2)
    tensor_bytes = tokens * hidden * 4
    count = max(1, int(round(gib * 2**30 / tensor_bytes)))
    gen = torch.Generator().manual_seed(0)
    base, target = root / "baseline", root / "target"
    for path in (base, target):
        shutil.rmtree(path, ignore_errors=True)
    with dumper.capture(None, base) as cb, dumper.capture(None, target) as ct:
        for i in range(count):
            x = torch.randn(tokens, hidden, generator=gen)
            y = x + 1e-4 * torch.randn(tokens, hidden, generator=gen)
            for cap, t in ((cb, x), (ct, y)):
                cap.record(f"model.layers.{i % 32}.self_attn.input", t, layer=i % 32, point="input",
                           positions=range(tokens), sequence_ids=[i // 32] * tokens)
            if i % 32 == 31:
                cb.step()
                ct.step()
    return base, target, tensor_bytes


def data_files(d: Path) -> list[str]:
    return sorted(str(p) for p in d.glob("*.safetensors"))


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
    ap.add_argument("--keep", action="store_true", help="keep the dumps afterwards")
    ap.add_argument("--reuse", action="store_true", help="reuse dumps already in --dir")
    ap.add_argument("--compare-only", nargs=2, metavar=("BASE", "TARGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare_only:
        compare_only(*args.compare_only)
        return
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    if args.reuse and (root / "baseline" / "manifest.json").exists():
        base, target, tensor_bytes = root / "baseline", root / "target", args.tokens * args.hidden * 4
    else:
        t = time.perf_counter()
        base, target, tensor_bytes = make_dumps(root, args.gib, args.tokens, args.hidden)
        print(f"wrote two dumps in {time.perf_counter() - t:.1f}s")
    files = data_files(base) + data_files(target)
    total = sum(os.path.getsize(f) for f in files)
    time_cat(files)  # warm the page cache
    cat_s = time_cat(files)
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, __file__, "--compare-only", str(base), str(target)],
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["seconds"])
    peak_mb = max(r["peak_anon_kib"] for r in runs) / 1024
    bound_mb = 2 * tensor_bytes / 2**20 + 300
    print(f"data: {total / 2**30:.2f} GiB in {len(files)} files ({best['matched']} tensor pairs of "
          f"{tensor_bytes / 2**20:.0f} MiB), verdict passed={best['passed']}")
    print(f"cat FILES > /dev/null (warm): {cat_s:.3f}s = {total / cat_s / 1e9:.2f} GB/s")
    print(f"compare_dumps: best {best['seconds']:.3f}s of {[round(r['seconds'], 3) for r in runs]} "
          f"= {total / best['seconds'] / 1e9:.2f} GB/s")
    print(f"ratio to cat: {cat_s / best['seconds']:.2f}x (target >= 0.5x)")
    print(f"peak anonymous RSS: {peak_mb:.0f} MiB (process start {runs[0]['start_anon_kib'] / 1024:.0f} MiB); "
          f"bound 2 x largest tensor + 300 MB = {bound_mb:.0f} MiB")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
