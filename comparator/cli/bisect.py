"""``python -m comparator bisect BASELINE --builds FILE --run 'CMD' --work DIR``: which build broke it.

Thin: the flags, :func:`comparator.bisect.run.bisect_builds`, a progress line per run on stderr,
the summary table on stdout, ``--json``. Exit 0 when the first bad build (or the candidates skips
leave) is named, 2 for unusable endpoints, baseline or flags, 3 internal.

Also here: the ``git bisect run`` contract of ``--git-bisect`` (``comparator A B`` and ``regress``):
0 good, 1 bad, 125 when the target cannot be judged (skip), and 128 (git stops the bisection) when
the baseline, the flags or driftscope itself fail, which no commit is to blame for.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from comparator.cli.args import (
    allow_model_mismatch_flag,
    compare_config,
    logprob_threshold_flags,
    noise_flags,
    output_flags,
    run_store_flags,
    threads_flag,
    threshold_flags,
)
from comparator.cli.parser import add_command
from dumper.cli.common import quiet_flag
from dumper.errors import EXIT_DIVERGED, EXIT_OK, DriftscopeError, UsageError
from dumper.format import write_json_atomic
from dumper.format.files import printable
from dumper.format.remote import fetched

__all__ = [
    "GIT_GOOD",
    "GIT_BAD",
    "GIT_SKIP",
    "GIT_ABORT",
    "build_bisect_parser",
    "cmd_bisect",
    "git_bisect_exit",
    "git_skip",
]

GIT_GOOD = 0
GIT_BAD = 1
GIT_SKIP = 125
GIT_ABORT = 128
"""``git bisect run``'s contract: good, bad, skip (cannot test this commit), and abort (any code over 127)."""
_MAX_BUILDS_BYTES = 16 << 20


def build_bisect_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``bisect [BASELINE] --builds FILE --run CMD --work DIR``: a subparser of ``sub``, or a parser of its own."""
    p = add_command(
        sub,
        "bisect",
        "Find the first build that diverges. The builds are "
        "tried by binary search, each with the --run command, and each dump is judged as `python -m "
        "comparator BASELINE OUT` judges it; a build whose command fails is skipped. Exit 0 when the "
        "first bad build (or the candidates skips leave) is named.",
    )
    p.add_argument(
        "baseline",
        nargs="?",
        default=None,
        help="dump directory of the trusted run (or --store URL for the store's baseline)",
    )
    p.add_argument(
        "--builds",
        required=True,
        metavar="FILE",
        help="the builds, one a line, oldest first: the first must be good and the last bad (blank lines "
        "and lines starting with # are ignored)",
    )
    p.add_argument(
        "--run",
        required=True,
        metavar="CMD",
        help="shell command run once per tested build; {build} is replaced by the build's line and {out} "
        "by a fresh dump directory (both shell-quoted); it must leave a dump at {out}",
    )
    p.add_argument(
        "--work",
        required=True,
        metavar="DIR",
        help="where each build's dump, log and report and the bisection's state are kept",
    )
    p.add_argument("--resume", action="store_true", help="go on with the bisection in --work after an interruption")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a build's command may run before it is killed and the build skipped",
    )
    run_store_flags(
        p,
        required=False,
        when="with --store: ",
        store_help="judge against this run store's current baseline, and store every judged build there "
        "labelled bisect (never a baseline unless promoted)",
        run_group_help="the model name the store files runs under (default: the first dump's)",
    )
    output_flags(p, json="the result (first_bad, last_good, candidates, tested, verdict)")
    threshold_flags(p)
    logprob_threshold_flags(p, threshold_row=False, noise_from="with --noise")
    noise_flags(p)
    threads_flag(p)
    allow_model_mismatch_flag(p, help="judge dumps of another model than the baseline's (the differences are reported)")
    quiet_flag(p, help="no progress lines; print only the answer")
    return p


def read_builds(path: str) -> list[str]:
    """The builds of ``--builds FILE``: one a line, stripped, blank lines and ``#`` comments dropped."""
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_BUILDS_BYTES:
            raise UsageError(f"{path}: {p.stat().st_size} bytes, too large for a list of builds")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text (one build a line)") from None
    builds = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if len(builds) < 2:
        raise UsageError(f"{path}: {len(builds)} builds; a bisection needs at least a good one and a bad one")
    return builds


def cmd_bisect(args: argparse.Namespace) -> int:
    """``python -m comparator bisect``: bisect, print each run and the answer, write ``--json``."""
    from comparator.bisect.run import bisect_builds
    from comparator.cli.bisect_report import print_result, progress_line

    if args.store is None and args.baseline is None:
        raise UsageError("bisect needs a BASELINE dump, or --store URL to judge against the store's baseline")
    if args.store is not None and args.baseline is not None:
        raise UsageError("bisect takes a BASELINE dump or --store URL, not both")
    if args.store is not None and args.noise is not None:
        raise UsageError("--store judges against the noise stored with its baseline; drop --noise")
    config = compare_config(args)
    builds = read_builds(args.builds)
    with contextlib.ExitStack() as stack:  # a baseline at a URL: judged from a local copy
        base = None if args.baseline is None else stack.enter_context(fetched(args.baseline))
        result = bisect_builds(
            base,
            builds,
            args.run,
            args.work,
            store=args.store,
            model=args.run_group,
            config=config,
            timeout=args.timeout,
            resume=args.resume,
            allow_env_mismatch=args.allow_env_mismatch,
            cache_dir=args.cache_dir,
            on_run=None if args.quiet else progress_line(len(builds)),
        )
    print_result(result, quiet=args.quiet)
    if args.json:
        try:
            write_json_atomic(args.json, result.to_json())
        except OSError as e:
            raise UsageError(f"{args.json}: cannot write the result ({e.strerror})") from None
    return EXIT_OK


def git_skip(e: DriftscopeError) -> int:
    """A target that cannot be judged under ``--git-bisect``: its one line, and git's skip code."""
    print(f"error: {printable(str(e))} (git bisect: skip)", file=sys.stderr)
    return GIT_SKIP


def git_bisect_exit(argv: list[str], code: int) -> int:
    """The exit code of a ``--git-bisect`` command line: good, bad and skip as they are; anything else (the
    baseline, the flags, a bug) stops ``git bisect run`` (:data:`GIT_ABORT`) rather than blame the commit."""
    if "--git-bisect" not in argv or code in (EXIT_OK, EXIT_DIVERGED, GIT_SKIP):
        return code
    print(f"git bisect: stopping (exit {code} is not this commit's verdict)", file=sys.stderr)
    return GIT_ABORT
