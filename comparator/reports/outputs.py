"""The report outputs of ``python -m comparator``: a registry of file formats, their flags, and the progress bar.

Each format is one :class:`OutputFormat` (flag name, help, writer function) registered with
:func:`register_output`; :func:`add_output_flags` adds a ``--NAME FILE`` flag per registered
format (in registration order) plus ``--format {table,json}``, and :func:`write_outputs` writes
what the parsed flags ask for. The built-in formats: ``--html`` (:mod:`comparator.reports.html`),
``--plot`` (:mod:`comparator.reports.plots`), ``--parquet`` (:mod:`comparator.reports.files`) and
``--markdown [FILE]`` (:mod:`comparator.reports.markdown`; to stdout without FILE).

A new format is one module with a writer and one registration, before the parser is built::

    from comparator.reports.outputs import OutputFormat, register_output

    def write_summary(report, path, dumps):  # dumps: the two dumps (manifests on demand)
        Path(path).write_text(f"{report.matched} tensors, passed: {report.passed}\\n")

    register_output(OutputFormat("summary", "summary", write_summary, metavar="FILE", help="write a one-line summary"))

:func:`progress_callback` is the comparison's progress bar (stderr, TTY only, after 1 s).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TextIO

from comparator.hidden.types import Report
from comparator.reports.files import json_text, need_pyarrow, write_parquet
from dumper.errors import UsageError
from dumper.format import Manifest
from dumper.format.remote_read import dump_manifest
from dumper.progress import ProgressFn, progress_bar

__all__ = [
    "OutputFormat",
    "Dumps",
    "OUTPUT_FORMATS",
    "register_output",
    "add_output_flags",
    "check_output_flags",
    "write_outputs",
    "progress_callback",
    "STDOUT",
]

STDOUT = "-"
"""A format's flag without a file (``--markdown``): write to stdout."""


class Dumps:
    """The two dumps a report came from (directories or URLs); their manifests are read on first use."""

    def __init__(self, baseline: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        self.baseline, self.target = baseline, target

    @cached_property
    def baseline_manifest(self) -> Manifest:
        return dump_manifest(self.baseline)

    @cached_property
    def target_manifest(self) -> Manifest:
        return dump_manifest(self.target)


@dataclass(frozen=True)
class OutputFormat:
    """One report file format behind a ``--NAME FILE`` flag.

    ``write(report, path, dumps)`` writes the file (atomically); ``what`` names it in the error for
    an unwritable path; ``check()`` refuses the flag before any work (a missing library);
    ``to_stdout(report)``, when set, makes FILE optional: the flag alone prints that text.
    """

    name: str
    what: str
    write: Callable[[Report, str, Dumps], None]
    metavar: str
    help: str
    check: Callable[[], None] | None = None
    to_stdout: Callable[[Report], str] | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


OUTPUT_FORMATS: dict[str, OutputFormat] = {}
"""The registered formats by name, in registration order (the order of the flags and of writing)."""


def register_output(fmt: OutputFormat) -> OutputFormat:
    """Add ``fmt`` to :data:`OUTPUT_FORMATS` (a name is registered once); returns it."""
    if fmt.name in OUTPUT_FORMATS or fmt.name == "format":
        raise ValueError(f"report output {fmt.name!r} is already registered")
    OUTPUT_FORMATS[fmt.name] = fmt
    return fmt


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag per registered format and ``--format`` to ``parser``, in a "report outputs" group."""
    g = parser.add_argument_group("report outputs")
    for fmt in OUTPUT_FORMATS.values():
        optional: dict[str, Any] = {"nargs": "?", "const": STDOUT} if fmt.to_stdout is not None else {}
        g.add_argument(f"--{fmt.name}", metavar=fmt.metavar, help=fmt.help, **optional)
    g.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="what stdout gets: the table (default), or the JSON report for piping (then no table)",
    )


def check_output_flags(args: argparse.Namespace) -> None:
    """Refuse impossible output flags before any work: call it right after parsing."""
    for fmt in OUTPUT_FORMATS.values():
        value = getattr(args, fmt.dest, None)
        if value and fmt.check is not None:
            fmt.check()
        if value == STDOUT and fmt.to_stdout is not None and getattr(args, "format", "table") == "json":
            raise UsageError(
                f"--{fmt.name} without FILE writes to stdout, which --format json already uses; give a FILE"
            )


def _write(path: str, what: str, write: Callable[[str], None]) -> None:
    try:
        write(path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write the {what} ({e.strerror})") from None


def write_outputs(
    report: Report,
    args: argparse.Namespace,
    baseline_dir: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    *,
    stdout: TextIO | None = None,
) -> None:
    """Write what the flags of :func:`add_output_flags` ask for.

    ``--format json`` prints the JSON report to ``stdout`` (the caller then prints no table); a
    format's flag without a file prints its text there. Manifests (for the HTML's run details and
    token texts) are read from the two dumps (directories or URLs) when a format asks. An unwritable path
    is a UsageError naming it.
    """
    out = stdout or sys.stdout
    if getattr(args, "format", "table") == "json":
        out.write(json_text(report) + "\n")
    dumps = Dumps(baseline_dir, target_dir)
    for fmt in OUTPUT_FORMATS.values():
        path = getattr(args, fmt.dest, None)
        if path == STDOUT and fmt.to_stdout is not None:
            out.write(fmt.to_stdout(report))
        elif path:
            _write(path, fmt.what, lambda p, fmt=fmt: fmt.write(report, p, dumps))
    out.flush()


@contextmanager
def progress_callback(enabled: bool) -> Iterator[ProgressFn]:
    """A ``progress(done, total)`` for :func:`~comparator.hidden.compare.compare_dumps`: a transient bar on
    stderr, drawn only on a terminal, when ``enabled`` (not ``--quiet``) and after 1 s of work."""
    with progress_bar(enabled, "comparing", unit="tensors") as progress:
        yield progress


# --------------------------------------------------------------------------- the built-in formats


def _html(report: Report, path: str, dumps: Dumps) -> None:
    from comparator.reports.html import write_html  # matplotlib is imported only when a chart is wanted

    write_html(report, path, baseline_manifest=dumps.baseline_manifest, target_manifest=dumps.target_manifest)


def _markdown(report: Report, path: str, dumps: Dumps) -> None:
    from comparator.reports.markdown import write_markdown  # with the logprob and routing tables it renders

    write_markdown(report, path)


def _markdown_text(report: Report) -> str:
    from comparator.reports.markdown import to_markdown

    return to_markdown(report)


def _plot(report: Report, path: str, dumps: Dumps) -> None:
    from comparator.reports.plots import save_layer_plot

    save_layer_plot(report, path)


register_output(
    OutputFormat(
        "html",
        "HTML report",
        _html,
        metavar="FILE",
        help="write a self-contained HTML report: per-layer chart, token heatmap, logprob plots, MoE routing, "
        "sortable tensor table",
    )
)
register_output(
    OutputFormat(
        "plot", "plot", _plot, metavar="FILE.png", help="write the per-layer rel_diff chart (.png, .svg or .pdf)"
    )
)
register_output(
    OutputFormat(
        "parquet",
        "Parquet table",
        lambda report, path, dumps: write_parquet(report, path),
        metavar="FILE",
        help="write the per-tensor table as Parquet (needs pyarrow)",
        check=need_pyarrow,
    )
)
register_output(
    OutputFormat(
        "markdown",
        "Markdown report",
        _markdown,
        metavar="FILE",
        to_stdout=_markdown_text,
        help="write the verdict and per-layer Markdown tables (hidden states, MoE routing) "
        "for a PR; to stdout without FILE",
    )
)
