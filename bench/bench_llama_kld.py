"""llama.cpp KL-divergence base files: streamed comparison throughput and peak memory against file size.

Writes two synthetic base files in llama-perplexity's format (``comparator.logprobs.sources.llama_kld.write_kld``):
``--vocab`` entries per row, ``--chunks`` chunks of ``--n-ctx`` tokens, so ``chunks x (n_ctx/2 - 1)``
scored rows (default 65536 x 16 x 512: 4080 rows, 0.53 GB per file) from random logits, the
target with noise added. It times ``cat`` of both files (page cache warm, best of 3) and
``compare_logprob_sources(base, target)`` in a fresh process (best of 3), which samples its own
anonymous RSS every 2 ms and reads its peak RSS (VmHWM) from /proc; both are printed against
the size of the files, to show that the comparison streams them and never holds one whole.

    python bench/bench_llama_kld.py [--vocab 65536] [--n-ctx 512] [--chunks 16] [--dir /tmp/driftscope-kld] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def compare_only(base: str, target: str) -> None:
    """Child process: one timed comparison with RSS sampling; prints JSON."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from anonpeak import AnonPeak

    from comparator.logprobs.judge import compare_logprob_sources

    before_hwm, before_anon = _status("VmHWM"), AnonPeak.now()
    with AnonPeak() as mem:
        t = time.perf_counter()
        v = compare_logprob_sources(base, target)
        seconds = time.perf_counter() - t
    print(
        json.dumps(
            {
                "seconds": seconds,
                "anon_before": before_anon,
                "anon_peak": mem.peak,
                "hwm_before": before_hwm,
                "hwm_after": _status("VmHWM"),
                "positions": v.compared_positions,
                "kl_mean": v.kl_mean,
                "same_top": v.llama.same_top_rate if v.llama else None,
            }
        )
    )


def _blocks(rows: int, vocab: int, seed: int, noise: float, block: int = 256) -> Iterator:
    import numpy as np

    base, extra = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    for lo in range(0, rows, block):
        n = min(block, rows - lo)
        x = (2.0 * base.standard_normal((n, vocab))).astype(np.float32)
        if noise:
            x += (noise * extra.standard_normal((n, vocab))).astype(np.float32)
        yield x


def write_files(d: Path, vocab: int, n_ctx: int, chunks: int) -> tuple[Path, Path, float]:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from comparator.logprobs.sources.llama_kld import write_kld

    tokens = np.random.default_rng(7).integers(0, vocab, size=(chunks, n_ctx))
    rows = chunks * (n_ctx - 1 - n_ctx // 2)
    t = time.perf_counter()
    base, target = d / "base.kld", d / "target.kld"
    write_kld(base, tokens, _blocks(rows, vocab, 0, 0.0))
    write_kld(target, tokens, _blocks(rows, vocab, 0, 0.1))
    return base, target, time.perf_counter() - t


def best(cmd: list[str], n: int = 3) -> tuple[float, str]:
    runs = []
    for _ in range(n):
        t = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append((time.perf_counter() - t, out))
    return min(runs, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--dir", default="/tmp/driftscope-kld")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--compare-only", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare_only:
        compare_only(*args.compare_only)
        return
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    try:
        base, target, write_s = write_files(d, args.vocab, args.n_ctx, args.chunks)
        size = base.stat().st_size + target.stat().st_size
        cat_s, _ = best(["sh", "-c", f"cat {base} {target} > /dev/null"])
        cmd = [sys.executable, __file__, "--compare-only", str(base), str(target)]
        runs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout) for _ in range(3)]
        r = min(runs, key=lambda x: x["seconds"])
        rows = args.chunks * (args.n_ctx - 1 - args.n_ctx // 2)
        mib = 2**20
        print(
            f"two base files: {rows} rows x {args.vocab} vocab each, {size / 2**30:.2f} GiB together "
            f"(written in {write_s:.1f}s)"
        )
        print(f"cat (warm page cache): {cat_s:.2f}s, {size / cat_s / 2**30:.2f} GiB/s")
        print(
            f"compare_logprob_sources: {r['seconds']:.2f}s, {size / r['seconds'] / 2**30:.2f} GiB/s, "
            f"{2 * rows / r['seconds']:.0f} rows/s; {r['seconds'] / cat_s:.1f}x cat"
        )
        print(
            f"  peak anonymous RSS {r['anon_peak'] / mib:.0f} MiB ({(r['anon_peak'] - r['anon_before']) / mib:.0f} "
            f"MiB over the {r['anon_before'] / mib:.0f} MiB after imports); peak RSS (VmHWM) "
            f"{r['hwm_after'] / mib:.0f} MiB ({(r['hwm_after'] - r['hwm_before']) / mib:.0f} MiB over imports) "
            f"against {size / mib:.0f} MiB of files ({(r['hwm_after'] - r['hwm_before']) / size:.1%})"
        )
        print(f"  verdict: {r['positions']} positions, KL mean {r['kl_mean']:.4g}, same top {r['same_top']:.4f}")
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
