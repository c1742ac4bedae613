"""One self-contained HTML file per comparison, for a person to open in a browser.

The page holds the verdict (where the divergence starts, then where it first fails), both runs' model, capture
and environment side by side (what differs is highlighted), the per-layer rel_diff chart and table (multiples of
the calibrated noise, each layer's amplification as :mod:`comparator.reports.layer_table` writes it, the layer
that introduces error highlighted), the amplification chart, the token x layer heatmap from the onset to the first
failing token, the logprob plots with the worst positions and their tokens, the MoE routing per layer with its
first failing flips, and every tensor in a table sortable by
clicking its headers. Charts are inline SVG (matplotlib), style and the sorting script inline: the file fetches
nothing, so it works offline, as a CI artifact, or attached to a bug report.

Example::

    from comparator import compare_dumps
    from comparator.reports.html import write_html
    from dumper.format import load_manifest
    report = compare_dumps("dumps/one", "dumps/chunked")
    write_html(report, "report.html", baseline_manifest=load_manifest("dumps/one"),
               target_manifest=load_manifest("dumps/chunked"))
"""

from __future__ import annotations

import html
import itertools
import json
import math
import os
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from comparator.formatting import format_float, format_located, format_ratio
from comparator.hidden.registry import columns as metric_columns
from comparator.hidden.types import FirstDivergence, Report
from comparator.logprobs import LogprobVerdict, PositionSeries
from comparator.outcome import Outcome, reaches_output, sentence, status, threshold_summary, verdict_notes
from comparator.reports.layer_table import FIRST_DIVERGENCE, ONSET, layer_table
from comparator.reports.logprob_table import metric_rows
from comparator.reports.plots import amplification_figure, figure_svg, heatmap_figure, layer_figure, logprob_figure
from comparator.reports.routing_table import (
    FLIP_HEAD,
    flip_rows,
    flips_title,
    layer_head,
    layer_rows,
    routing_notes,
    routing_summary,
    routing_title,
)
from comparator.reports.tokens import TokenLookup, show_text
from comparator.routing.types import RouterComparison
from dumper.format import Manifest, atomic_path
from dumper.version import __version__

if TYPE_CHECKING:
    from dumper.tokenizers import Tokenizer

__all__ = ["render_html", "write_html", "MAX_ROWS", "WORST_POSITIONS"]

MAX_ROWS = 20_000
"""Tensor table rows shown; a larger report says how many were left out (the CSV has them all)."""
WORST_POSITIONS = 10
"""Positions listed per logprob ranking."""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1180px;\
padding:0 16px 40px;color:#222}
h1{margin:0;font-size:24px}h2{margin:22px 0 6px;font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px}
.verdict{padding:10px 18px;margin-top:12px;border-radius:6px}.verdict p{margin:6px 0}
.pass{background:#e8f6ec;border-left:6px solid #27ae60}
.fail{background:#fdecea;border-left:6px solid #c0392b}.muted{color:#666}.chart{margin:0}\
.chart svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:12.5px;width:100%}\
th,td{padding:3px 7px;border-bottom:1px solid #eee;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}tr.bad td{background:#fdf1f0}tr.diff td{background:#fff7e0}
th{background:#f5f5f5;position:sticky;top:0}table.sortable th{cursor:pointer;user-select:none}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
code{background:#f3f3f3;padding:0 3px;border-radius:3px}.tok{display:inline-block;white-space:pre;margin:0 2px 2px 0}
.hit{background:#f9d2cd;outline:1px solid #c0392b}.onset{background:#fde3c8;outline:2px solid #e67e22}
tr.introduced td{background:#fff0dc;font-weight:600}tr.first td{font-weight:700}
.scroll{max-height:640px;overflow:auto;border:1px solid #eee}
"""

_JS = """
document.querySelectorAll("table.sortable").forEach(function (t) {
  t.querySelectorAll("th").forEach(function (th, i) {
    th.addEventListener("click", function () {
      var asc = th.getAttribute("aria-sort") !== "ascending", num = th.dataset.type === "num";
      t.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", asc ? "ascending" : "descending");
      var key = function (r) { var c = r.cells[i], v = c.dataset.v !== undefined ? c.dataset.v : c.textContent;
        return num ? (v === "" ? NaN : Number(v)) : v; };
      var rows = Array.prototype.slice.call(t.tBodies[0].rows).map(function (r) { return [key(r), r]; });
      rows.sort(function (a, b) {
        if (num) { var an = isNaN(a[0]), bn = isNaN(b[0]); if (an || bn) return an - bn;
          return asc ? a[0] - b[0] : b[0] - a[0]; }
        return asc ? String(a[0]).localeCompare(b[0]) : String(b[0]).localeCompare(a[0]); });
      var frag = document.createDocumentFragment();
      rows.forEach(function (p) { frag.appendChild(p[1]); });
      t.tBodies[0].appendChild(frag);
    });
  });
});
"""


_METHODS = {
    "calibrated": "over its calibrated noise",
    "change-point": "change point estimated from the run",
    "threshold": "no earlier departure stood out: the first over the threshold",
}


def escape(v: Any) -> str:
    """``v`` as text for an HTML element or a quoted attribute (quotes escaped too)."""
    return html.escape(str(v), quote=True)


def sort_key(x: float | int | None) -> str:
    """A sort key for ``data-v``: what JavaScript's ``Number()`` reads back."""
    if x is None:
        return ""
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    if isinstance(x, float) and math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def num_cell(x: float | int | None, text: str | None = None) -> str:
    """A right-aligned cell showing ``text`` (default: ``x`` formatted), sorted by ``x``."""
    shown = text if text is not None else "-" if x is None else format_float(x) if isinstance(x, float) else str(x)
    return f'<td class="n" data-v="{escape(sort_key(x))}">{escape(shown)}</td>'


def table(head: Sequence[tuple[str, str]], rows: Iterable[str], *, sortable: bool = False, table_id: str = "") -> str:
    """A table; ``head`` holds (label, "num"|"str") pairs, ``rows`` finished ``<tr>`` elements."""
    ths = "".join(f'<th data-type="{t}">{escape(label)}</th>' for label, t in head)
    attrs = (f' id="{escape(table_id)}"' if table_id else "") + (' class="sortable"' if sortable else "")
    return f"<table{attrs}><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _cells(cells: tuple[str, ...], head: tuple[tuple[str, str], ...]) -> str:
    return "".join(
        f'<td class="n">{escape(c)}</td>' if kind == "num" else f"<td>{escape(c)}</td>"
        for c, (_, kind) in zip(cells, head, strict=True)
    )


def routing_section(router: RouterComparison) -> str:
    """``<section id="routing">``: the summary, the per-layer table (``tr.first`` marks the first
    failing layer, ``tr.bad`` every failing one), the flip list and the notes."""
    head = layer_head(router)
    rows = []
    for row in layer_rows(router):
        cls = " ".join(["bad"] * (not row.passed) + ["first"] * row.first)
        rows.append(f'<tr class="{cls}">{_cells(row.cells, head)}</tr>')
    out = [
        f'<section id="routing"><h2>Routing: {status(router.passed)}</h2>',
        f'<p class="muted">{escape(routing_title(router))}: {escape(routing_summary(router))}</p>',
        table(head, rows, table_id="routing-table") if rows else "",
    ]
    if flips := flip_rows(router):
        listed = [("<tr>" if f.benign else '<tr class="bad">') + _cells(f.cells, FLIP_HEAD) + "</tr>" for f in flips]
        out.append(f"<h3>{escape(flips_title(router))}</h3>" + table(FLIP_HEAD, listed, table_id="routing-flips"))
    out += [f'<p class="muted">{escape(n)}</p>' for n in routing_notes(router)]
    return "".join(out) + "</section>"


def _onset(fd: FirstDivergence) -> str:
    """Where the divergence starts: onset token and onset layer with their methods
    (see :mod:`comparator.hidden.onset`)."""
    seq = f" of sequence {fd.sequence}" if fd.sequence is not None else ""
    parts = [
        f"{what} <strong>{escape(at)}</strong>{escape(where)} ({escape(_METHODS.get(how or '', how))})"
        for what, at, how, where in (
            ("token", fd.onset, fd.onset_method, seq),
            ("layer", fd.onset_layer, fd.onset_layer_method, ""),
        )
        if at is not None
    ]
    if not parts:
        return ""
    first = [f"token {fd.token}"] * (fd.token is not None) + [f"layer {fd.layer}"] * (fd.layer is not None)
    return (
        f'<p id="onset">Divergence starts at {" in ".join(parts)}; first over the threshold at '
        f"{escape(', '.join(first) or '-')}.</p>"
    )


def _verdict_section(report: Report) -> str:
    fd = report.first_divergent
    summary = "; ".join(
        escape(x) for x in [f"matched {report.matched} tensors", threshold_summary(report), *verdict_notes(report)]
    )
    head, line = Outcome.of(report).word, sentence(report)
    out = [
        f'<section class="verdict {"pass" if report.passed else "fail"}" id="verdict"><h1>{head}</h1>',
        _onset(fd) if fd is not None and not report.passed else "",
        f"<p>{escape(line)}</p>",
    ]
    if report.logprobs is not None:
        out.append(f"<p>{escape(reaches_output(report))}</p>")
    out.append(
        f'<p class="muted">target <code>{escape(report.target)}</code> vs baseline '
        f"<code>{escape(report.baseline)}</code>; {summary}</p></section>"
    )
    return "".join(out)


def _layer_table(report: Report) -> str:
    """A row per layer with its multiple of noise and amplification; first divergent, onset, introducing ones marked
    (a class on the row, a word in the verdict cell)."""
    layers, rows = layer_table(report), []
    for row in layers.rows:
        marks = [
            (m, c)
            for m, c, on in (
                (FIRST_DIVERGENCE, "first", row.first),
                (ONSET, "onset", row.onset),
                ("INTRODUCES ERROR", "introduced", row.introduced),
            )
            if on
        ]
        cls = " ".join(["bad"] * (not row.passed) + [c for _, c in marks])
        cells = [num_cell(c.value, c.text) for c in row.cells[:-1]]
        cells.append(f"<td>{escape(' '.join([row.cells[-1].text] + [m for m, _ in marks]))}</td>")
        rows.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>")
    legend = "" if layers.legend is None else f'<p class="muted" id="amplification-legend">{escape(layers.legend)}</p>'
    return table(layers.head, rows, table_id="layer-table") + legend


def _layers(report: Report) -> str:
    """The per-layer chart, table and amplification chart."""
    out = [
        '<section id="layers"><h2>rel_diff per layer</h2>',
        f'<figure class="chart" id="layer-chart">{figure_svg(layer_figure(report))}</figure>',
        _layer_table(report),
    ]
    if (fig := amplification_figure(report)) is not None:
        out.append(
            '<h3>Amplification</h3><p class="muted">the growth of the error across each layer; far above the '
            "others: that layer introduces error, near the usual growth: it passes inherited error on.</p>"
            f'<figure class="chart" id="amplification-chart">{figure_svg(fig)}</figure>'
        )
    return "".join(out) + "</section>"


def _facts(manifest: Manifest | None, env: dict[str, Any]) -> dict[str, str]:
    """What one run was: model, capture, job settings and environment, flattened to text."""
    facts: dict[str, Any] = {}
    if manifest is not None:
        facts.update({f"model.{k}": v for k, v in manifest.model.items()})
        sig = manifest.capture_signature
        facts.update({f"capture.{k}": sig[k] for k in ("dtype", "num_layers", "world_size", "points") if k in sig})
        if "layers" in sig:
            facts["hooks.layers"] = f"{len(sig['layers'])} layers"
        extra = dict(manifest.extra)
        prompts = extra.pop("input_ids", None) or []
        facts["run.prompts"] = f"{len(prompts)} prompts, {sum(len(p) for p in prompts)} tokens"
        facts.update({f"run.{k}": v for k, v in extra.items()})
        facts["dump.created_at"] = manifest.created_at
        facts["dump.tensors"] = len(manifest.tensors)
    facts.update({f"env.{k}": v for k, v in env.items()})
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in facts.items()}


def _runs(report: Report, base: Manifest | None, target: Manifest | None) -> str:
    env = report.environment
    a = _facts(base, env.get("baseline") or (base.environment if base else {}))
    b = _facts(target, env.get("target") or (target.environment if target else {}))
    keys = list(dict.fromkeys([*a, *b]))
    if not keys:
        return ""
    rows = []
    for k in keys:
        x, y = a.get(k, "-"), b.get(k, "-")
        cls = ' class="diff"' if x != y else ""
        rows.append(f"<tr{cls}><td>{escape(k)}</td><td>{escape(x[:300])}</td><td>{escape(y[:300])}</td></tr>")
    return (
        '<section id="runs"><h2>The two runs</h2><p class="muted">highlighted: what differs</p>'
        + table([("", "str"), ("baseline", "str"), ("target", "str")], rows)
        + "</section>"
    )


def _heatmap(report: Report, tokens: TokenLookup) -> str:
    hm, fd = report.heatmap, report.first_divergent
    out = ['<section id="heatmap"><h2>Token &times; layer heatmap</h2>']
    if hm is None:
        out.append(
            '<p class="muted">no heatmap: nothing diverged, or the divergent tensor has no token positions.'
            "</p></section>"
        )
        return "".join(out)
    first, onset, layer = (fd.token, fd.onset, fd.onset_layer) if fd is not None else (None, None, None)
    pos = hm.positions
    cuts = [0, *(j for j in range(1, len(pos)) if pos[j] - pos[j - 1] > 1), len(pos)]
    shown = ", ".join(f"{pos[a]}..{pos[b - 1]}" for a, b in itertools.pairwise(cuts))
    out.append(
        f'<p class="muted">per-token rel_diff of sequence {escape(hm.sequence)}, positions {escape(shown)}'
        + (
            f" (onset {escape(onset)}, first failing token {escape(first)}; the positions between are left out)"
            if len(cuts) > 2
            else ""
        )
        + ". A bug that starts at one token shows as a column; a chunk-boundary bug as a vertical edge.</p>"
    )
    decode_from = (
        fd.token - fd.decode_step if fd is not None and fd.token is not None and fd.decode_step is not None else None
    )  # the prompt part and the decode part, apart
    fig = heatmap_figure(
        hm,
        token_threshold=report.token_threshold,
        first_token=first,
        onset=onset,
        onset_layer=layer,
        decode_from=decode_from,
    )
    out.append(f'<figure class="chart" id="heatmap-chart">{figure_svg(fig)}</figure>')
    spans = []
    for i, p in enumerate(hm.positions):
        tid, text = tokens.token(hm.sequence, p)
        if tid is None:
            break
        if i and p - hm.positions[i - 1] > 1:
            spans.append(f'<span class="muted" title="positions {hm.positions[i - 1] + 1}..{p - 1}"> &hellip; </span>')
        label = show_text(text)[1:-1] if text is not None else f"#{tid}"
        cls = "tok hit" if p == first else "tok onset" if p == onset else "tok"
        spans.append(f'<code class="{cls}" title="position {p}, token id {tid}">{escape(label)}</code>')
    if spans:
        out.append(
            f'<p class="muted">tokens of the window (onset and first failing token marked):</p><p>{"".join(spans)}</p>'
        )
    return "".join(out) + "</section>"


def _logprob_metrics(v: LogprobVerdict) -> str:
    rows = [(r.label, r.value, r.threshold, r.failing) for r in metric_rows(v)]  # the metric table's, then details
    rows += [("rmse", format_float(v.rmse), "-", False), ("k3 max", format_located(v.k3_max), "-", False)]
    if v.top1_agreement is not None:
        rows.append(("top-1 agreement", f"{v.top1_agreement:.4%}", "-", False))
    out = []
    for label, value, limit, failing in rows:
        cls = ' class="bad"' if failing else ""
        out.append(f"<tr{cls}><td>{escape(label)}</td><td>{escape(value)}</td><td>{escape(limit)}</td></tr>")
    return table([("metric", "str"), ("value", "str"), ("threshold", "str")], out)


def _at(positions: np.ndarray | None, values: np.ndarray | None, pos: int) -> float | None:
    if positions is None or values is None:
        return None
    i = int(np.searchsorted(positions, pos))
    return float(values[i]) if i < positions.size and positions[i] == pos else None


def _worst(series: Sequence[PositionSeries], by: str, tokens: TokenLookup, n: int) -> str:
    """The ``n`` positions with the largest |Δ logprob| (``by="delta"``) or KL (``by="kl"``), with tokens."""
    cands: list[tuple[float, PositionSeries, int]] = []
    for s in series:
        pos, val = (s.kl_positions, s.kl) if by == "kl" else (s.positions, np.abs(s.delta))
        if pos is None or val is None or val.size == 0:
            continue
        val = np.where(np.isnan(val), np.inf, val)
        cands += [(float(val[i]), s, int(pos[i])) for i in np.argsort(-val, kind="stable")[:n]]
    cands.sort(key=lambda c: -c[0])
    rows = []
    for _, s, p in cands[:n]:
        tid, text = tokens.token(s.request, p)
        ref, tgt = _at(s.positions, s.ref, p), _at(s.positions, s.tgt, p)
        ctx = tokens.context(s.request, p)
        rows.append(
            "<tr>"
            + f"<td>{escape(s.request)}</td>"
            + num_cell(p)
            + num_cell(tid)
            + f"<td><code>{escape(show_text(text) if text is not None else '?')}</code></td>"
            + f'<td class="muted">{escape(show_text(ctx)) if ctx is not None else "-"}</td>'
            + num_cell(ref)
            + num_cell(tgt)
            + num_cell(None if ref is None or tgt is None else tgt - ref)
            + num_cell(_at(s.kl_positions, s.kl, p))
            + "</tr>"
        )
    head = [
        ("request", "str"),
        ("position", "num"),
        ("token id", "num"),
        ("token", "str"),
        ("text before", "str"),
        ("baseline logprob", "num"),
        ("target logprob", "num"),
        ("Δ", "num"),
        ("KL", "num"),
    ]
    return table(head, rows, sortable=True)


def _logprobs(report: Report, tokens: TokenLookup) -> str:
    v = report.logprobs
    if v is None:
        return ""
    out = [
        f'<section id="logprobs"><h2>Logprobs: {status(v.passed)}</h2>'
        f'<p class="muted">{v.compared_positions} positions in {v.requests} requests</p>',
        _logprob_metrics(v),
    ]
    fig = logprob_figure(v)
    if fig is None:
        out.append(
            '<p class="muted">per-position series are kept in memory only (not in the JSON report); '
            "render the HTML from a fresh comparison to see them.</p>"
        )
    else:
        out.append(f'<figure class="chart" id="logprob-chart">{figure_svg(fig)}</figure>')
        out.append(f"<h3>Worst positions by |Δ logprob|</h3>{_worst(v.series, 'delta', tokens, WORST_POSITIONS)}")
        if any(s.kl is not None for s in v.series):
            out.append(f"<h3>Worst positions by KL</h3>{_worst(v.series, 'kl', tokens, WORST_POSITIONS)}")
    return "".join(out) + "</section>"


def _tensors(report: Report, max_rows: int) -> str:
    shown = metric_columns(t.metrics for t in report.tensors)  # the metrics the tensors carry
    head = [
        ("name", "str"),
        ("layer", "num"),
        ("sequence", "num"),
        ("pass", "num"),
        ("rank", "num"),
        *((m.label, "num") for m in shown),
        ("NaN/Inf baseline", "num"),
        ("NaN/Inf target", "num"),
        ("failing tokens", "num"),
        ("first failing token", "num"),
        ("worst token", "num"),
        ("verdict", "str"),
        ("note", "str"),
    ]
    calibrated = any(t.noise_ratio is not None or t.token_noise_ratio is not None for t in report.tensors)
    if calibrated:  # right after the first metric (rel_diff)
        head[6:6] = [("x noise", "num"), ("token x noise", "num")]
    rows = []
    for t in report.tensors[:max_rows]:
        cells = [
            f"<td>{escape(t.name)}</td>",
            num_cell(t.layer),
            num_cell(t.sequence),
            num_cell(t.forward_pass),
            num_cell(t.rank),
            *(num_cell(t.metrics.get(m.name), m.text(t.metrics.get(m.name), format_float)) for m in shown),
            num_cell(t.nan_baseline + t.inf_baseline, f"{t.nan_baseline}/{t.inf_baseline}"),
            num_cell(t.nan_target + t.inf_target, f"{t.nan_target}/{t.inf_target}"),
            num_cell(t.failing_tokens),
            num_cell(t.first_failing_token),
            num_cell(t.worst_token),
            f"<td>{status(t.passed)}</td>",
            f"<td>{escape(t.note or '')}</td>",
        ]
        if calibrated:
            cells[6:6] = [
                num_cell(t.noise_ratio, format_ratio(t.noise_ratio)),
                num_cell(t.token_noise_ratio, format_ratio(t.token_noise_ratio)),
            ]
        rows.append(("<tr>" if t.passed else '<tr class="bad">') + "".join(cells) + "</tr>")
    left = len(report.tensors) - len(rows)
    more = f'<p class="muted">{left} more tensors not shown; write them all with --csv.</p>' if left > 0 else ""
    return (
        f'<section id="tensors"><h2>Tensors ({len(report.tensors)})</h2><p class="muted">click a header to sort</p>'
        f'<div class="scroll">{table(head, rows, sortable=True, table_id="tensor-table")}</div>{more}</section>'
    )


def _problems(report: Report) -> str:
    items = [
        f"<li>only in the {side}: {len(names)} tensors, e.g. <code>{escape(', '.join(names[:5]))}</code></li>"
        for side, names in (("baseline", report.unmatched_baseline), ("target", report.unmatched_target))
        if names
    ]
    items += [
        f"<li>replica mismatch in the {escape(m.side)}: <code>{escape(m.name)}</code> (sequence {m.sequence}) differs "
        f"between rank {m.reference_rank} and rank {m.rank} from token {m.first_token}</li>"
        for m in report.replica_mismatches[:50]
    ]
    return f'<section id="problems"><h2>Also found</h2><ul>{"".join(items)}</ul></section>' if items else ""


def render_html(
    report: Report,
    *,
    baseline_manifest: Manifest | None = None,
    target_manifest: Manifest | None = None,
    tokenizer: Tokenizer | None = None,
    max_rows: int = MAX_ROWS,
) -> str:
    """The whole report as one self-contained HTML document.

    Args:
        report: what :func:`~comparator.hidden.compare.compare_dumps` returned (or ``Report.from_json``;
            then the logprob plots are missing, as per-position series are not in the JSON).
        baseline_manifest, target_manifest: the dumps' manifests, for the model, capture and
            job settings of each run and the prompts' token ids (default: environment only).
        tokenizer: decodes token ids to text (default: the byte tokenizer for a preset's dump, see
            :func:`comparator.reports.tokens.tokenizer_for`; ids only otherwise).
        max_rows: most tensor-table rows (default :data:`MAX_ROWS`).
    """
    tokens = TokenLookup.from_manifest(baseline_manifest or target_manifest, tokenizer)
    body = [
        _verdict_section(report),
        *((_layers(report), _heatmap(report, tokens)) if report.tensors else ()),
        _logprobs(report, tokens),
        routing_section(report.router) if report.router is not None else "",
        _runs(report, baseline_manifest, target_manifest),
        _tensors(report, max_rows) if report.tensors else "",
        _problems(report),
    ]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"driftscope: {Outcome.of(report).word}: {report.target} vs {report.baseline}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>{''.join(body)}"
        f'<footer class="muted"><p>driftscope {escape(__version__)}, {stamp}</p></footer>'
        f"<script>{_JS}</script></body></html>\n"
    )


def write_html(report: Report, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """:func:`render_html` written to ``path`` atomically (temp file, fsync, rename)."""
    text = render_html(report, **kwargs)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
