"""Terminal rendering of a :class:`Report` with rich: the logprob, routing and per-layer tables and the verdict."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from comparator.formatting import format_float, format_located, format_ratio
from comparator.hidden.registry import columns as metric_columns
from comparator.hidden.types import Report
from comparator.judging.noise import NoiseModel
from comparator.logprobs import LogprobVerdict
from comparator.outcome import Outcome, clause, reaches_output, status, threshold_summary, verdict_notes
from comparator.reports.layer_table import FIRST_DIVERGENCE, ONSET, layer_table
from comparator.reports.logprob_table import metric_label, metric_rows
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
from comparator.reports.speculative_table import DRAFT_HEAD, draft_rows, draft_title
from comparator.routing.types import RouterComparison
from dumper.format.decode import DECODE, PREFILL

__all__ = ["render_report", "render_logprobs", "render_routing", "render_noise"]


def _token(v: int | None) -> str:
    return "-" if v is None else str(v)


def _noise_cell(v: LogprobVerdict, key: str | None) -> str:
    """``= 40x noise`` for a calibrated metric, or ``= 19x floor (noise 4.768e-07)`` where the noise
    is below the floor (the ratio is to ``max(noise, floor)``, what the threshold scales)."""
    entry = None if v.noise is None or key is None else v.noise.metrics.get(key)
    if entry is None:
        return "-"
    if entry.noise >= entry.floor:
        return f"= {format_ratio(entry.ratio)} noise"
    return f"= {format_ratio(entry.ratio)} floor (noise {format_float(entry.noise)})"


def _logprob_rows(v: LogprobVerdict) -> list[tuple[str, str, str | None]]:
    """(label, value, threshold name) rows of the logprob table: the metric table's, then the details."""
    rows: list[tuple[str, str, str | None]] = [(r.label, r.value, r.name) for r in metric_rows(v)]
    rows += [("rmse", format_float(v.rmse), None), ("k3 max", format_located(v.k3_max), None)]
    if v.kl_percentiles is not None:
        pct = v.kl_percentiles
        rows += [
            (
                "KL p99.9 / p99 / p95 / p90 / median",
                " / ".join(format_float(pct[k]) for k in ("99.9", "99", "95", "90", "50")),
                None,
            ),
            ("top-1 agreement", "-" if v.top1_agreement is None else f"{v.top1_agreement:.4%}", None),
        ]
    if v.topk_mean_err is not None:
        rows += [("top-k mean |Δ| (per-sample mean)", format_float(v.topk_mean_err), None)]
    if v.llama is not None:  # llama-perplexity's statistics, in its wording
        from comparator.logprobs.llama_stats import stats_rows

        rows += [(label, value, None) for label, value in stats_rows(v.llama, v.kl_mean)]
    return rows


def _noise_lines(v: LogprobVerdict) -> list[str]:
    """What the thresholds rest on, and each mean against the calibrated one (z-score)."""
    out = [f"thresholds: {v.thresholds.source}"] if v.thresholds.source else []
    if v.noise is None:
        return out
    n = v.noise
    out.append(
        f"logprob noise of {n.source or 'the calibration'}: {n.variants} variants, {n.positions} positions "
        f"each; thresholds max(floor, {n.factor:g} x noise)"
    )
    if n.metrics and all(m.noise == 0 for m in n.metrics.values()):
        out.append(
            "the calibration's variants were bit-identical to the baseline, so the thresholds are the floors: "
            "calibrate with a variant that computes differently (another attention backend)"
        )
    exceeded = set(v.thresholds.failures(v.metrics()))
    for key, t in n.means.items():
        verdict = "significantly above the noise" if t.significant else "not significantly above the noise"
        if key in exceeded and n.excused(key):
            verdict += ": over its threshold, but not failed"
        out.append(
            f"{metric_label(key)} {format_float(t.mean)} ± {format_float(t.se)} vs noise "
            f"{format_float(t.noise_mean)} ± {format_float(t.noise_se)}: z = {t.z:.3g}, {verdict}"
        )
    return out


def render_logprobs(v: LogprobVerdict, console: Console) -> None:
    """The logprob verdict: mean-type (± SE) and max-type statistics with where the max sits; with a
    noise file, each checked value as a multiple of its noise and each mean's z-score against it."""
    table = Table(title=f"logprobs: {v.compared_positions} positions in {v.requests} requests", title_justify="left")
    for col, justify in (("metric", "left"), ("value", "right"), ("threshold", "right")) + (
        (("vs noise", "right"),) if v.noise is not None else ()
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    th = v.thresholds.to_json()
    failing = set(v.failures())
    for label, value, key in _logprob_rows(v):
        limit = "-" if key is None or th.get(key) is None else f"{th[key]:g}"
        style = "bold red" if key in failing else None
        cells = [Text(label), Text(value), Text(limit)] + ([Text(_noise_cell(v, key))] if v.noise is not None else [])
        table.add_row(*cells, style=style)  # Text: request ids are data, not markup
    console.print(table)
    for line in _noise_lines(v):
        console.print(Text(line))
    for side, names in (("baseline", v.unmatched_baseline), ("target", v.unmatched_target)):
        if names:
            console.print(
                Text.assemble(
                    (f"only in the {side}, not compared ({len(names)}):", "yellow"), f" {', '.join(names[:5])}"
                )
            )
    verdict = Text.assemble(
        (status(v.passed), "bold green" if v.passed else "bold red"),
        "" if v.passed else f" ({', '.join(_failure(v, k) for k in v.failures())})",
    )
    console.print(Text.assemble("logprobs: ", verdict))


def _failure(v: LogprobVerdict, key: str) -> str:
    """``max_abs_err`` or, against noise, ``max_abs_err: max |Δlogprob| 1.900e-03 = 4e+03x noise``."""
    if v.noise is None or key not in v.noise.metrics:
        return key
    return f"{key}: {metric_label(key)} {format_float(v.metrics()[key])} {_noise_cell(v, key)}"


def _columns(table: Table, head: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> None:
    """Add ``head``'s columns, each no wider than its widest cell (or header word): a long header
    wraps rather than widening the table past the terminal."""
    for i, (label, kind) in enumerate(head):
        width = max([len(r[i]) for r in rows] + [len(w) for w in label.split()])
        table.add_column(label, justify="right" if kind == "num" else "left", max_width=width)


def render_routing(router: RouterComparison, console: Console) -> None:
    """The routing verdict: a row per MoE layer (the first failing one highlighted), the first
    failing flips (or the first benign ones), the notes (what the layers were judged by)."""
    table, rows = Table(title=routing_title(router), title_justify="left"), layer_rows(router)
    _columns(table, layer_head(router), [r.cells for r in rows])
    for row in rows:
        cells = [Text(c) for c in row.cells]
        if row.first:
            cells[-1] = Text(row.cells[-1], style="bold white on red")
        else:
            cells[-1].stylize("green" if row.passed else "bold red")
        table.add_row(*cells, style="bold" if row.first else None)
    if rows:
        console.print(table)
    if flips := flip_rows(router):
        listing = Table(title=flips_title(router), title_justify="left")
        _columns(listing, FLIP_HEAD, [f.cells for f in flips])
        for f in flips:
            listing.add_row(*map(Text, f.cells), style=None if f.benign else "red")
        console.print(listing)
    for note in routing_notes(router):
        console.print(Text(note))
    console.print(Text.assemble("routing: ", (routing_summary(router), "green" if router.passed else "bold red")))


def render_report(report: Report, console: Console, *, tensors: bool = False) -> None:
    """Print the logprob and routing tables, the per-layer table (and the per-tensor table with
    ``tensors=True``), then the verdict."""
    fd = report.first_divergent
    if report.logprobs is not None:
        render_logprobs(report.logprobs, console)
    if report.router is not None:
        render_routing(report.router, console)
    if not report.tensors:
        return
    console.print(_layer_table(report))
    if tensors:
        _render_tensors(report, console)
    if rows := draft_rows(report.speculative):
        assert report.speculative is not None
        drafts = Table(title=draft_title(report.speculative), title_justify="left")
        _columns(drafts, DRAFT_HEAD, rows)
        for cells in rows:
            drafts.add_row(*map(Text, cells))
        console.print(drafts)
    for side, names in (("baseline", report.unmatched_baseline), ("target", report.unmatched_target)):
        if names:
            shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
            console.print(Text.assemble((f"unmatched in {side} ({len(names)}):", "yellow"), f" {shown}"))
    summary = f"matched {report.matched} tensors; " + threshold_summary(report)
    summary += "".join(f"; {n}" for n in verdict_notes(report))
    for m in report.replica_mismatches[:10]:
        console.print(
            Text.assemble(
                ("replica mismatch", "bold red"),
                f" in the {m.side}: {m.name} (layer {m.layer}, sequence {m.sequence}) "
                f"differs between rank {m.reference_rank} and rank {m.rank} from token {m.first_token} "
                f"(max per-token rel_diff {format_float(m.max_token_rel_diff)})",
            )
        )
    if fd is not None and fd.replica_side is not None:
        console.print(Text.assemble(("divergence on a replica rank", "bold red"), f": {_replica_divergence(report)}"))
    outcome, why = Outcome.of(report), clause(report, detail=False)
    word = (outcome.word, "bold green" if outcome.passed else "bold red")
    if outcome in (Outcome.TENSORS, Outcome.ROUTING):  # a sentence of its own, then the summary
        console.print(Text.assemble(word, f"{outcome.separator}{why}. {summary}"))
    else:
        console.print(Text.assemble(word, f"{' ' if why else ''}{why}: {summary}"))
    if report.logprobs is not None:
        console.print(Text(reaches_output(report)))


def _layer_table(report: Report) -> Table:
    """The per-layer table: the first divergence's row in bold with its verdict on red, the onset
    layer named, the amplification of a layer that introduces error in yellow."""
    layers = layer_table(report)
    table = Table(
        title=Text(f"{report.target}  vs  baseline {report.baseline}"),
        title_justify="left",
        caption=None if layers.legend is None else Text(layers.legend),
        caption_justify="left",
    )
    for label, kind in layers.head:
        table.add_column(label, justify="right" if kind == "num" else "left")
    amp = layers.column("amplification")
    for row in layers.rows:
        cells: list[str | Text] = [c.text for c in row.cells]
        cells[amp] = Text(row.cells[amp].text, style="bold yellow" if row.introduced else "")
        if row.first:
            cells[-1] = Text(FIRST_DIVERGENCE, style="bold white on red")
        else:
            cells[-1] = Text(row.cells[-1].text, style="green" if row.passed else "bold red")
            if row.onset:
                cells[-1] = Text.assemble(cells[-1], (f" {ONSET}", "bold yellow"))
        table.add_row(*cells, style="bold" if row.first else None)
    return table


def _replica_divergence(report: Report) -> str:
    """Which rank's replica rows diverge first, from which token, and whether its representative still agrees."""
    fd = report.first_divergent
    assert fd is not None and fd.replica_side is not None
    token = fd.onset if fd.onset is not None else fd.token
    text = (
        f"rank {fd.rank} of the {fd.replica_side} diverges first, at layer {fd.layer} ({fd.name}"
        f"{'' if fd.sequence is None else f', sequence {fd.sequence}'}) from token {_token(token)}"
    )
    ref = next(
        (
            m.reference_rank
            for m in report.replica_mismatches
            if (m.side, m.name, m.rank, m.sequence) == (fd.replica_side, fd.name, fd.rank, fd.sequence)
        ),
        None,
    )
    same = [
        t
        for t in report.tensors
        if t.replica_side is None
        and (t.name, t.layer, t.sequence, t.forward_pass) == (fd.name, fd.layer, fd.sequence, fd.forward_pass)
    ]
    if ref is not None and same and all(t.passed for t in same):
        text += f"; the representative rank {ref} still agrees with the other side there"
    return text


def render_noise(noise: NoiseModel, console: Console) -> None:
    """The measured noise per tensor (and of the routing and the logprobs): what a comparison will be judged against."""
    table = Table(title=Text(f"noise of {noise.baseline} from {len(noise.variants)} variants"), title_justify="left")
    phased = any(t.phases for t in noise.tensors.values())  # decode dumps: prompt and decode rows apart
    for col in (
        "layer",
        "tensor",
        "rel_diff",
        "token max",
        "token p99.9",
        "token p99",
        "positions",
        *(("prompt token max", "decode token max") if phased else ()),
        "token max by variant",
    ):
        table.add_column(col, justify="left" if col == "tensor" else "right")
    for t in noise.tensors.values():
        phases = [format_float(t.phases[p].token_max) if p in t.phases else "-" for p in (PREFILL, DECODE)]
        table.add_row(
            "-" if t.layer is None else str(t.layer),
            Text(t.name),
            format_float(t.rel_diff),
            format_float(t.token_max),
            format_float(t.token_p999),
            format_float(t.token_p99),
            str(t.positions),
            *(phases if phased else ()),
            " ".join(format_float(v) for v in t.by_variant),
        )
    if noise.tensors:
        console.print(table)
    if noise.router:
        routing = Table(title="routing noise", title_justify="left")
        for col in ("layer", "score", "flip rate", "weight", "tokens"):
            routing.add_column(col, justify="right")
        for n in (noise.router[k] for k in sorted(noise.router)):
            routing.add_row(
                str(n.layer), format_float(n.score), f"{n.flip_rate:.2%}", format_float(n.weight), str(n.tokens)
            )
        console.print(routing)
    if noise.logprobs is not None:
        lp = noise.logprobs
        values = ", ".join(f"{k} {format_float(v)}" for k, v in lp.metrics.items() if v is not None)
        console.print(Text(f"logprob noise ({lp.variants} variants, {lp.positions} positions): {values}"))


def _render_tensors(report: Report, console: Console) -> None:
    """One row per tensor; its metric columns are the carried metrics with a terminal label."""
    shown = [m for m in metric_columns(t.metrics for t in report.tensors) if m.short is not None]
    table = Table(title="tensors", title_justify="left")
    for col in (
        "name",
        "layer",
        "seq",
        "pass",
        "rank",
        *(m.short or m.name for m in shown),
        "nan/inf b",
        "nan/inf t",
        "failing tokens",
        "first token",
        "verdict",
    ):
        table.add_column(col)
    for t in report.tensors:
        table.add_row(
            Text(t.name),
            "-" if t.layer is None else str(t.layer),
            "-" if t.sequence is None else str(t.sequence),
            str(t.forward_pass),
            str(t.rank) + (f" ({t.replica_side} replica)" if t.replica_side else ""),
            *(m.text(t.metrics.get(m.name), format_float) for m in shown),
            f"{t.nan_baseline}/{t.inf_baseline}",
            f"{t.nan_target}/{t.inf_target}",
            str(t.failing_tokens),
            _token(t.first_failing_token),
            Text(status(t.passed), style="green" if t.passed else "bold red"),
        )
    console.print(table)
