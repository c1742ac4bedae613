"""``python -m comparator BASELINE TARGET``: parse flags, call :func:`compare_dumps`, print, exit.

Exit codes: 0 every matched tensor passed; 1 divergence; 2 unusable input (bad arguments,
missing/incomplete/corrupt dump, zero matched tensors, shapes that cannot be aligned).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from dumper.cliutil import Parser, guarded_main
from dumper.errors import EXIT_DIVERGED, EXIT_OK, UsageError

from .compare import compare_dumps
from .config import CompareConfig
from .render import describe_divergence, render_report

__all__ = ["main", "build_parser"]



def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m comparator", description="Compare two driftscope dumps layer by layer.")
    p.add_argument("baseline", help="dump directory of the trusted run")
    p.add_argument("target", help="dump directory of the run under test")
    p.add_argument("--threshold", type=float, default=None,
                   help="whole-tensor rel_diff threshold (default 1e-3, env DRIFTSCOPE_DIFF_THRESHOLD)")
    p.add_argument("--token-threshold", type=float, default=None,
                   help="per-token rel_diff threshold (default 1e-3, env DRIFTSCOPE_TOKEN_THRESHOLD)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the per-tensor table as CSV")
    p.add_argument("--tensors", action="store_true", help="also print one row per tensor")
    p.add_argument("--threads", type=int, default=None, help="metric worker threads (default 2)")
    p.add_argument("--quiet", action="store_true", help="print only the verdict line")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = CompareConfig.resolve(threshold=args.threshold, token_threshold=args.token_threshold,
                                   threads=args.threads)
    report = compare_dumps(args.baseline, args.target, config)
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
    if args.quiet:
        fd = report.first_divergent
        console.print("PASS" if report.passed else f"DIVERGED {describe_divergence(fd)}" if fd else
                      "DIVERGED (replicas differ)")
    else:
        render_report(report, console, tensors=args.tensors)
    for path, write in ((args.json, report.write_json), (args.csv, report.write_csv)):
        if path:
            try:
                write(path)
            except OSError as e:
                raise UsageError(f"{path}: cannot write the report ({e.strerror})") from None
    return EXIT_OK if report.passed else EXIT_DIVERGED


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: user errors become one line on stderr and a distinct exit code."""
    return guarded_main(run, argv)
