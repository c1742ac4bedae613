"""What starting the comparator costs: ``python -m comparator --help`` of this tree against another.

Runs the command ``--repeat`` times for each tree, interleaved (so load on the machine hits both
alike), with ``PYTHONPATH`` pointing at the tree, and prints the best and median wall time of
each, their ratio, how many driftscope modules ``--help`` loads, and whether torch was
imported. The other tree is any checkout, e.g. of the commit before a change::

    git clone -q . /tmp/before && git -C /tmp/before checkout -q 727a0a0
    python bench/bench_import.py --against /tmp/before [--repeat 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import contextlib, io, runpy, sys; sys.argv = ['comparator', '--help']\n"
    "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
    "    runpy.run_module('comparator', run_name='__main__')\n"
    "mods = [m for m in sys.modules if m.split('.')[0] in ('comparator', 'dumper')]\n"
    "print(len(mods), 'torch' in sys.modules)"
)
"""Runs ``python -m comparator --help`` in-process, then counts what it loaded."""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def _wall(tree: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "comparator", "--help"], env=_env(tree), cwd="/", check=True, stdout=subprocess.DEVNULL
    )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="another checkout to compare with (the baseline)")
    ap.add_argument("--repeat", type=int, default=12)
    args = ap.parse_args()
    trees = {"baseline": args.against.resolve(), "this tree": ROOT}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            times[name].append(_wall(tree))
    for name, tree in trees.items():
        probe = subprocess.run(
            [sys.executable, "-c", PROBE], env=_env(tree), cwd="/", check=True, capture_output=True, text=True
        ).stdout.split()
        print(
            f"{name:10s} best {min(times[name]):.3f} s  median {statistics.median(times[name]):.3f} s  "
            f"driftscope modules {probe[0]}  torch imported: {probe[1]}   ({tree})"
        )
    base, this = (statistics.median(times[n]) for n in trees)
    print(f"ratio this/baseline (median): {this / base:.2f}x")


if __name__ == "__main__":
    main()
