"""The flags of ``python -m comparator regress`` and ``python -m comparator store`` (golden baselines).

Parsing only: what the commands do is :mod:`comparator.cli.store_run`, which loads the run store
(fsspec) and rich's tables, so ``python -m comparator BASELINE TARGET`` starts without them.
"""

from __future__ import annotations

import argparse

from comparator.cli.args import (
    VERDICT_ONLY,
    allow_model_mismatch_flag,
    calibrate_flag,
    git_bisect_flag,
    logprob_threshold_flags,
    noise_flags,
    output_flags,
    run_group_flag,
    run_store_flags,
    tensors_flag,
    threads_flag,
    threshold_flags,
)
from comparator.cli.parser import add_command
from comparator.store.labels import LABELS
from dumper.cli.common import Parser, quiet_flag

__all__ = ["build_regress_parser", "build_store_parser"]


def build_regress_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``regress RUN_DIR --store URL``: a subparser of ``sub``, or a parser of its own."""
    p = add_command(
        sub,
        "regress",
        "Judge a run by its golden baseline, then store it. The baseline is the latest "
        "run in the run store of the same model, capture signature and environment that did not fail; "
        "the run is stored labelled passed or failed. Exit 0 passed (or bootstrapped), 1 divergence, "
        "2 unusable.",
    )
    p.add_argument("run_dir", help="dump directory of the run under test")
    run_store_flags(
        p,
        required=True,
        store_help="run store: a local directory, or an fsspec URL (file://, s3://, gcs://, hf://, memory://)",
        run_group_help="run group: the model name the store files this run under and picks its baseline "
        "from (default: the dump's model name); not a row of the logprob threshold table",
    )
    p.add_argument(
        "--bootstrap",
        action="store_true",
        help="when no comparable baseline exists, store this run as the first baseline (exit 0)",
    )
    p.add_argument(
        "--allow-missing",
        action="store_true",
        help="compare a run that lacks tensors of its baseline (or holds extra ones) on the common ones "
        "instead of exit 2; the verdict says what was not compared",
    )
    allow_model_mismatch_flag(p, help="compare against a baseline of another model (architecture, sizes, config hash)")
    output_flags(p, json="the result (run id, label, baseline, report)")
    threshold_flags(p)
    logprob_threshold_flags(p, threshold_row=False, noise_from="against a calibrated baseline")
    threads_flag(p)
    calibrate_flag(
        p,
        help="dumps of benign re-runs of this run's inputs (another --attn, --chunk-size, --batch-size, "
        "thread count): measure the run's noise from them first and store it with the run, so runs "
        "judged against it are judged by its noise (use it when bootstrapping a baseline)",
    )
    noise_flags(p, noise_file=False)
    tensors_flag(p)
    quiet_flag(p, help=VERDICT_ONLY)
    git_bisect_flag(
        p,
        help="one step of `git bisect run`: store the run labelled bisect (never a baseline unless "
        "promoted) and exit 0 good, 1 bad, 125 when the run cannot be judged, 128 when the store "
        "or its baseline cannot be used (git stops)",
    )
    p.add_argument(
        "--build",
        metavar="LABEL",
        default=None,
        help="with --git-bisect: the build label stored with the run (default: 'git bisect')",
    )
    return p


def build_store_parser(commands: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``store ls|show|promote|prune URL ...``: a subparser of ``commands``, or a parser of its own."""
    p = add_command(
        commands,
        "store",
        "Inspect and curate a run store. Each command takes the store's URL: a local directory or an fsspec URL.",
    )
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    ls = add_command(sub, "ls", "List the runs of a store. Incomplete and corrupt entries are flagged.")
    ls.add_argument("url", help="run store location")
    run_group_flag(ls, "only runs of this run group (the model name runs are filed under)")
    ls.add_argument("--label", choices=LABELS, default=None, help="only runs with this label")
    show = add_command(
        sub, "show", "Print a run's record and a summary of its dump. Its calibration and report are summed up too."
    )
    show.add_argument("url", help="run store location")
    show.add_argument("run_id")
    promote = add_command(
        sub,
        "promote",
        "Relabel a run as a baseline (a human blesses it). With --calibrate, "
        "its noise is measured first and stored with it.",
    )
    promote.add_argument("url", help="run store location")
    promote.add_argument("run_id")
    calibrate_flag(
        promote,
        help="dumps of benign re-runs of the run's inputs: compare each with the stored dump and "
        "store the measured noise with the run (replacing any earlier calibration)",
    )
    threads_flag(promote, when="with --calibrate: ")
    allow_model_mismatch_flag(
        promote, help="with --calibrate: accept variants of another model spelling (cross-engine runs)"
    )
    prune = add_command(
        sub, "prune", "Delete all but the newest N runs per model and signature. Current baselines are always kept."
    )
    prune.add_argument("url", help="run store location")
    prune.add_argument("--keep", type=int, required=True, metavar="N", help="runs to keep per (model, signature)")
    prune.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    return p
