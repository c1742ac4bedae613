"""The verdict and a compact per-layer table as Markdown, for pasting into a PR (``--markdown``).

The table shows the multiples of the noise with a noise file and each layer's amplification; the
first divergent layer is in bold. With MoE routing, a routing table follows (its first failing
layer in bold) with the first failing flips. Text from a dump (names, paths) is escaped so that it shows as
it is and cannot open a tag, a link or a table cell.

Example::

    from comparator import compare_dumps
    from comparator.reports.markdown import to_markdown
    print(to_markdown(compare_dumps("dumps/eager", "dumps/sdpa")))
"""

from __future__ import annotations

import html
import os
import re

from comparator.hidden.types import Report
from comparator.outcome import (
    Outcome,
    clause,
    describe_decode,
    describe_speculative,
    reaches_output,
    sentence,
    status,
    threshold_summary,
)
from comparator.reports.layer_table import FIRST_DIVERGENCE, ONSET, layer_table
from comparator.reports.logprob_table import metric_rows
from comparator.reports.routing_table import (
    flip_rows,
    flips_title,
    layer_head,
    layer_rows,
    routing_notes,
    routing_summary,
    routing_title,
)
from comparator.reports.speculative_table import DRAFT_HEAD, draft_rows, draft_title
from comparator.routing.types import RouterComparison
from dumper.format import atomic_path

__all__ = ["to_markdown", "write_markdown"]


_MD_PUNCT = re.compile(r"([\\`*_\[\]|~$])")
_NEWLINES = re.compile(r"[\r\n]+")


def _md(text: str) -> str:
    """Text from a dump (names, paths, request ids) as inline Markdown that shows it as it is.

    HTML characters become entities (``<b>`` cannot open a tag), the Markdown punctuation that
    could start emphasis, code, a link or a table cell is backslash-escaped, newlines folded.
    """
    return html.escape(_MD_PUNCT.sub(r"\\\1", _NEWLINES.sub(" ", text)), quote=False)


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _code(text: str) -> str:
    """``text`` as a Markdown code span (literal inside: no HTML, no emphasis); the fence is one
    backtick longer than any run of backticks in it, padded when it starts or ends with one."""
    text = _NEWLINES.sub(" ", text)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _verdict_line(report: Report) -> str:
    """``**driftscope: DIVERGED** at layer ...``, ``**driftscope: DIVERGED**: routing ...``; a pass says
    why in words."""
    outcome, rest = Outcome.of(report), clause(report, escape=_md)
    return f"**driftscope: {outcome.word}**{outcome.separator if rest else ' '}{rest or f'({sentence(report)})'}"


def _routing(router: RouterComparison) -> list[str]:
    """The routing table (the first failing layer's number and verdict in bold), the first failing
    flips and the notes, as Markdown lines."""
    head, rows = layer_head(router), layer_rows(router)
    lines = [f"{_md(routing_title(router))}: {_md(routing_summary(router))}"]
    lines += (
        [
            "",
            "| " + " | ".join(_md(label) for label, _ in head) + " |",
            "|" + "|".join("---:" if kind == "num" else ":---" for _, kind in head) + "|",
        ]
        if rows
        else []
    )
    for row in rows:
        cells = [_md(c) for c in row.cells]
        cells[0], cells[-1] = _bold(cells[0], row.first), _bold(cells[-1], row.first)
        lines.append("| " + " | ".join(cells) + " |")
    if flips := flip_rows(router):
        lines += ["", f"{_md(flips_title(router))}:", ""]
        lines += [
            f"- layer {c[0]}, sequence {c[1]}, token {c[2]}: experts {_md(c[3])}, margin {c[4]} ({_md(c[5])}), {c[6]}"
            for c in (f.cells for f in flips)
        ]
    return lines + [line for n in routing_notes(router) for line in ("", _md(n))]


def _layer_lines(report: Report) -> list[str]:
    """The per-layer table as Markdown lines: the first divergence's layer and verdict in bold, the onset
    layer named in the verdict cell (as in the terminal), the amplification of a layer that introduces error
    in bold; then the legend, if any. The cells are numbers and words of ours, so they are not escaped."""
    layers = layer_table(report)
    amp = layers.column("amplification")
    lines = [
        "| " + " | ".join(label.replace("|", "\\|") for label, _ in layers.head) + " |",
        "|" + "|".join("---:" if kind == "num" else ":---" for _, kind in layers.head) + "|",
    ]
    for row in layers.rows:
        cells = [c.text for c in row.cells]
        cells[0], cells[amp] = _bold(cells[0], row.first), _bold(cells[amp], row.introduced)
        if row.first:
            cells[-1] = _bold(FIRST_DIVERGENCE, True)
        elif row.onset:
            cells[-1] += f" {ONSET}"
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines + ([_md(layers.legend), ""] if layers.legend is not None else [])


def to_markdown(report: Report) -> str:
    """The verdict line, a per-layer table (first divergent layer in bold) and the thresholds, as Markdown."""
    lines = [_verdict_line(report), ""]
    if report.tensors:
        lines += _layer_lines(report)
    summary = (
        f"target {_code(report.target)} vs baseline {_code(report.baseline)}; matched {report.matched} "
        f"tensors; {threshold_summary(report, quote=_code)}"
    )
    if report.unmatched_baseline or report.unmatched_target:
        summary += (
            f"; {len(report.unmatched_baseline)} tensors only in the baseline, "
            f"{len(report.unmatched_target)} only in the target"
        )
    lines.append(summary)
    lines += [line for n in describe_decode(report) for line in ("", _md(n))]  # steps compared, forks
    lines += [line for n in describe_speculative(report) for line in ("", _md(n))]  # acceptance per side
    if rows := draft_rows(report.speculative):
        assert report.speculative is not None
        lines += [
            "",
            f"{_md(draft_title(report.speculative))}:",
            "",
            "| " + " | ".join(_md(label) for label, _ in DRAFT_HEAD) + " |",
            "|" + "|".join("---:" if kind == "num" else ":---" for _, kind in DRAFT_HEAD) + "|",
            *("| " + " | ".join(_md(c) for c in cells) + " |" for cells in rows),
        ]
    if report.router is not None:
        lines += ["", *_routing(report.router)]
    if report.logprobs is not None:
        v = report.logprobs
        verdict = status(v.passed, ", ".join(v.failures()))
        lines += [
            "",
            f"logprobs: {verdict}: {_md(reaches_output(report))}",
            "",
            "logprob metrics: "
            + "; ".join(
                f"{_bold(_md(r.label), r.failing)} {_md(r.value)} (threshold {r.threshold})" for r in metric_rows(v)
            ),
        ]
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, path: str | os.PathLike[str]) -> None:
    """:func:`to_markdown` written to ``path`` atomically."""
    text = to_markdown(report)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
