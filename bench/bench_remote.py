"""Dumps on an S3 API server against the same dumps on local disk, in the same run.

Starts moto's S3 server on 127.0.0.1 (:mod:`tests.s3_server`), writes a baseline and a target dump
of ``--mib`` MiB each (float32 [tokens, hidden] tensors, :func:`bench_comparator.make_dumps`) to
local disk and uploads both, then times in ``--rounds`` interleaved rounds:

- ``compare_dumps`` of the local pair; of the S3 pair read in place by ranged reads (what
  ``python -m comparator s3://... s3://...`` does, :mod:`dumper.format.remote_read`); and of the S3 pair
  through local copies (:func:`dumper.format.remote.fetched`, what ``calibrate`` and the run store still
  do): GB/s of the two dumps' bytes, the ratio to local, and the peak anonymous memory of each (each
  comparison in a fresh process);
- capture with ``python -m dumper run --out s3://...`` against ``--out DIR`` (tiny-llama, every layer,
  ``--tokens`` tokens): wall time of the CLI and the ratio.

    python bench/bench_remote.py [--mib 256] [--rounds 3] [--tokens 512]

moto is an in-process Python server on the same two cores: its numbers are a floor for a real S3
endpoint's overheads, not a measure of a network's bandwidth.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compare_child(base: str, target: str, copy: bool = False) -> None:
    """Child process: one timed comparison (URLs read in place, or through local copies with ``copy``) with
    anonymous-RSS sampling; prints JSON."""
    import contextlib

    from anonpeak import AnonPeak

    from comparator import compare_dumps
    from dumper.format.remote import fetched

    with AnonPeak() as mem:
        t = time.perf_counter()
        with (
            fetched(base) if copy else contextlib.nullcontext(base) as b,
            fetched(target) if copy else contextlib.nullcontext(target) as g,
        ):
            report = compare_dumps(b, g)
        elapsed = time.perf_counter() - t
    print(json.dumps({"seconds": elapsed, "peak_anon_mib": mem.peak / 2**20, "passed": report.passed}))


def _child(base: str, target: str, env: dict[str, str], copy: bool = False) -> dict:
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import bench_remote; "
        f"bench_remote.compare_child({base!r}, {target!r}, {copy!r})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dump(out: str, tokens: int, env: dict[str, str]) -> float:
    ids = ",".join(str(3 + i % 250) for i in range(tokens))
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dumper", "run", "--layers", "all", "--input-ids", ids, "--out", out, "--quiet"],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_comparator import make_dumps

    from dumper.format.remote import upload_dump
    from tests.s3_server import make_bucket, s3_server

    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp, s3_server() as env:
        root = Path(tmp)
        base, target, _, _ = make_dumps(root, args.mib / 1024, 1024, 1024, 1)
        nbytes = sum(f.stat().st_size for f in base.iterdir())
        bucket = make_bucket(env, "bench")
        os.environ.update(env)
        t = time.perf_counter()
        for d in (base, target):
            upload_dump(d, f"{bucket}/{d.name}")
        upload_s = time.perf_counter() - t
        runs: dict[str, list[dict]] = {"local": [], "s3 ranged": [], "s3 copied": []}
        cap_local, cap_s3 = [], []
        urls = f"{bucket}/{base.name}", f"{bucket}/{target.name}"
        for r in range(args.rounds):
            runs["local"].append(_child(str(base), str(target), env))
            runs["s3 ranged"].append(_child(*urls, env))
            runs["s3 copied"].append(_child(*urls, env, copy=True))
            cap_local.append(_dump(str(root / f"cap{r}"), args.tokens, env))
            cap_s3.append(_dump(f"{bucket}/cap{r}", args.tokens, env))
        gb = 2 * nbytes / 1e9
        print(f"dumps: 2 x {nbytes / 2**20:.0f} MiB; upload of both {upload_s:.1f} s ({gb / upload_s:.2f} GB/s)")
        tl = statistics.median(x["seconds"] for x in runs["local"])
        for what, done in runs.items():
            t = statistics.median(x["seconds"] for x in done)
            print(
                f"comparator {what + ':':11} {gb / t:.2f} GB/s ({t:.2f} s), peak anon "
                f"{max(x['peak_anon_mib'] for x in done):.0f} MiB; speed {tl / t:.2f}x of local"
            )
        cl, cs = statistics.median(cap_local), statistics.median(cap_s3)
        print(
            f"capture --out DIR {cl:.2f} s, --out s3:// {cs:.2f} s: {cs / cl:.2f}x ({args.tokens} tokens, tiny-llama)"
        )


if __name__ == "__main__":
    main()
