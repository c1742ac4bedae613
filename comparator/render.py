"""Terminal rendering of a :class:`Report` with rich: a per-layer table and the verdict."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .report import FirstDivergence, Report

__all__ = ["render_report", "format_float", "describe_divergence"]


def format_float(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if math.isinf(v):
        return "inf"
    return "0" if v == 0 else f"{v:.3e}"


def _token(v: int | None) -> str:
    return "-" if v is None else str(v)


def render_report(report: Report, console: Console, *, tensors: bool = False) -> None:
    """Print the per-layer table (and the per-tensor table with ``tensors=True``)."""
    fd = report.first_divergent
    table = Table(title=f"{report.target}  vs  baseline {report.baseline}", title_justify="left")
    for col, justify in (("layer", "right"), ("tensors", "right"), ("rel_diff", "right"),
                         ("max token rel_diff", "right"), ("max |diff|", "right"), ("min cosine", "right"),
                         ("first failing token", "right"), ("worst token", "right"), ("verdict", "left")):
        table.add_column(col, justify=justify)
    for s in report.layers():
        first = fd is not None and s.layer == fd.layer
        verdict = Text("PASS", style="green") if s.passed else Text(f"FAIL ({s.failed})", style="bold red")
        if first:
            verdict = Text("FIRST DIVERGENCE", style="bold white on red")
        table.add_row(
            "-" if s.layer is None else str(s.layer), str(s.tensors), format_float(s.max_rel_diff),
            format_float(s.max_token_rel_diff), format_float(s.max_abs_diff), f"{s.min_cosine:.6f}",
            _token(s.first_failing_token), _token(s.worst_token), verdict,
            style="bold" if first else None,
        )
    console.print(table)
    if tensors:
        _render_tensors(report, console)
    for side, names in (("baseline", report.unmatched_baseline), ("target", report.unmatched_target)):
        if names:
            shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
            console.print(f"[yellow]unmatched in {side} ({len(names)}):[/] {shown}")
    summary = (f"matched {report.matched} tensors; thresholds rel_diff <= {report.threshold:g}, "
               f"per-token rel_diff <= {report.token_threshold:g}")
    for m in report.replica_mismatches[:10]:
        console.print(f"[bold red]replica mismatch[/] in the {m.side}: {m.name} (layer {m.layer}, sequence "
                      f"{m.sequence}) differs between rank {m.reference_rank} and rank {m.rank} from token "
                      f"{m.first_token} (max per-token rel_diff {format_float(m.max_token_rel_diff)})")
    if fd is None:
        verdict = "[bold green]PASS[/]" if report.passed else "[bold red]DIVERGED[/] (replicas differ)"
        console.print(f"{verdict}: {summary}")
    else:
        console.print(f"[bold red]DIVERGED[/] {describe_divergence(fd)}. {summary}")


def _ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


def describe_divergence(fd: FirstDivergence) -> str:
    """One sentence: where the first divergence is, which sequence and tokens fail, and why it may be."""
    where = f"layer {fd.layer}" if fd.layer is not None else "a tensor without layer"
    text = f"at {where} ({fd.name}, pass {fd.forward_pass}, rank {fd.rank})"
    if fd.token is not None:
        text += f", first failing token {fd.token}"
    if fd.sequence is not None:
        text += f" of sequence {fd.sequence}"
    if fd.note:
        text += f" ({fd.note})"
    if fd.worst_token is not None:
        text += f", worst token {fd.worst_token}"
    if fd.failing_ranges:
        text += f"; failing tokens {_ranges(fd.failing_ranges)}"
    if len(fd.failing_sequences) > 1:
        text += f"; failing sequences {fd.failing_sequences}"
    return text + f"; rel_diff {format_float(fd.rel_diff)}"


def _render_tensors(report: Report, console: Console) -> None:
    table = Table(title="tensors", title_justify="left")
    for col in ("name", "layer", "seq", "pass", "rank", "rel_diff", "max token", "max |diff|", "cosine",
                "nan/inf b", "nan/inf t", "failing tokens", "first token", "verdict"):
        table.add_column(col)
    for t in report.tensors:
        table.add_row(
            t.name, "-" if t.layer is None else str(t.layer), "-" if t.sequence is None else str(t.sequence),
            str(t.forward_pass), str(t.rank),
            format_float(t.rel_diff), format_float(t.max_token_rel_diff), format_float(t.max_abs_diff),
            f"{t.cosine:.6f}", f"{t.nan_baseline}/{t.inf_baseline}", f"{t.nan_target}/{t.inf_target}",
            str(t.failing_tokens), _token(t.first_failing_token),
            Text("PASS", style="green") if t.passed else Text("FAIL", style="bold red"),
        )
    console.print(table)
