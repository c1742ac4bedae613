"""Bisection cost: runs and wall time over ladders of builds, and the loop's overhead per run beside the run itself.

Each ladder is ``N`` builds (folders on ``PYTHONPATH``, :mod:`tests.bisect_ladder`): clean before
build ``bad_from``, a bug seeded into layer 2 at token 20 from it on. Each run is a real
``python -m dumper run`` of the tiny-llama preset (40 tokens, every layer). The command records its
own start and end, so the loop's overhead (choosing, judging the dump against the baseline, writing
the state and the report) is the bisection's wall time minus the commands' own time.

    python bench/bench_bisect.py [--ladders 16 64] [--bad-from 0.7]

Prints per ladder: runs (and the bound ceil(log2 N) + 2), wall time, median command time per run,
loop overhead per run, and the overhead's ratio to the command it wraps.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comparator.bisect import bisect_builds, run_bound  # noqa: E402
from tests.bisect_ladder import PROMPT, dump_command, ladder  # noqa: E402


def _gold(root: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dumper",
            "run",
            "--model",
            "tiny-llama",
            "--layers",
            "all",
            "--input-ids",
            PROMPT,
            "--out",
            str(root / "gold"),
            "--quiet",
        ],
        check=True,
    )
    return root / "gold"


def one_ladder(root: Path, gold: Path, n: int, bad_from: int) -> dict[str, float]:
    builds = ladder(root / f"ladder{n}", n, bad_from=bad_from)
    times = root / f"times{n}.txt"
    command = f"date +%s.%N >> {times} && {dump_command()} && date +%s.%N >> {times}"
    start = time.perf_counter()
    result = bisect_builds(gold, builds, command, root / f"work{n}")
    wall = time.perf_counter() - start
    stamps = [float(x) for x in times.read_text().split()]
    commands = [b - a for a, b in zip(stamps[::2], stamps[1::2], strict=True)]
    assert result.first_bad == bad_from, result.to_json()
    overhead = (wall - sum(commands)) / result.runs
    return {
        "n": n,
        "runs": result.runs,
        "bound": run_bound(n),
        "wall": wall,
        "command": statistics.median(commands),
        "overhead": overhead,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ladders", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--bad-from", type=float, default=0.7, help="the first bad build, as a fraction of the ladder")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-bisect-") as tmp:
        root = Path(tmp)
        gold = _gold(root)
        print(f"{'builds':>6} {'runs':>5} {'bound':>5} {'wall s':>7} {'run s':>6} {'loop s/run':>10} {'loop/run':>8}")
        for n in args.ladders:
            r = one_ladder(root, gold, n, max(1, int(args.bad_from * n)))
            print(
                f"{r['n']:>6} {r['runs']:>5} {r['bound']:>5} {r['wall']:>7.1f} {r['command']:>6.2f} "
                f"{r['overhead']:>10.3f} {r['overhead'] / r['command']:>8.3f}"
            )


if __name__ == "__main__":
    main()
