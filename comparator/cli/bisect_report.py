"""What ``python -m comparator bisect`` prints: a progress line per run (stderr), the table and the answer (stdout).

Build names come from the user's file and dump names from the runs: printed as plain text, never
as rich markup, control characters escaped.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from comparator.bisect.types import BAD, GOOD, BisectResult, BuildRun
from comparator.cli.args import stdout_console
from dumper.format.files import printable

__all__ = ["progress_line", "print_result", "describe_run", "answer"]

_STYLE = {GOOD: "green", BAD: "bold red"}


def describe_run(run: BuildRun) -> str:
    """``bad: layer 2, token 20``, ``good``, ``skip: exit 1: ImportError ...``."""
    fd = run.first_divergent
    if run.outcome == BAD and fd:
        where = f"layer {fd.get('layer')}" + (f", token {fd.get('token')}" if fd.get("token") is not None else "")
        return f"bad: {where}"
    if run.outcome == BAD:
        return f"bad: {run.headline}"
    return GOOD if run.outcome == GOOD else f"skip: {run.headline}"


def _name(result: BisectResult, i: int) -> str:
    return f"{printable(result.builds[i])!r} (line {i + 1})"


def answer(result: BisectResult) -> str:
    """The answer in one line: the first bad build and the last good one, or the candidates skips leave."""
    runs = f"{result.runs} runs (at most {result.bound} without skips), {result.skipped} skipped"
    good = f"last good {_name(result, result.last_good)}" if result.last_good is not None else "no good build"
    if result.first_bad is not None:
        return f"first bad build: {_name(result, result.first_bad)}; {good}; {runs}"
    names = ", ".join(_name(result, i) for i in result.candidates)
    return f"first bad build is one of {names} (skipped builds hide which); {good}; {runs}"


def progress_line(total: int) -> Callable[[BuildRun, int], None]:
    """An ``on_run`` that prints one line per judged build on stderr, with the runs left at most."""
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    count = [0]

    def on_run(run: BuildRun, left: int) -> None:
        count[0] += 1
        line = Text(f"bisect run {count[0]}: build {run.index + 1}/{total} {printable(run.build)!r}: ")
        line.append(printable(describe_run(run))[:300], style=_STYLE.get(run.outcome, "yellow"))
        line.append(f" ({run.seconds:.1f} s); at most {left} run{'s' * (left != 1)} left")
        console.print(line)

    return on_run


def _table(result: BisectResult) -> Table:
    table = Table(title="bisection", title_justify="left")
    for col in ("line", "build", "outcome", "exit", "seconds", "stored run"):
        table.add_column(col, justify="right" if col in ("line", "exit", "seconds") else "left")
    for run in sorted(result.tested, key=lambda r: r.index):
        table.add_row(
            str(run.index + 1),
            Text(printable(run.build)),
            Text(printable(describe_run(run))[:200], style=_STYLE.get(run.outcome, "yellow")),
            "-" if run.exit_code is None else str(run.exit_code),
            f"{run.seconds:.1f}",
            run.run_id or "-",
        )
    return table


def print_result(result: BisectResult, *, quiet: bool, console: Console | None = None) -> None:
    """The table of tested builds (not with ``quiet``), the answer, the first bad build's verdict, the notes."""
    console = console or stdout_console()
    if not quiet:
        console.print(_table(result))
    console.print(Text(answer(result), style="bold"))
    if result.first_bad is not None:
        bad = next(r for r in result.tested if r.index == result.first_bad)
        console.print(Text(f"{printable(bad.build)}: {printable(bad.headline)}"), soft_wrap=True)
    for note in result.notes:
        console.print(Text(printable(note)))
