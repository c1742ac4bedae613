"""Machine- and human-readable outputs of a :class:`~comparator.results.Report`, and the CLI flags for them.

- :func:`to_markdown`: the verdict line and a compact per-layer table (multiples of the noise with
  a noise file, each layer's amplification), for pasting into a PR;
- :func:`write_parquet`: the per-tensor table (one row per tensor, as ``--csv``) as Parquet;
- :func:`add_output_flags` / :func:`check_output_flags` / :func:`write_outputs`: ``--html``,
  ``--plot``, ``--parquet``, ``--markdown [FILE]`` and ``--format {table,json}`` for
  ``python -m comparator``;
- :func:`progress_callback`: the comparison's progress bar (stderr, TTY only, after 1 s).

Example::

    from comparator import compare_dumps
    from comparator.reports.outputs import to_markdown, write_parquet
    report = compare_dumps("dumps/eager", "dumps/sdpa")
    print(to_markdown(report))
    write_parquet(report, "tensors.parquet")
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from dumper.errors import UsageError
from dumper.format import atomic_path, load_manifest
from dumper.progress import ProgressFn, progress_bar

from comparator.reports.text import describe_divergence, format_float, format_ratio, reaches_output
from comparator.results import LayerSummary, Report

__all__ = ["to_markdown", "write_markdown", "write_parquet", "add_output_flags", "check_output_flags",
           "write_outputs", "progress_callback", "STDOUT"]

STDOUT = "-"
"""``--markdown`` without a file: write to stdout."""


_MD_PUNCT = re.compile(r"([\\`*_\[\]|~$])")
_NEWLINES = re.compile(r"[\r\n]+")


def _md(text: str) -> str:
    """Text from a dump (names, paths, request ids) as inline Markdown that shows it as it is.

    HTML characters become entities (``<b>`` cannot open a tag), the Markdown punctuation that
    could start emphasis, code, a link or a table cell is backslash-escaped, newlines folded.
    """
    return html.escape(_MD_PUNCT.sub(r"\\\1", _NEWLINES.sub(" ", text)), quote=False)


def _code(text: str) -> str:
    """``text`` as a Markdown code span (literal inside: no HTML, no emphasis); the fence is one
    backtick longer than any run of backticks in it, padded when it starts or ends with one."""
    text = _NEWLINES.sub(" ", text)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _verdict_line(report: Report) -> str:
    fd = report.first_divergent
    if report.passed:
        return "**driftscope: PASS** (every matched tensor passed)"
    if fd is not None:
        return f"**driftscope: DIVERGED** {_md(describe_divergence(fd))}"
    if report.replica_mismatches:
        return "**driftscope: DIVERGED** (replicas differ)"
    failures = ", ".join(report.logprobs.failures()) if report.logprobs is not None else ""
    return f"**driftscope: DIVERGED** (logprobs: {failures})"


def _layer_cells(report: Report, s: LayerSummary) -> list[str]:
    """One Markdown table row's cells: the first divergent layer in bold, the onset layer named in
    the verdict cell (as in the terminal), the amplification of a layer that introduces error in bold."""
    fd = report.first_divergent
    first = fd is not None and s.layer == fd.layer
    verdict = "**FIRST DIVERGENCE**" if first else "PASS" if s.passed else f"FAIL ({s.failed})"
    if fd is not None and s.layer is not None and s.layer == fd.onset_layer and not first:
        verdict += " ONSET"
    layer = "-" if s.layer is None else str(s.layer)
    amp = format_ratio(s.amplification)
    cells = [f"**{layer}**" if first else layer, str(s.tensors), format_float(s.max_rel_diff)]
    cells += [format_ratio(s.noise_ratio)] if report.noise is not None else []
    return cells + [format_float(s.max_token_rel_diff), format_float(s.max_abs_diff), f"{s.min_cosine:.6f}",
                    f"**{amp}**" if s.introduced else amp,
                    "-" if s.first_failing_token is None else str(s.first_failing_token),
                    "-" if s.worst_token is None else str(s.worst_token), verdict]


def _thresholds(report: Report) -> str:
    if report.noise is None:
        return f"thresholds rel_diff <= {report.threshold:g}, per-token rel_diff <= {report.token_threshold:g}"
    return f"thresholds {report.noise_factor:g} x the noise in {_code(report.noise)} (floor {report.noise_floor:g})"


def to_markdown(report: Report) -> str:
    """The verdict line, a per-layer table (first divergent layer in bold) and the thresholds, as Markdown."""
    lines = [_verdict_line(report), ""]
    if report.tensors:
        noise = " x noise |" if report.noise is not None else ""
        lines += [f"| layer | tensors | rel_diff |{noise} max token rel_diff | max \\|diff\\| | min cosine "
                  "| amplification | first failing token | worst token | verdict |",
                  "|---:" * (9 + bool(noise)) + "|:---|"]
        lines += ["| " + " | ".join(_layer_cells(report, s)) + " |" for s in report.layers()]
        lines.append("")
    summary = (f"target {_code(report.target)} vs baseline {_code(report.baseline)}; matched {report.matched} "
               f"tensors; {_thresholds(report)}")
    if report.unmatched_baseline or report.unmatched_target:
        summary += (f"; {len(report.unmatched_baseline)} tensors only in the baseline, "
                    f"{len(report.unmatched_target)} only in the target")
    lines.append(summary)
    if report.logprobs is not None:
        v = report.logprobs
        verdict = "PASS" if v.passed else f"FAIL ({', '.join(v.failures())})"
        lines += ["", f"logprobs: {verdict}: {_md(reaches_output(report))}"]
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, path: str | os.PathLike[str]) -> None:
    """:func:`to_markdown` written to ``path`` atomically."""
    text = to_markdown(report)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _need_pyarrow() -> None:
    if importlib.util.find_spec("pyarrow") is None:
        raise UsageError("--parquet needs pyarrow: pip install pyarrow")


def write_parquet(report: Report, path: str | os.PathLike[str]) -> None:
    """The per-tensor table (the columns of ``--csv``) as Parquet via pandas + pyarrow, written atomically.

    Raises UsageError when pyarrow is not installed.
    """
    _need_pyarrow()
    df = report.to_dataframe()
    if "shape" in df:
        df["shape"] = df["shape"].map(list)
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False, engine="pyarrow")


# --------------------------------------------------------------------------- CLI helpers


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--html``, ``--plot``, ``--parquet``, ``--markdown [FILE]`` and ``--format`` to ``parser``."""
    g = parser.add_argument_group("report outputs")
    g.add_argument("--html", metavar="FILE", help="write a self-contained HTML report: per-layer chart, token heatmap, "
                   "logprob plots, sortable tensor table")
    g.add_argument("--plot", metavar="FILE.png", help="write the per-layer rel_diff chart (.png, .svg or .pdf)")
    g.add_argument("--parquet", metavar="FILE", help="write the per-tensor table as Parquet (needs pyarrow)")
    g.add_argument("--markdown", metavar="FILE", nargs="?", const=STDOUT,
                   help="write the verdict and a per-layer Markdown table for a PR; to stdout without FILE")
    g.add_argument("--format", choices=("table", "json"), default="table",
                   help="what stdout gets: the table (default), or the JSON report for piping (then no table)")


def check_output_flags(args: argparse.Namespace) -> None:
    """Refuse impossible output flags before any work: call it right after parsing."""
    if getattr(args, "parquet", None):
        _need_pyarrow()
    if getattr(args, "format", "table") == "json" and getattr(args, "markdown", None) == STDOUT:
        raise UsageError("--markdown without FILE writes to stdout, which --format json already uses; give a FILE")


def _write(path: str, what: str, write: Callable[[str], None]) -> None:
    try:
        write(path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write the {what} ({e.strerror})") from None


def write_outputs(report: Report, args: argparse.Namespace, baseline_dir: str | os.PathLike[str],
                  target_dir: str | os.PathLike[str], *, stdout: TextIO | None = None) -> None:
    """Write what the flags of :func:`add_output_flags` ask for.

    ``--format json`` prints the JSON report to ``stdout`` (the caller then prints no table);
    ``--markdown`` without a file prints the Markdown there. Manifests (for the HTML's run
    details and token texts) are read from the two dump directories. An unwritable path is a
    UsageError naming it.
    """
    out = stdout or sys.stdout
    if getattr(args, "format", "table") == "json":
        out.write(report.dumps() + "\n")
    if getattr(args, "html", None):
        from comparator.reports.html import write_html  # matplotlib is imported only when a chart is wanted

        manifests = {"baseline_manifest": load_manifest(baseline_dir), "target_manifest": load_manifest(target_dir)}
        _write(args.html, "HTML report", lambda p: write_html(report, p, **manifests))
    if getattr(args, "plot", None):
        from comparator.reports.plots import save_layer_plot

        _write(args.plot, "plot", lambda p: save_layer_plot(report, p))
    if getattr(args, "parquet", None):
        _write(args.parquet, "Parquet table", lambda p: write_parquet(report, p))
    markdown = getattr(args, "markdown", None)
    if markdown == STDOUT:
        out.write(to_markdown(report))
    elif markdown:
        _write(markdown, "Markdown report", lambda p: write_markdown(report, p))
    out.flush()


@contextmanager
def progress_callback(enabled: bool) -> Iterator[ProgressFn]:
    """A ``progress(done, total)`` for :func:`~comparator.hidden.compare.compare_dumps`: a transient bar on
    stderr, drawn only on a terminal, when ``enabled`` (not ``--quiet``) and after 1 s of work."""
    with progress_bar(enabled, "comparing", unit="tensors") as progress:
        yield progress
