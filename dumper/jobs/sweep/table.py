"""The terminal rendering of a sweep: one table row per cell, one line per finished cell, one verdict line.

Example::

    from rich.console import Console
    render_sweep(result, Console())
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from comparator import DIVERGED, PASS, format_float
from dumper.jobs.sweep.grid import describe
from dumper.jobs.sweep.results import CellResult, SweepResult

__all__ = ["render_sweep", "cell_line", "summary_line"]


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def _word(v: object) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _logprob_cells(c: CellResult) -> tuple[str, str]:
    """(max |Δlogprob|, KL mean) of a cell: ``-`` without logprobs, the note when none were recorded by design."""
    lp = c.logprobs
    if lp is None:
        return "-", "-"
    if lp.note is not None:
        return lp.note, "n/a"
    return format_float(lp.max_abs_err), "-" if lp.kl_mean is None else format_float(lp.kl_mean)


def summary_line(result: SweepResult) -> str:
    """``PASS: 12 cells ...`` or ``DIVERGED: 4 of 12 cells fail (cell-001, ...) ...``."""
    failed = [c.name for c in result.cells if not c.passed]
    where = f"{len(result.cells)} cells against {result.baseline} in {result.wall_s:.1f} s"
    if not failed:
        return f"{PASS}: {where}"
    shown = ", ".join(failed[:6]) + (", ..." if len(failed) > 6 else "")
    return f"{DIVERGED}: {len(failed)} of {where} fail ({shown})"


def render_sweep(result: SweepResult, console: Console) -> None:
    """Print the table of cells (one column per grid key) and the verdict line.

    ``layer`` and ``token``: the first divergent layer and its first failing token; ``onset``: where
    the comparator estimates the divergence starts; ``engine``: whether the cell reused a loaded one.
    """
    keys = list(result.cells[0].settings) if result.cells else []
    block = f" (KV block size {result.block_size})" if result.block_size else ""
    table = Table(title=Text(f"sweep of {result.engine} against {result.baseline}{block}"), title_justify="left")
    table.add_column("cell")
    for k in keys:  # a setting's name in full: the header says what the cell varied
        table.add_column(k, justify="right", min_width=len(k))
    table.add_column("verdict", ratio=1)  # the one column that wraps (a failing cell's reason)
    for col in ("layer", "token", "onset", "max |Δlogprob|", "KL mean", "cache hits", "time s", "engine"):
        table.add_column(col, justify="left" if col == "engine" else "right", no_wrap=True)
    for c in result.cells:
        fd = c.first_divergent
        table.add_row(
            c.name,
            *(_word(c.settings.get(k)) for k in keys),
            Text(c.verdict, style="green" if c.passed else "bold red"),
            _dash(None if fd is None else fd.layer),
            _dash(c.first_token),
            _dash(c.onset),
            *_logprob_cells(c),
            _dash(c.cache_hits),
            f"{c.wall_s:.2f}",
            "reused" if c.engine_reused else "loaded",
        )
    console.print(table)
    console.print(Text(summary_line(result), style="bold green" if result.passed else "bold red"))


def cell_line(c: CellResult, total: int) -> str:
    """One line as a cell finishes: ``[3/12] cell-002 chunk_size=5 lengths=12: FAIL (...), layer 3, token 5
    (onset 5) (0.41 s)``."""
    fd = c.first_divergent
    where = "" if fd is None else f", layer {fd.layer}, token {_dash(c.first_token)} (onset {_dash(c.onset)})"
    hits = "" if c.cache_hits is None else f", {c.cache_hits} cache hits"
    reused = ", engine reused" if c.engine_reused else ""
    head = f"[{c.index + 1}/{total}] {c.name} {describe(c.settings)}"
    return f"{head}: {c.verdict}{where}{hits} ({c.wall_s:.2f} s{reused})"
