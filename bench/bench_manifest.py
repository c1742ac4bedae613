"""What validating a manifest costs: ``load_manifest`` against a bare ``json.loads`` of the same file.

Builds a synthetic dump of ``--records`` tensor records (one real safetensors data file; the
records look like the dumper's: 32 layers per forward pass, positions and sequence ids), then
times, best of ``--repeat`` and interleaved, ``json.loads(manifest.json)`` (the floor any
reader pays) and ``dumper.format.load_manifest`` (parse + every check of
:mod:`dumper.format.validate` + the record objects), and prints the ratio and the traced peak of each.

    python bench/bench_manifest.py [--records 100000] [--repeat 7] [--dir /tmp/driftscope-manifest-bench]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dumper.format import MANIFEST_NAME, load_manifest  # noqa: E402

DATA = "r0-p000000-000.safetensors"


def build(d: Path, n: int) -> None:
    """A dump of ``n`` [2, 4] float32 tensors in one data file, with a dumper-shaped manifest."""
    d.mkdir(parents=True, exist_ok=True)
    save_file({f"t{i}": np.full((2, 4), i, dtype=np.float32) for i in range(n)}, str(d / DATA))
    recs = [
        {
            "name": f"model.layers.{i % 32}.self_attn.input",
            "file": DATA,
            "key": f"t{i}",
            "shape": [2, 4],
            "dtype": "F32",
            "forward_pass": i // 32,
            "rank": 0,
            "call": 0,
            "layer": i % 32,
            "point": "input",
            "positions": [[0, 2]],
            "sequence_ids": [[i // 32, 2]],
            "shard_dim": None,
            "meta": {},
        }
        for i in range(n)
    ]
    m = {
        "format_version": 1,
        "created_at": "2026-12-01T00:00:00+00:00",
        "model": {"name": "bench", "config_hash": None, "weights_hash": None},
        "capture_signature": {},
        "environment": {},
        "files": {DATA: (d / DATA).stat().st_size},
        "extra": {},
        "tensors": recs,
    }
    (d / MANIFEST_NAME).write_text(json.dumps(m, indent=1))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peak(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/driftscope-manifest-bench")
    args = ap.parse_args()
    d = Path(args.dir) / str(args.records)
    if not (d / MANIFEST_NAME).exists():
        build(d, args.records)
    path = d / MANIFEST_NAME

    def bare() -> object:
        return json.loads(path.read_bytes())

    def full() -> object:
        return load_manifest(d)

    best = {"json.loads": float("inf"), "load_manifest": float("inf")}
    for _ in range(args.repeat):
        best["json.loads"] = min(best["json.loads"], _timed(bare))
        best["load_manifest"] = min(best["load_manifest"], _timed(full))
    peaks = {"json.loads": _peak(bare), "load_manifest": _peak(full)}
    print(f"{args.records} records, manifest {path.stat().st_size / 2**20:.1f} MiB, best of {args.repeat}")
    for k in best:
        print(f"  {k:14s} {best[k]:7.3f} s   traced peak {peaks[k] / 2**20:6.0f} MiB")
    print(
        f"  load_manifest / json.loads: time {best['load_manifest'] / best['json.loads']:.2f}x, "
        f"peak {peaks['load_manifest'] / peaks['json.loads']:.2f}x"
    )


if __name__ == "__main__":
    main()
