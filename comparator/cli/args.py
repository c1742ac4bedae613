"""The flag groups the comparator's subcommands share (:mod:`comparator.cli.main`, :mod:`comparator.cli.store`).

Each flag is defined once, here, and added by every subcommand that takes it:

* :func:`threshold_flags`: ``--threshold``, ``--token-threshold``, ``--acceptance-tolerance`` (``comparator A B``,
  ``regress``);
* :func:`logprob_threshold_flags`: ``--logprob-threshold`` and, where thresholds come from the
  table, ``--model`` as a *threshold row* (``comparator A B``, ``comparator logprobs``, ``regress``);
* :func:`noise_flags`: ``--noise``, ``--noise-factor``, ``--noise-floor``;
* :func:`output_flags`: ``--json``, ``--csv`` (the report files ``--html``, ``--plot``, ``--markdown``,
  ``--format`` are :func:`comparator.reports.outputs.add_output_flags`);
* :func:`run_group_flag`: ``--model`` as a *run group* of a store (``regress``, ``store ls``);
  :func:`run_store_flags`: ``--store`` and how its baseline is found (``regress``, ``bisect``);
* :func:`threads_flag`, :func:`allow_model_mismatch_flag`, :func:`tensors_flag`, :func:`calibrate_flag`
  (``--calibrate VARIANT...``), :func:`git_bisect_flag`: one flag each, taken by several subcommands.

Flags the dumper's commands take too (``--out``, ``--quiet``, ``--json``, the prompt flags) are
:mod:`dumper.cli.common`'s, a live server's :mod:`dumper.server.flags`'.

``--model`` spells two concepts: a row of ``configs/logprob_thresholds.json`` in ``comparator``
(``args.threshold_row``), and the model name a store files runs under in ``regress`` (``args.run_group``).
:func:`parse_args` parses and refuses impossible flag combinations; :func:`compare_config` turns the
threshold, logprob and noise groups into one :class:`~comparator.config.CompareConfig`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from comparator.config import CompareConfig
from comparator.judging.logprob_metrics import metric_names
from comparator.judging.logprob_thresholds import LogprobThresholds
from comparator.judging.noise_thresholds import DEFAULT_FACTOR, DEFAULT_FLOOR, check_noise_factor, parse_noise_floor
from comparator.judging.values import parse_assignments, parse_threshold
from dumper.cli.common import json_flag, silence_stdout
from dumper.errors import UsageError
from dumper.format.files import printable

if TYPE_CHECKING:  # rich, the noise file and the report formats load only when a command uses them
    from rich.console import Console

__all__ = [
    "logprob_thresholds",
    "write_output",
    "warn",
    "stdout_console",
    "noise_flags",
    "noise_args",
    "threshold_flags",
    "logprob_threshold_flags",
    "output_flags",
    "run_group_flag",
    "run_store_flags",
    "threads_flag",
    "allow_model_mismatch_flag",
    "tensors_flag",
    "calibrate_flag",
    "git_bisect_flag",
    "parse_args",
    "compare_config",
    "print_line",
    "VERDICT_ONLY",
]

VERDICT_ONLY = "print only the verdict line"
"""``--quiet``'s help where a command ends with a verdict line (``comparator A B``, ``logprobs``, ``regress``)."""


def _threshold_value(flag: str) -> Callable[[str], float]:
    """An argparse ``type`` that checks a threshold as it is parsed: NaN or < 0 is one line naming ``flag``."""

    def parse(raw: str) -> float:
        float(raw)  # a non-number: argparse's own "invalid float value" line, as for type=float
        value = parse_threshold(raw, where=flag)
        assert value is not None  # off is not allowed here
        return value

    parse.__name__ = "float"
    return parse


def threshold_flags(p: argparse.ArgumentParser) -> None:
    """``--threshold`` and ``--token-threshold``: the fixed rel_diff thresholds of the hidden-state comparison;
    ``--acceptance-tolerance``: how far a speculative target's acceptance length may fall below the baseline's."""
    p.add_argument(
        "--threshold",
        type=_threshold_value("--threshold"),
        default=None,
        help="whole-tensor rel_diff threshold (default 1e-3, env DRIFTSCOPE_DIFF_THRESHOLD)",
    )
    p.add_argument(
        "--token-threshold",
        type=_threshold_value("--token-threshold"),
        default=None,
        help="per-token rel_diff threshold (default 1e-3, env DRIFTSCOPE_TOKEN_THRESHOLD)",
    )
    p.add_argument(
        "--acceptance-tolerance",
        type=_threshold_value("--acceptance-tolerance"),
        default=None,
        metavar="FRACTION",
        help="two speculative decodes: fail when the target's acceptance length is below the baseline's by more "
        "than this fraction of it, over the steps both fed alike (default 0.02, env DRIFTSCOPE_ACCEPTANCE_TOLERANCE)",
    )


def logprob_threshold_flags(p: argparse.ArgumentParser, *, threshold_row: bool, noise_from: str) -> None:
    """``--logprob-threshold NAME=VALUE`` (repeatable) and, with ``threshold_row``, ``--model NAME[@DTYPE]``.

    ``noise_from`` says when a noise-derived threshold exists (``"with --noise"``, ``"against a
    calibrated baseline"``). ``--model`` here is the threshold-table row (``args.threshold_row``).
    """
    p.add_argument(
        "--logprob-threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"logprob threshold ({', '.join(metric_names())}; VALUE 'off' disables); repeatable; wins over "
        f"DRIFTSCOPE_LOGPROB_* and the per-model table, and {noise_from} applies on top of the "
        "noise-derived one (the smaller wins)",
    )
    if threshold_row:
        p.add_argument(
            "--model",
            dest="threshold_row",
            default=None,
            metavar="NAME[@DTYPE]",
            help="threshold row: the row of configs/logprob_thresholds.json whose logprob thresholds "
            "apply (default: the baseline dump's model, judged at the coarser dtype of the two "
            "dumps); NAME@DTYPE judges as DTYPE, e.g. default@bfloat16",
        )


def run_group_flag(p: argparse.ArgumentParser, help_text: str) -> None:
    """``--model MODEL`` as a run group: the model name a run store files runs under (``args.run_group``)."""
    p.add_argument("--model", dest="run_group", default=None, metavar="MODEL", help=help_text)


def run_store_flags(
    p: argparse.ArgumentParser, *, required: bool, store_help: str, run_group_help: str, when: str = ""
) -> None:
    """``--store URL``, ``--model`` (:func:`run_group_flag`), ``--allow-env-mismatch``, ``--cache-dir``: the run
    store and how its baseline is found; ``when`` prefixes the help of flags that need ``--store``."""
    p.add_argument("--store", required=required, default=None, metavar="URL", help=store_help)
    run_group_flag(p, f"{when}{run_group_help}")
    p.add_argument(
        "--allow-env-mismatch",
        action="store_true",
        help=f"{when}take a baseline from another environment (torch, CUDA, GPU...) if none matches",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help=f"{when}keep downloaded baselines of a remote store here (default: a temporary directory)",
    )


def threads_flag(p: argparse.ArgumentParser, when: str = "") -> None:
    """``--threads N``: metric worker threads (default 2, :class:`~comparator.config.CompareConfig`'s)."""
    p.add_argument("--threads", type=int, default=2, help=f"{when}metric worker threads (default 2)")


def allow_model_mismatch_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--allow-model-mismatch``: accept dumps of another model; ``help`` says what the command does with them."""
    p.add_argument("--allow-model-mismatch", action="store_true", help=help)


def tensors_flag(p: argparse.ArgumentParser) -> None:
    """``--tensors``: the report's table of one row per tensor, after the per-layer one."""
    p.add_argument("--tensors", action="store_true", help="also print one row per tensor")


def calibrate_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--calibrate VARIANT...``: dumps of benign re-runs whose noise is measured and stored with the run."""
    p.add_argument("--calibrate", nargs="+", default=[], metavar="VARIANT", help=help)


def git_bisect_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--git-bisect``: exit as ``git bisect run`` reads it (:func:`comparator.cli.bisect.git_bisect_exit`)."""
    p.add_argument("--git-bisect", action="store_true", help=help)


def output_flags(p: argparse.ArgumentParser, *, json: str, csv: bool = False) -> None:
    """``--json FILE`` (writes ``json``, e.g. "the report") and, with ``csv``, ``--csv FILE``."""
    json_flag(p, json)
    if csv:
        p.add_argument("--csv", metavar="FILE", help="write the per-tensor table as CSV")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed, with impossible combinations of the groups' flags refused before any work.

    Checked: the report outputs (:func:`comparator.reports.outputs.check_output_flags`) and that
    a threshold row given with ``--model`` exists (a typo must not loosen the thresholds).
    """
    from comparator.reports.outputs import check_output_flags

    args = parser.parse_args(argv)
    check_output_flags(args)
    if getattr(args, "threshold_row", None) is not None:
        LogprobThresholds.check_row(args.threshold_row)
    return args


def compare_config(args: argparse.Namespace) -> CompareConfig:
    """The config of the parsed threshold, logprob-threshold and noise groups: flags > env vars > defaults."""
    return CompareConfig.resolve(
        threshold=args.threshold,
        token_threshold=args.token_threshold,
        threads=args.threads,
        logprob_thresholds=logprob_thresholds(args.logprob_threshold),
        model=getattr(args, "threshold_row", None),
        require_all=getattr(args, "require_all", False),
        allow_model_mismatch=args.allow_model_mismatch,
        acceptance_tolerance=getattr(args, "acceptance_tolerance", None),
        **noise_args(args),
    )


def logprob_thresholds(pairs: Sequence[str]) -> dict[str, float | None]:
    """``--logprob-threshold NAME=VALUE`` items as ``{name: value}`` (``off`` gives ``None``; later items win)."""
    return parse_assignments(pairs, flag="--logprob-threshold", allow_off=True)


def noise_flags(p: argparse.ArgumentParser, *, noise_file: bool = True) -> None:
    """``--noise`` (with ``noise_file``), ``--noise-factor``, ``--noise-floor``: thresholds from measured noise.

    ``regress`` takes the noise from its baseline in the store, so it has no ``--noise``.
    """
    when = "with --noise" if noise_file else "against a calibrated baseline"
    if noise_file:
        p.add_argument(
            "--noise",
            metavar="NOISE.json",
            default=None,
            help="judge each tensor (and the logprobs) against its measured noise, from `python -m "
            "comparator calibrate`; explicit --threshold/--token-threshold still apply on top",
        )
    p.add_argument(
        "--noise-factor",
        type=float,
        default=None,
        metavar="F",
        help=f"{when}: fail above F x noise (default {DEFAULT_FACTOR:g})",
    )
    p.add_argument(
        "--noise-floor",
        action="append",
        default=[],
        metavar="[NAME=]VALUE",
        help=f"{when}: absolute floor of a derived threshold; VALUE alone is rel_diff's "
        f"(default {DEFAULT_FLOOR:g}), NAME=VALUE a logprob metric's ({', '.join(metric_names())}); "
        "repeatable",
    )


def noise_args(args: argparse.Namespace) -> dict[str, Any]:
    """The noise file (where ``--noise`` exists), factor and floors of parsed :func:`noise_flags`,
    for :meth:`CompareConfig.resolve`."""
    with_file = hasattr(args, "noise")
    if with_file and args.noise is None and (args.noise_factor is not None or args.noise_floor):
        raise UsageError("--noise-factor and --noise-floor need --noise NOISE.json")
    out: dict[str, Any] = {
        "noise_factor": None if args.noise_factor is None else check_noise_factor(args.noise_factor),
        "noise_floors": parse_noise_floor(args.noise_floor),
    }
    if with_file and args.noise:
        from comparator.noise.file import load_noise

        out["noise"] = load_noise(args.noise)
    elif with_file:
        out["noise"] = None
    return out


def write_output(path: str | None, write: Callable[[str], None]) -> None:
    """Call ``write(path)`` when a path was given; an OSError becomes a one-line usage error."""
    if path:
        try:
            write(path)
        except OSError as e:
            raise UsageError(f"{path}: cannot write the report ({e.strerror})") from None


def warn(lines: Iterable[str]) -> None:
    """Each line as ``warning: LINE`` on stderr (control characters escaped): seen whatever stdout carries
    (``--quiet``, ``--format json``), never mistaken for the verdict."""
    for line in lines:
        print(f"warning: {printable(line)}", file=sys.stderr)


def stdout_console() -> Console:
    """A console on stdout, 160 columns wide when stdout is not a terminal, whose reader may go away
    (``comparator A B | head -1``) without changing the exit code.

    rich's default exits 1 on a broken pipe, which CI would read as a divergence; this one sends
    the rest of the output to /dev/null and lets the command finish, so it exits with its verdict.
    """
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            silence_stdout()

    return PipeConsole(stderr=False, width=None if sys.stdout.isatty() else 160)


def print_line(text: str) -> None:
    """``text`` as one line on stdout, as :func:`stdout_console` prints an unstyled line (the control
    characters rich drops, dropped), without loading rich: ``--quiet``'s verdict line; a reader that
    went away does not change the exit code either."""
    try:
        sys.stdout.write(text.translate(_RICH_STRIPS) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()


_RICH_STRIPS = dict.fromkeys((7, 8, 11, 12, 13))
"""The control characters rich's ``Text`` strips (BEL, BS, VT, FF, CR)."""
