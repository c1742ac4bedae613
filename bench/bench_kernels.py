"""Throughput of comparator.kernels.row_stats on float32 blocks versus a naive torch version.

GB/s counts the input bytes of both sides divided by wall time, with warm (already touched)
memory. The torch baseline widens to float64 and masks non-finite pairs with the same
semantics, using the same number of intra-op threads.

Usage::

    python bench/bench_kernels.py                      # 8192x1024 blocks, ~1 GB total
    python bench/bench_kernels.py --rows 4096 --total-gb 2 --threads 1 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comparator import kernels  # noqa: E402


def torch_row_stats(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, float, float]:
    """Naive float64 torch equivalent of row_stats (per-row sums, max |d|, sum |d|)."""
    a, b = torch.from_numpy(x).double(), torch.from_numpy(y).double()
    fin = torch.isfinite(a) & torch.isfinite(b)
    d = torch.where(fin, a - b, 0.0)
    a, b = torch.where(fin, a, 0.0), torch.where(fin, b, 0.0)
    row = torch.stack([(d * d).sum(1), (a * a).sum(1), (b * b).sum(1), (a * b).sum(1)], 1)
    e = d.abs()
    return row, float(e.max()), float(e.sum())


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time of ``repeat`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192, help="rows per block")
    p.add_argument("--cols", type=int, default=1024, help="columns (hidden size)")
    p.add_argument("--total-gb", type=float, default=1.0, help="input bytes of both sides, all blocks")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=5, help="timed runs of row_stats (best is kept)")
    p.add_argument("--torch-repeat", type=int, default=1, help="timed runs of the (slow) torch baseline")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    args = p.parse_args(argv)

    pair_bytes = 2 * args.rows * args.cols * 4
    n_blocks = max(1, round(args.total_gb * 1e9 / pair_bytes))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((args.rows, args.cols), dtype=np.float32) for _ in range(n_blocks)]
    ys = [x + np.float32(1e-3) * rng.standard_normal(x.shape, dtype=np.float32) for x in xs]
    gb = n_blocks * pair_bytes / 1e9
    print(f"{n_blocks} blocks of {args.rows}x{args.cols} float32, {gb:.2f} GB input, "
          f"extension={'yes' if kernels.HAVE_EXTENSION else 'NO (numpy fallback)'}")

    print(f"{'impl':<10} {'threads':>7} {'time s':>8} {'GB/s':>7} {'vs torch':>9}")
    for threads in args.threads:
        t_k = best_time(lambda: [kernels.row_stats(x, y, "F32", threads=threads) for x, y in zip(xs, ys)],
                        args.repeat)
        t_t = 0.0
        if not args.no_torch:
            torch.set_num_threads(threads)
            t_t = best_time(lambda: [torch_row_stats(x, y) for x, y in zip(xs, ys)], args.torch_repeat)
            print(f"{'torch':<10} {threads:>7} {t_t:>8.3f} {gb / t_t:>7.2f} {1.0:>8.1f}x")
        ratio = "-" if args.no_torch else f"{t_t / t_k:.1f}x"
        print(f"{'row_stats':<10} {threads:>7} {t_k:>8.3f} {gb / t_k:>7.2f} {ratio:>9}")


if __name__ == "__main__":
    main()
