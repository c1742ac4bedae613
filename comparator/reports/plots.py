"""Matplotlib figures of a :class:`~comparator.hidden.types.Report`: per-layer chart, amplification, token heatmap,
logprobs.

Built with the object-oriented :class:`matplotlib.figure.Figure` API, never pyplot: no global
state, no GUI backend, safe in threads and on headless machines. Every chart is on a log
scale; zeros (bit-identical values) and infinities (NaN/Inf mismatches) cannot sit on one, so
they are drawn at a floor / ceiling and the chart says so. The marks a test or a script may look
for carry SVG ids (``set_gid``): ``heatmap-onset``, ``heatmap-first-failing``,
``heatmap-onset-layer``, ``heatmap-gap-N``, ``layer-onset``, ``layer-noise-threshold``,
``amplification-introduced``.

Example::

    from comparator.reports.plots import save_layer_plot
    save_layer_plot(report, "layers.png")       # what `--plot layers.png` writes
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from comparator.hidden.types import Heatmap, LayerSummary, Report
from comparator.logprobs import LogprobVerdict, PositionSeries, k3
from dumper.errors import UsageError
from dumper.format import atomic_path

__all__ = [
    "layer_figure",
    "amplification_figure",
    "heatmap_figure",
    "logprob_figure",
    "figure_svg",
    "figure_bytes",
    "save_layer_plot",
    "log_range",
    "MAX_AMPLIFICATION_POINTS",
]

MAX_POINTS = 3000
"""Points per logprob line; longer series are max-pooled so that spikes stay visible."""
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "driftscope", "font.size": 9}
MAX_AMPLIFICATION_POINTS = 8
"""Capture points drawn in the amplification chart (the first ones by name); the chart says how many were left out."""
_FAIL, _OK, _MARK, _ONSET = "#c0392b", "#2e86c1", "#7d3c98", "#e67e22"


def log_range(values: Sequence[np.ndarray], lines: Sequence[float | None] = ()) -> tuple[float, float]:
    """(floor, ceiling) of a log axis: a decade below the smallest positive finite value and a
    decade above the largest (thresholds included); zeros go to the floor, infinities to the ceiling."""
    finite = [v[np.isfinite(v) & (v > 0)] for v in values] + [np.asarray([x for x in lines if x and x > 0])]
    pos = np.concatenate(finite) if finite else np.empty(0)
    if pos.size == 0:
        return 1e-17, 1.0
    lo, hi = float(pos.min()), float(pos.max())
    return 10.0 ** (math.floor(math.log10(lo)) - 1), 10.0 ** (math.ceil(math.log10(hi)) + 1)


def _clip(v: np.ndarray, floor: float, ceiling: float) -> np.ndarray:
    out = np.where(np.isnan(v), np.inf, v).astype(np.float64)
    return np.clip(out, floor, ceiling)


def _clip_note(values: Sequence[np.ndarray], floor: float, ceiling: float) -> str:
    """Say which values the log scale could not show as they are."""
    zeros = sum(int(np.count_nonzero(v[np.isfinite(v)] <= 0)) for v in values)
    infs = sum(int(np.count_nonzero(~np.isfinite(v))) for v in values)
    notes = []
    if zeros:
        notes.append(f"{zeros} zero value(s) drawn at the floor {floor:.0e}")
    if infs:
        notes.append(f"{infs} infinite value(s) (NaN/Inf mismatch) drawn at {ceiling:.0e}")
    return "; ".join(notes)


def _tick_every(n: int, most: int = 32) -> int:
    return max(1, math.ceil(n / most))


def _noise_thresholds(report: Report, layers: Sequence[LayerSummary]) -> tuple[np.ndarray, np.ndarray] | None:
    """Per layer, the smallest calibrated rel_diff / per-token threshold of its tensors (NaN: none), or None."""
    if report.noise is None:
        return None
    rel = {s.layer: math.nan for s in layers}
    tok = dict(rel)
    for t in report.tensors:
        if t.noise_ratio is None and t.token_noise_ratio is None:
            continue  # judged by the fixed thresholds
        if t.threshold is not None:
            rel[t.layer] = np.nanmin([rel[t.layer], t.threshold])
        if t.token_threshold is not None:
            tok[t.layer] = np.nanmin([tok[t.layer], t.token_threshold])
    out = (np.asarray([rel[s.layer] for s in layers]), np.asarray([tok[s.layer] for s in layers]))
    return None if np.isnan(out[0]).all() and np.isnan(out[1]).all() else out


def _threshold_lines(ax, report: Report, x: np.ndarray, noise: tuple[np.ndarray, np.ndarray] | None) -> None:
    fixed = "fixed " if noise is not None else ""
    if report.threshold == report.token_threshold:
        ax.axhline(report.threshold, color="0.3", ls="--", lw=1, label=f"{fixed}thresholds = {report.threshold:g}")
    else:
        ax.axhline(
            report.threshold, color="0.3", ls="--", lw=1, label=f"{fixed}rel_diff threshold {report.threshold:g}"
        )
        ax.axhline(
            report.token_threshold,
            color="0.3",
            ls=":",
            lw=1,
            label=f"{fixed}per-token threshold {report.token_threshold:g}",
        )
    if noise is not None:
        rel, tok = noise
        (line,) = ax.step(
            x,
            rel,
            where="mid",
            color=_OK,
            lw=1.2,
            alpha=0.6,
            label=f"noise threshold ({report.noise_factor:g} x noise)",
        )
        line.set_gid("layer-noise-threshold")
        ax.step(x, tok, where="mid", color=_MARK, lw=1.2, alpha=0.6, ls=(0, (1, 1)), label="per-token noise threshold")


def _divergence_lines(ax, report: Report, layers: Sequence[LayerSummary]) -> None:
    fd = report.first_divergent
    if fd is None:
        return
    index = {s.layer: i for i, s in enumerate(layers)}
    if fd.layer in index:
        ax.axvline(
            index[fd.layer],
            color=_FAIL,
            lw=1.5,
            alpha=0.7,
            label=f"first divergence: layer {'-' if fd.layer is None else fd.layer}",
        )
    if fd.onset_layer is not None and fd.onset_layer != fd.layer and fd.onset_layer in index:
        line = ax.axvline(
            index[fd.onset_layer],
            color=_ONSET,
            lw=1.5,
            ls="-.",
            label=f"onset: layer {fd.onset_layer} ({fd.onset_layer_method})",
        )
        line.set_gid("layer-onset")


def layer_figure(report: Report) -> Figure:
    """rel_diff and max per-token rel_diff per layer, log scale, fixed threshold lines (and each layer's
    calibrated noise threshold with a noise file), first divergence and its onset layer marked."""
    layers = report.layers()
    rel = np.asarray([s.max_rel_diff for s in layers], dtype=np.float64)
    tok = np.asarray([s.max_token_rel_diff for s in layers], dtype=np.float64)
    noise = _noise_thresholds(report, layers)
    extra = [float(v) for arr in noise or () for v in arr if math.isfinite(v)]
    floor, ceiling = log_range([rel, tok], [report.threshold, report.token_threshold, *extra])
    fig = Figure(figsize=(9, 3.0), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    ax.plot(x, _clip(tok, floor, ceiling), "o-", color=_MARK, ms=4, label="max per-token rel_diff")
    ax.plot(x, _clip(rel, floor, ceiling), "s-", color=_OK, ms=4, label="rel_diff (whole tensor)")
    failed = np.asarray([not s.passed for s in layers], dtype=bool)
    if failed.any():
        ax.plot(
            x[failed], _clip(tok, floor, ceiling)[failed], "o", color=_FAIL, ms=7, mfc="none", label="failing layer"
        )
    _threshold_lines(ax, report, x, noise)
    _divergence_lines(ax, report, layers)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, ceiling * 2)
    step = _tick_every(len(layers))
    ax.set_xticks(x[::step], ["-" if s.layer is None else str(s.layer) for s in layers][::step])
    ax.set_xlabel("layer")
    ax.set_ylabel("rel_diff")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.85)
    note = _clip_note([rel, tok], floor, ceiling)
    ax.set_title("rel_diff per layer" + (f"  ({note})" if note else ""), fontsize=9, loc="left")
    return fig


def amplification_figure(report: Report) -> Figure | None:
    """Per layer, rel_diff(input of layer k+1) / rel_diff(input of layer k) at each capture point, log
    scale, the layers that introduce error marked; None when no layer has a next one captured."""
    amps = report.amplification
    if not amps:
        return None
    points = sorted({a.point or "" for a in amps})
    shown, left = points[:MAX_AMPLIFICATION_POINTS], len(points) - MAX_AMPLIFICATION_POINTS
    layers = sorted({a.layer for a in amps})
    index = {layer: i for i, layer in enumerate(layers)}
    ratios = [np.asarray([a.ratio for a in amps if a.ratio is not None], dtype=np.float64)]
    floor, ceiling = log_range(ratios, [1.0])
    fig = Figure(figsize=(9, 2.8), layout="constrained")
    ax = fig.add_subplot()
    for point in shown:
        ys = np.full(len(layers), np.nan)
        for a in amps:
            if (a.point or "") == point and a.ratio is not None:
                ys[index[a.layer]] = a.ratio
        ax.plot(np.arange(len(layers)), np.clip(ys, floor, ceiling), "o-", ms=4, lw=1, label=_literal(point or "-"))
    hot = [a for a in amps if a.introduced and (a.point or "") in shown]
    if hot:
        (mark,) = ax.plot(
            [index[a.layer] for a in hot],
            [min(max(a.ratio or ceiling, floor), ceiling) for a in hot],
            "o",
            color=_FAIL,
            ms=11,
            mfc="none",
            mew=2,
            label="introduces error: layer " + ", ".join(sorted({str(a.layer) for a in hot}, key=int)),
        )
        mark.set_gid("amplification-introduced")
    ax.axhline(1.0, color="0.4", ls=":", lw=1, label="1 (no growth)")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, ceiling * 2)
    step = _tick_every(len(layers))
    ax.set_xticks(range(0, len(layers), step), [str(v) for v in layers][::step])
    ax.set_xlabel("layer k")
    ax.set_ylabel("amplification")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=7, framealpha=0.85)
    infs = sum(1 for a in amps if a.ratio is not None and not math.isfinite(a.ratio))
    notes = [f"{infs} infinite (error from exact zero) drawn at {ceiling:.0e}"] if infs else []
    notes += ["blank: exact on both sides"] if any(a.ratio is None for a in amps) else []
    notes += [f"{left} more capture points not drawn"] if left > 0 else []
    ax.set_title(
        "amplification: rel_diff(input of layer k+1) / rel_diff(input of layer k)"
        + (f"\n{'; '.join(notes)}" if notes else ""),
        fontsize=9,
        loc="left",
    )
    return fig


def _literal(text: str) -> str:
    """Text from a dump as matplotlib shows it literally: a ``$`` would start mathtext (and an
    unbalanced formula in a tensor name would fail the whole chart)."""
    return text.replace("$", r"\$")


def _row_labels(hm: Heatmap) -> list[str]:
    per_layer: dict[int | None, int] = {}
    for layer in hm.layers:
        per_layer[layer] = per_layer.get(layer, 0) + 1
    return [
        _literal(
            ("-" if layer is None else str(layer))
            if per_layer[layer] == 1
            else f"{'-' if layer is None else layer} {name.rsplit('.', 2)[-2] if name.count('.') >= 2 else name}"
        )
        for layer, name in zip(hm.layers, hm.names, strict=True)
    ]


def _column(positions: Sequence[int], position: int | None) -> int | None:
    return positions.index(position) if position is not None and position in positions else None


def _heatmap_marks(
    ax, hm: Heatmap, first_token: int | None, onset: int | None, onset_layer: int | None, decode_from: int | None = None
) -> list[str]:
    """Lines at the onset (solid), the first failing token (dashed) and where decode steps begin (dotted, orange),
    white bars at gaps between runs of positions, triangles on the onset layer's rows; returns the title's words."""
    positions, words = list(hm.positions), []
    if decode_from is not None and positions and positions[0] < decode_from <= positions[-1]:
        col = next(j for j, p in enumerate(positions) if p >= decode_from)
        ax.axvline(col - 0.5, color="orange", lw=1.6, ls=":").set_gid("heatmap-decode")
        words.append(f"dotted: decode steps from position {decode_from}")
    elif decode_from is not None and positions and positions[0] >= decode_from:
        words.append(f"every position a decode step (from {decode_from})")
    for j, gap in enumerate(k for k in range(1, len(positions)) if positions[k] - positions[k - 1] > 1):
        ax.axvline(gap - 0.5, color="white", lw=4).set_gid(f"heatmap-gap-{j + 1}")
        words.append(f"white bar: positions {positions[gap - 1] + 1}..{positions[gap] - 1} left out")
    first, start = _column(positions, first_token), _column(positions, onset)
    if start is not None and onset != first_token:
        ax.axvline(start - 0.5, color="white", lw=1.6).set_gid("heatmap-onset")
        words.insert(0, f"solid: onset, token {onset}")
    if first is not None:
        ax.axvline(first - 0.5, color="white", lw=1.2, ls="--").set_gid("heatmap-first-failing")
        words.insert(
            1 if start is not None and onset != first_token else 0,
            f"dashed: first failing token {first_token}"
            + (" = onset" if onset == first_token and onset is not None else ""),
        )
    rows = [i for i, layer in enumerate(hm.layers) if onset_layer is not None and layer == onset_layer]
    if rows:
        (mark,) = ax.plot([-0.5] * len(rows), rows, ">", color=_ONSET, ms=8, mec="black", clip_on=False, ls="none")
        mark.set_gid("heatmap-onset-layer")
        words.append(f"triangle: onset layer {onset_layer}")
    return words


def heatmap_figure(
    hm: Heatmap,
    *,
    token_threshold: float,
    first_token: int | None = None,
    onset: int | None = None,
    onset_layer: int | None = None,
    decode_from: int | None = None,
) -> Figure:
    """Tensors (by layer, bottom to top) x token positions of per-token rel_diff, log colour scale;
    the onset, the first failing token and the first decode position (``decode_from``: the prompt's
    length) are vertical lines, the onset layer's rows marked."""
    values = np.asarray(hm.values, dtype=np.float64)  # [tensors, positions]
    floor, ceiling = log_range([values], [token_threshold])
    cmap = colormaps["viridis"].with_extremes(over="#ff00ff", under="#e8e8e8")
    rows, cols = values.shape
    fig = Figure(figsize=(9, max(2.7, min(9.0, 1.5 + 0.16 * rows))), layout="constrained")
    ax = fig.add_subplot()
    shown = np.where(np.isfinite(values), np.where(values > 0, np.maximum(values, floor), floor / 10), ceiling * 10)
    vmax = max(float(np.max(values[np.isfinite(values)], initial=floor * 10)), token_threshold * 10)
    img = ax.imshow(
        shown, aspect="auto", origin="lower", interpolation="nearest", cmap=cmap, norm=LogNorm(vmin=floor, vmax=vmax)
    )
    bar = fig.colorbar(img, ax=ax, extend="both", pad=0.01)
    bar.set_label("per-token rel_diff")
    bar.ax.axhline(token_threshold, color="white", lw=2)
    bar.ax.axhline(token_threshold, color="black", lw=1, ls="--")
    positions = list(hm.positions)
    step = max(1, _tick_every(cols, 16))
    ax.set_xticks(range(0, cols, step), [str(p) for p in positions[::step]])
    ystep = _tick_every(rows, 24)
    ax.set_yticks(range(0, rows, ystep), _row_labels(hm)[::ystep])
    words = _heatmap_marks(ax, hm, first_token, onset, onset_layer, decode_from)
    ax.set_xlabel(f"token position (sequence {hm.sequence})")
    ax.set_ylabel("layer")
    words += ["grey: exactly 0"] if (values == 0).any() else []
    words += ["magenta: infinite (NaN/Inf mismatch)"] if (~np.isfinite(values)).any() else []
    lines = ["; ".join(words[i : i + 3]) for i in range(0, len(words), 3)]  # three marks a line
    ax.set_title("\n".join(["per-token rel_diff from the onset of the divergence", *lines]), fontsize=9, loc="left")
    return fig


def _pool(x: np.ndarray, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The max of every ``k`` points (NaN/inf count as the largest), so spikes stay visible."""
    if k <= 1:
        return x, y
    pad = (-y.size) % k
    yy = np.concatenate([np.where(np.isnan(y), np.inf, y), np.full(pad, -np.inf)]).reshape(-1, k)
    return x[::k], yy.max(axis=1)


def _segments(series: Sequence[PositionSeries], what: str) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """(x, y, request) per request, requests laid end to end along x; ``what``: delta, k3 or kl."""
    out, offset = [], 0
    for s in series:
        pos = s.kl_positions if what == "kl" else s.positions
        val = s.kl if what == "kl" else np.abs(s.delta) if what == "delta" else k3(s.delta)
        if pos is None or val is None or pos.size == 0:
            continue
        out.append((offset + pos.astype(np.float64), np.asarray(val, dtype=np.float64), s.request))
        offset += int(pos.max()) + 1 + max(2, int(pos.max()) // 50)
    return out


def _series_panel(ax, segs: list[tuple[np.ndarray, np.ndarray, str]], label: str, limit: float | None) -> None:
    """One log-scale line of per-position values, broken between requests, with its threshold."""
    ys = [y for _, y, _ in segs]
    n = sum(y.size for y in ys)
    k = math.ceil(n / MAX_POINTS)
    floor, ceiling = log_range(ys, [limit])
    xs_out, ys_out = [], []
    for x, y, _ in segs:
        px, py = _pool(x, y, k)
        xs_out += [px, [np.nan]]
        ys_out += [_clip(py, floor, ceiling), [np.nan]]
    if segs:
        ax.plot(np.concatenate(xs_out), np.concatenate(ys_out), lw=0.8, color=_OK)
    if limit is not None:
        ax.axhline(limit, color=_FAIL, ls="--", lw=1, label=f"threshold {limit:g}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, ceiling * 2)
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    note = _clip_note(ys, floor, ceiling)
    pooled = f"; max of every {k} positions" if k > 1 else ""
    ax.set_title(f"{label} per position{pooled}" + (f" ({note})" if note else ""), fontsize=9, loc="left")
    for x, _, _ in segs[1:]:
        ax.axvline(x[0] - 1, color="0.6", lw=0.6)


def logprob_figure(v: LogprobVerdict) -> Figure | None:
    """|Δ logprob| per position and full-distribution KL per position (k3 when no logits); None
    when the verdict holds no per-position series (a report read back from JSON)."""
    if not v.series:
        return None
    has_kl = any(s.kl is not None for s in v.series)
    panels = [
        ("|Δ logprob| (nats)", "delta", v.thresholds.max_abs_err),
        ("KL(P_base ‖ P_target)", "kl", v.thresholds.kl_max) if has_kl else ("k3 (KL estimate)", "k3", None),
    ]
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (label, what, limit) in zip(axes, panels, strict=True):
        segs = _segments(v.series, what)
        _series_panel(ax, segs, label, limit)
    segs = _segments(v.series, "delta")
    if len(segs) > 1:
        axes[-1].set_xlabel("position, requests laid end to end (grey lines: request starts)")
        if len(segs) <= 12:
            for x, _, rid in segs:
                axes[0].annotate(
                    _literal(f"request {rid}"),
                    (x[0], 1),
                    xycoords=("data", "axes fraction"),
                    fontsize=7,
                    va="top",
                    color="0.35",
                )
    else:
        axes[-1].set_xlabel(_literal(f"position (request {segs[0][2]})") if segs else "position")
    return fig


def figure_bytes(fig: Figure, fmt: str) -> bytes:
    """Render a figure to ``fmt`` (``svg``, ``png``, ``pdf``...) without pyplot."""
    buf = io.BytesIO()
    with rc_context(_SVG_RC):
        meta = {"Date": None, "Creator": None} if fmt == "svg" else {}
        fig.savefig(buf, format=fmt, dpi=110, metadata=meta or None)
    return buf.getvalue()


def figure_svg(fig: Figure) -> str:
    """The figure as an ``<svg>`` element to inline into HTML (no XML prolog, no DOCTYPE)."""
    text = figure_bytes(fig, "svg").decode("utf-8")
    text = text[text.index("<svg") :]
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text, count=1, flags=re.S)


def save_layer_plot(report: Report, path: str | os.PathLike[str]) -> None:
    """Write the per-layer chart to ``path`` (format from the suffix: .png, .svg, .pdf), atomically."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    fig = layer_figure(report)
    if fmt not in fig.canvas.get_supported_filetypes():
        raise UsageError(f"{path}: cannot write a plot as .{fmt}; use .png, .svg or .pdf")
    data = figure_bytes(fig, fmt)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
