"""Argument helpers shared by the comparator's subcommands (``cli.py`` and ``store_cli.py``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from dumper.cliutil import silence_stdout
from dumper.errors import UsageError

__all__ = ["logprob_thresholds", "write_output", "stdout_console"]


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
