"""Argument helpers shared by the comparator's subcommands (``cli.py`` and ``store_cli.py``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from dumper.cli.common import silence_stdout
from dumper.errors import UsageError

from comparator.noise.model import DEFAULT_FACTOR, DEFAULT_FLOOR, NoiseModel, check_noise_factor, parse_noise_floor

__all__ = ["logprob_thresholds", "write_output", "stdout_console", "noise_flags", "noise_args"]


def logprob_thresholds(pairs: Sequence[str]) -> dict[str, float | None]:
    """``--logprob-threshold NAME=VALUE`` items as ``{name: value}`` (``off`` gives ``None``)."""
    out: dict[str, float | None] = {}
    for item in pairs:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--logprob-threshold {item!r}: expected NAME=VALUE")
        if value.strip().lower() in ("off", "none", "null"):
            out[name.strip()] = None
            continue
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--logprob-threshold {item!r}: {value!r} is not a number (or 'off')") from None
    return out


def noise_flags(p: argparse.ArgumentParser, *, noise_file: bool = True) -> None:
    """``--noise`` (with ``noise_file``), ``--noise-factor``, ``--noise-floor``: thresholds from measured noise.

    ``regress`` takes the noise from its baseline in the store, so it has no ``--noise``.
    """
    when = "with --noise" if noise_file else "against a calibrated baseline"
    if noise_file:
        p.add_argument("--noise", metavar="NOISE.json", default=None,
                       help="judge each tensor (and the logprobs) against its measured noise, from `python -m "
                            "comparator calibrate`; explicit --threshold/--token-threshold still apply on top")
    p.add_argument("--noise-factor", type=float, default=None, metavar="F",
                   help=f"{when}: fail above F x noise (default {DEFAULT_FACTOR:g})")
    p.add_argument("--noise-floor", action="append", default=[], metavar="[NAME=]VALUE",
                   help=f"{when}: absolute floor of a derived threshold; VALUE alone is rel_diff's "
                        f"(default {DEFAULT_FLOOR:g}), NAME=VALUE a logprob metric's; repeatable")


def noise_args(args: argparse.Namespace) -> dict[str, Any]:
    """The noise file (where ``--noise`` exists), factor and floors of parsed :func:`noise_flags`,
    for :meth:`CompareConfig.resolve`."""
    with_file = hasattr(args, "noise")
    if with_file and args.noise is None and (args.noise_factor is not None or args.noise_floor):
        raise UsageError("--noise-factor and --noise-floor need --noise NOISE.json")
    out: dict[str, Any] = {
        "noise_factor": None if args.noise_factor is None else check_noise_factor(args.noise_factor),
        "noise_floors": parse_noise_floor(args.noise_floor)}
    if with_file:
        out["noise"] = NoiseModel.load(args.noise) if args.noise else None
    return out


def write_output(path: str | None, write: Callable[[str], None]) -> None:
    """Call ``write(path)`` when a path was given; an OSError becomes a one-line usage error."""
    if path:
        try:
            write(path)
        except OSError as e:
            raise UsageError(f"{path}: cannot write the report ({e.strerror})") from None


class _PipeConsole(Console):
    """A console whose reader may go away (``comparator A B | head -1``) without changing the exit code.

    rich's default exits 1 on a broken pipe, which CI would read as a divergence; this one sends
    the rest of the output to /dev/null and lets the command finish, so it exits with its verdict.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout()


def stdout_console() -> Console:
    """A console on stdout, 160 columns wide when stdout is not a terminal."""
    return _PipeConsole(stderr=False, width=None if sys.stdout.isatty() else 160)
