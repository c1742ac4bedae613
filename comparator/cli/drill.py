"""``python -m comparator drill A B``: two builds' drills of one half, op by op.

Thin: the flags, :func:`comparator.drill.compare_drills`, a table of one row per module path, each
side's own verdict against float64, the verdict line, ``--json``. Exit 0 when no path differs
beyond ``--factor``, 1 when one does, 2 for a log that cannot be read or drills that do not
compare, 3 internal. Op and path names come from the logs: printed as plain text, never as
rich markup, control characters escaped.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from comparator.cli.args import print_line, stdout_console, write_output
from comparator.cli.parser import add_command
from dumper.cli.common import factor_flag, json_flag
from dumper.errors import EXIT_DIVERGED, EXIT_OK
from dumper.format import write_json_atomic
from dumper.format.drill import HALF_NAMES
from dumper.format.files import printable

if TYPE_CHECKING:
    from rich.table import Table

    from comparator.drill.types import DrillComparison, OpBrief

__all__ = ["build_drill_parser", "cmd_drill", "render_drill"]

_STYLE = {"PASS": "green", "FAIL": "bold red", "n/a": "yellow"}
_SHOWN_OPS = 3
"""Op names in a table cell; the rest as ``+N``."""


def build_drill_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``drill A B [--factor F] [--json PATH|-]``: a subparser of ``sub``, or a parser of its own."""
    p = add_command(
        sub,
        "drill",
        "Compare two builds' drills of one half, op by op. A and B are directories written by "
        "`python -m dumper drill` for the same layer and half (A the baseline build, B the candidate); "
        "ops meet by module path and slot, and the first path whose outputs differ beyond both builds' "
        "rounding is named with what each side dispatched there.",
    )
    p.add_argument("a", metavar="A", help="drill directory of the baseline build")
    p.add_argument("b", metavar="B", help="drill directory of the candidate build")
    factor_flag(
        p,
        default=None,
        help="a path differs above F times the two sides' rounding (default: the larger of the logs' own factors)",
    )
    json_flag(p, "the comparison (atomically; - prints it to stdout instead of the table)")
    return p


def _ops_cell(ops: tuple[OpBrief, ...], other: tuple[OpBrief, ...] | None = None) -> str:
    if not ops:
        return "-"
    if other is not None and [o.op for o in ops] == [o.op for o in other]:
        return "same"
    names = [o.op for o in ops]
    more = f" +{len(names) - _SHOWN_OPS}" if len(names) > _SHOWN_OPS else ""
    return printable(", ".join(names[:_SHOWN_OPS]) + more)


def _table(result: DrillComparison) -> Table:
    from rich.table import Table
    from rich.text import Text

    from comparator.drill.types import format_ratio

    half = HALF_NAMES.get(result.a.half, result.a.half)
    title = f"layer {result.a.layer} {half}: A vs B, op by op (ratio: x the two sides' rounding)"
    table = Table(title=title, title_justify="left")
    for col in ("path", "A's ops", "B's ops", "ratio", "token", "verdict"):
        table.add_column(col, justify="right" if col in ("ratio", "token") else "left")
    first = result.first
    for p in result.paths:
        table.add_row(
            Text(printable(p.path), style="bold" if p is first else ""),
            Text(_ops_cell(p.ops_a)),
            Text(_ops_cell(p.ops_b, p.ops_a)),
            format_ratio(p.ratio),
            "-" if p.token is None else str(p.token),
            Text(p.status.value, style=_STYLE[p.status.value]),
        )
    return table


def _side_line(name: str, side_path: str, summary: str) -> str:
    return printable(f"{name} ({side_path}): {summary}")


def render_drill(result: DrillComparison) -> None:
    """The table, the notes, each side's own verdict, and the verdict line last, on stdout."""
    from rich.text import Text

    console = stdout_console()
    console.print(_table(result))
    for note in result.notes:
        console.print(Text(printable(f"note: {note}")), soft_wrap=True)
    console.print(Text(_side_line("A", result.a.path, result.a.summary)), soft_wrap=True)
    console.print(Text(_side_line("B", result.b.path, result.b.summary)), soft_wrap=True)
    style = "bold green" if result.passed else "bold red"
    console.print(Text(printable(result.summary), style=style), soft_wrap=True)


def cmd_drill(args: argparse.Namespace) -> int:
    """``python -m comparator drill A B``: compare, print (or ``--json -``), write ``--json``; exit 0 or 1."""
    from comparator.drill.compare import compare_drills

    result = compare_drills(args.a, args.b, factor=args.factor)
    if args.json == "-":
        print_line(json.dumps(result.to_json(), indent=2, allow_nan=False))
    else:
        render_drill(result)
        write_output(args.json, lambda path: write_json_atomic(path, result.to_json()))
    return EXIT_OK if result.passed else EXIT_DIVERGED
