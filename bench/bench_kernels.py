"""Throughput of comparator.hidden.kernels.row_stats and metrics.pair_stats, per storage dtype.

GB/s counts the input bytes of both sides divided by wall time, with warm (already touched)
memory. The torch baseline (float32 only) widens to float64 and masks non-finite pairs with
the same semantics, using the same number of intra-op threads.

``--baseline DIR`` times an older build in the same process, interleaved run by run with the
current one: DIR holds copies of an older ``comparator/hidden/kernels.py``, ``metrics.py`` and the
``_kernels*.so`` built from its ``_kernels.c``; the ``vs base`` column is current throughput
over baseline throughput (1.00 = same speed). ``row_stats`` is the kernel with its thread
split; ``row_stats/scaled`` the same returning scaled sums (what the metrics use);
``pair_stats`` the whole metric path of one tensor.

Usage::

    python bench/bench_kernels.py                      # 8192x1024 blocks, ~1 GB per dtype
    python bench/bench_kernels.py --rows 4096 --total-gb 2 --threads 1 2
    mkdir /tmp/old && cp comparator/hidden/kernels.py comparator/hidden/metrics.py comparator/_kernels*.so /tmp/old
    # ... change and rebuild the kernel, then:
    python bench/bench_kernels.py --baseline /tmp/old --no-torch --dtypes F32 BF16 F64
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comparator.hidden import kernels, metrics  # noqa: E402

ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}


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
    return best_times({"": fn}, repeat)[""]


def best_times(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best wall time of each function over ``repeat`` rounds, the functions interleaved.

    Interleaving run by run makes a comparison fair on a shared, noisy machine: a slow
    spell hits every contender alike.
    """
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def load_baseline(directory: Path) -> types.ModuleType:
    """Import DIR/{kernels,metrics}.py and DIR's _kernels*.so as the package ``ds_baseline``.

    Each copy is made to use the others, not this tree's: the extension is loaded from DIR,
    and ``comparator.hidden.kernels`` / ``comparator._kernels`` point at the copies while
    they are imported.
    """
    pkg = types.ModuleType("ds_baseline")
    pkg.__path__ = [str(directory)]
    sys.modules["ds_baseline"] = pkg
    so = next(directory.glob("_kernels*.so"), None)
    if so is None:
        raise SystemExit(f"{directory}: no _kernels*.so in the baseline copy")
    spec = importlib.util.spec_from_file_location("ds_baseline._kernels", so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    import comparator

    names = ("comparator._kernels", "comparator.hidden.kernels")
    saved = {n: sys.modules.get(n) for n in names}
    saved_attr = getattr(comparator, "_kernels", None)
    try:
        sys.modules["comparator._kernels"] = ext
        comparator._kernels = ext  # `from comparator import _kernels` reads the attribute first
        base_kernels = importlib.import_module("ds_baseline.kernels")
        sys.modules["comparator.hidden.kernels"] = base_kernels
        importlib.import_module("ds_baseline.metrics")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        comparator._kernels = saved_attr
    if base_kernels._kernels is not ext:
        raise SystemExit(f"{directory}: the baseline kernels.py did not load its own extension")
    return pkg


def make_blocks(dtype: str, rows: int, cols: int, total_gb: float, scale: float = 1.0) -> tuple[list, list, float]:
    """Random block pairs of raw storage dtype ``dtype`` (y = x + 1e-3 noise), ~total_gb input.

    ``scale`` multiplies F64 values (1e300 or 1e-300 time the rescaled kernel path).
    """
    pair_bytes = 2 * rows * cols * ITEMSIZE[dtype]
    n_blocks = max(1, round(total_gb * 1e9 / pair_bytes))
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for _ in range(n_blocks):
        x = rng.standard_normal((rows, cols), dtype=np.float64 if dtype == "F64" else np.float32)
        y = x + x.dtype.type(1e-3) * rng.standard_normal(x.shape, dtype=x.dtype)
        if dtype == "F64":
            x, y = x * scale, y * scale
        elif dtype == "BF16":
            x, y = ((v.view(np.uint32) >> 16).astype(np.uint16) for v in (x, y))
        elif dtype == "F16":
            x, y = x.astype(np.float16), y.astype(np.float16)
        xs.append(x)
        ys.append(y)
    return xs, ys, n_blocks * pair_bytes / 1e9


def contenders(
    xs: list, ys: list, dtype: str, threads: int, baseline: types.ModuleType | None
) -> dict[str, Callable[[], object]]:
    """The timed functions for one dtype and thread count (current, and baseline if given)."""
    pairs = list(zip(xs, ys, strict=True))
    fns: dict[str, Callable[[], object]] = {
        "row_stats": lambda: [kernels.row_stats(x, y, dtype, threads=threads) for x, y in pairs],
        "row_stats/scaled": lambda: [kernels.row_stats(x, y, dtype, threads=threads, scaled=True) for x, y in pairs],
        "pair_stats": lambda: [metrics.pair_stats(x, y, dtype, threads=threads) for x, y in pairs],
    }
    if baseline is not None:
        bk, bm = baseline.kernels, baseline.metrics
        fns["row_stats@base"] = lambda: [bk.row_stats(x, y, dtype, threads=threads) for x, y in pairs]
        fns["pair_stats@base"] = lambda: [bm.pair_stats(x, y, dtype, threads=threads) for x, y in pairs]
    return fns


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192, help="rows per block")
    p.add_argument("--cols", type=int, default=1024, help="columns (hidden size)")
    p.add_argument("--total-gb", type=float, default=1.0, help="input bytes of both sides, all blocks, per dtype")
    p.add_argument("--dtypes", nargs="+", default=["F32"], choices=sorted(ITEMSIZE), help="storage dtypes to time")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each kernel contender (best is kept)")
    p.add_argument("--torch-repeat", type=int, default=1, help="timed runs of the (slow) torch baseline")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--baseline", type=Path, help="directory with an older kernels.py, metrics.py, _kernels*.so")
    p.add_argument("--f64-scale", type=float, default=1.0, help="multiply F64 inputs (1e300: the rescaled path)")
    args = p.parse_args(argv)

    baseline = load_baseline(args.baseline) if args.baseline else None
    print(
        f"extension={'yes' if kernels.HAVE_EXTENSION else 'NO (numpy fallback)'}"
        f"{f', baseline={args.baseline}' if baseline else ''}"
    )
    print(f"{'dtype':<5} {'impl':<17} {'threads':>7} {'time s':>8} {'GB/s':>7} {'vs base':>8} {'vs torch':>8}")
    for dtype in args.dtypes:
        xs, ys, gb = make_blocks(dtype, args.rows, args.cols, args.total_gb, args.f64_scale)
        for threads in args.threads:
            t = best_times(contenders(xs, ys, dtype, threads, baseline), args.repeat)
            if dtype == "F32" and not args.no_torch:
                torch.set_num_threads(threads)
                t["torch"] = best_time(lambda: [torch_row_stats(x, y) for x, y in zip(xs, ys)], args.torch_repeat)
            for name, sec in sorted(t.items(), key=lambda kv: kv[0].endswith("@base")):
                base = t.get(name.split("/")[0] + "@base") if not name.endswith("@base") else None
                vs_base = f"{base / sec:.3f}" if base else "-"
                vs_torch = f"{t['torch'] / sec:.1f}x" if "torch" in t else "-"
                print(f"{dtype:<5} {name:<17} {threads:>7} {sec:>8.3f} {gb / sec:>7.2f} {vs_base:>8} {vs_torch:>8}")


if __name__ == "__main__":
    main()
