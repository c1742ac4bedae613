"""Report outputs from real dumps: the heatmap data, JSON, Markdown, Parquet, the plot, the HTML file, the CLI
helpers."""

from __future__ import annotations

import argparse
import functools
import html
import io
import json
import math
import re
import shutil
import time
from dataclasses import replace
from datetime import datetime

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb
from rich.console import Console

from comparator import compare_dumps
from comparator.hidden.heatmap import BEFORE, WINDOW
from comparator.hidden.types import Report
from comparator.reports import html as html_module
from comparator.reports import plots
from comparator.reports.files import json_text, write_parquet
from comparator.reports.html import render_html, write_html
from comparator.reports.markdown import to_markdown
from comparator.reports.outputs import add_output_flags, check_output_flags, write_outputs
from comparator.reports.plots import save_layer_plot
from dumper.errors import UsageError
from dumper.format import load_manifest
from dumper.progress import progress_bar
from dumper.tokenizers import ByteTokenizer
from tests.report_dumps import N_LAYERS, clean_dump, one_token_bug_dump

LAYER, TOKEN = 2, 57  # the bug: after decoder layer 2, at token 57


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    base = clean_dump(root / "base")
    bad = one_token_bug_dump(root / "bad", layer=LAYER, token=TOKEN)
    shutil.copytree(base, root / "same")
    return base, bad, root / "same"


@pytest.fixture(scope="module")
def report(dumps) -> Report:
    base, bad, _ = dumps
    return compare_dumps(base, bad)


def test_heatmap_row_of_the_next_layer_peaks_at_the_bug_token(report):
    fd, hm = report.first_divergent, report.heatmap
    assert fd.layer == LAYER + 1 and fd.token == TOKEN and hm is not None
    assert hm.sequence == fd.sequence == 0
    assert hm.positions[0] == TOKEN - BEFORE and len(hm.positions) == WINDOW
    assert list(hm.positions) == list(range(hm.positions[0], hm.positions[0] + WINDOW))
    assert hm.layers == tuple(range(N_LAYERS)) and len(hm.values) == N_LAYERS
    values = np.asarray(hm.values)
    assert values.shape == (N_LAYERS, WINDOW)
    assert hm.positions[int(np.argmax(values[LAYER + 1]))] == TOKEN
    assert not values[: LAYER + 1].any()  # layers up to the bug are bit-identical
    # the heatmap agrees with the per-tensor summary of that layer
    t = next(t for t in report.tensors if t.layer == LAYER + 1 and t.sequence == 0)
    assert values[LAYER + 1].max() == pytest.approx(t.max_token_rel_diff, rel=1e-12)
    # attention spreads the error to later tokens, never to earlier ones
    before = hm.positions.index(TOKEN)
    assert not values[:, :before].any() and (values[LAYER + 2 :, before + 1 :] > 0).all()


def test_json_keeps_every_key_and_adds_the_heatmap(report):
    data = json.loads(json_text(report))
    assert {
        "passed",
        "threshold",
        "token_threshold",
        "matched",
        "unmatched_baseline",
        "unmatched_target",
        "first_divergent",
        "tensors",
        "logprobs",
        "replica_mismatches",
        "heatmap",
    } <= set(data)
    hm = data["heatmap"]
    assert set(hm) == {"sequence", "positions", "layers", "names", "values"}
    assert hm["names"][LAYER + 1] == f"model.layers.{LAYER + 1}.self_attn.input"
    back = Report.from_json(data)
    assert back.heatmap == report.heatmap and back.to_json() == data


def test_nonfinite_heatmap_values_are_null_in_json(report):
    hm = report.heatmap
    values = tuple((math.inf,) + row[1:] if i == 0 else row for i, row in enumerate(hm.values))
    data = replace(report, heatmap=replace(hm, values=values)).to_json()
    assert data["heatmap"]["values"][0][0] is None
    json.dumps(data, allow_nan=False)
    assert Report.from_json(data).heatmap.values[0][0] == math.inf


def test_passing_report_has_no_heatmap(dumps):
    base, _, same = dumps
    report = compare_dumps(base, same)
    assert report.passed and report.heatmap is None and report.to_json()["heatmap"] is None
    assert to_markdown(report).startswith("**driftscope: PASS**")
    page = render_html(report)
    assert "<h1>PASS</h1>" in page and "no heatmap" in page


def test_markdown_has_a_row_per_layer_and_the_verdict(report):
    md = to_markdown(report)
    lines = md.splitlines()
    assert lines[0].startswith(f"**driftscope: DIVERGED** at layer {LAYER + 1} ")
    rows = [line for line in lines if re.match(r"^\| (\*\*)?\d", line)]
    assert len(rows) == N_LAYERS
    assert rows[LAYER + 1].startswith(f"| **{LAYER + 1}** |") and "**FIRST DIVERGENCE**" in rows[LAYER + 1]
    assert all(row.endswith("| PASS |") for row in rows[: LAYER + 1])
    assert any(line.startswith("logprobs: FAIL") for line in lines)
    assert all(line.count("|") in (0, 11) for line in lines if "\\|" not in line)  # 10 cells per table row


def test_parquet_holds_the_tensor_table(report, tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    write_parquet(report, tmp_path / "t.parquet")
    df = pd.read_parquet(tmp_path / "t.parquet")
    assert len(df) == report.matched
    assert list(df["name"]) == [t.name for t in report.tensors]
    assert list(df["rel_diff"]) == [t.rel_diff for t in report.tensors]
    bad = df[~df["passed"]]
    assert set(bad["layer"]) == set(range(LAYER + 1, N_LAYERS))
    assert list(df["shape"].iloc[0]) == list(report.tensors[0].shape)


def test_parquet_without_pyarrow_is_a_usage_error(report, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(UsageError, match=r"--parquet needs pyarrow: pip install pyarrow"):
        write_parquet(report, tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_plot_is_written_as_png(report, tmp_path, monkeypatch):
    """The PNG is the per-layer chart: its lines are the report's per-layer values (zeros at the floor, failing
    layers ringed, the first divergence marked), and the decoded image has the chart's size and draws each
    series' points in that series' colour where the axes put them."""
    built = []
    real = plots.layer_figure

    def layer_figure(r):  # the figure save_layer_plot renders, kept to look at
        built.append(real(r))
        return built[-1]

    monkeypatch.setattr(plots, "layer_figure", layer_figure)
    save_layer_plot(report, tmp_path / "layers.png")
    (fig,) = built
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    layers = report.layers()
    x = np.arange(len(layers))
    tok = np.asarray([s.max_token_rel_diff for s in layers])
    rel = np.asarray([s.max_rel_diff for s in layers])
    assert (tok[: LAYER + 1] == 0).all() and (tok[LAYER + 1 :] > 0).all()  # bit-identical up to the bug
    floor, _ = plots.log_range([rel, tok], [report.threshold, report.token_threshold])
    assert ax.get_yscale() == "log" and floor < rel[rel > 0].min()
    per_token, whole = lines["max per-token rel_diff"], lines["rel_diff (whole tensor)"]
    for line, values in ((per_token, tok), (whole, rel)):
        np.testing.assert_array_equal(line.get_xdata(), x)
        np.testing.assert_array_equal(line.get_ydata(), np.where(values > 0, values, floor))
    ringed = lines["failing layer"]
    failing = [i for i, s in enumerate(layers) if not s.passed]
    assert list(ringed.get_xdata()) == failing == list(range(LAYER + 1, N_LAYERS))
    np.testing.assert_array_equal(ringed.get_ydata(), tok[LAYER + 1 :])
    assert list(lines[f"first divergence: layer {LAYER + 1}"].get_xdata()) == [LAYER + 1] * 2
    assert f"{2 * (LAYER + 1)} zero value(s) drawn at the floor" in ax.get_title(loc="left")

    image = matplotlib.image.imread(tmp_path / "layers.png")  # [rows, cols, rgba], floats in 0..1
    fig.set_dpi(110)  # what figure_bytes renders at: the axes' transform now maps data to the PNG's pixels
    height, width = (fig.get_size_inches()[::-1] * 110).round().astype(int)
    assert image.shape == (height, width, 4)
    # the per-token points of the failing layers, and every whole-tensor point (drawn over the per-token ones
    # at the floor), where no line crosses them: not the first divergent layer's, under its vertical line
    shown = [(per_token, i) for i in range(LAYER + 2, N_LAYERS)] + [(whole, i) for i in x if i != LAYER + 1]
    for line, i in shown:
        col, row = ax.transData.transform((x[i], line.get_ydata()[i]))
        pixel = image[int(height - row), int(col), :3]
        np.testing.assert_allclose(pixel, to_rgb(line.get_color()), atol=4 / 255, err_msg=f"{line.get_label()} {i}")
    with pytest.raises(UsageError, match=r"\.txt"):
        save_layer_plot(report, tmp_path / "layers.txt")


def test_html_is_self_contained_and_complete(report, dumps, tmp_path):
    base, bad, _ = dumps
    write_html(report, tmp_path / "r.html", baseline_manifest=load_manifest(base), target_manifest=load_manifest(bad))
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    # nothing is fetched: no external scripts, styles, images, fonts or imports
    assert not re.search(
        r"<script[^>]*\bsrc=|<link\b|<iframe|<img[^>]*src=\"?https?:|@import|url\(\s*['\"]?https?:", page, re.I
    )
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", page, re.I)
    # one row per tensor, every chart inline
    table = page[page.index('id="tensor-table"') :]
    body = table[table.index("<tbody>") : table.index("</tbody>")]
    assert body.count("<tr") == report.matched
    for t in report.tensors:
        assert f"<td>{t.name}</td>" in body
    for chart in ("layer-chart", "heatmap-chart", "logprob-chart"):
        fig = page[page.index(f'id="{chart}"') :]
        assert fig.index("<svg") < fig.index("</figure>")
    # the worst logprob position is listed with its token's text
    v = report.logprobs
    seq, pos = int(v.max_abs_err.request), v.max_abs_err.position
    token_id = load_manifest(base).extra["input_ids"][seq][pos]
    text = ByteTokenizer(259).decode([token_id])
    worst = page[page.index("Worst positions by |Δ logprob|") :]
    assert (
        f'<td>{seq}</td><td class="n" data-v="{pos}">{pos}</td><td class="n" data-v="{token_id}">{token_id}</td>'
        f"<td><code>{html.escape(json.dumps(text))}</code>"
    ) in worst


def test_html_escapes_every_text(report):
    evil = "<script>alert(1)</script>"
    t0 = replace(report.tensors[0], name=evil, note='"><img src=x onerror=alert(1)>')
    page = render_html(replace(report, tensors=(t0, *report.tensors[1:]), target=evil))
    assert evil not in page and "<img src=x" not in page
    assert html.escape(evil) in page


def _parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("baseline")
    p.add_argument("target")
    add_output_flags(p)
    return p.parse_args(argv)


class _FixedClock(datetime):
    """``datetime`` whose ``now`` is one instant: a page rendered twice carries the same stamp, whatever minute the
    second rendering falls in."""

    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 1, 1, 12, 0, tzinfo=tz)


def test_cli_helpers_write_every_output(report, dumps, tmp_path, monkeypatch):
    base, bad, _ = dumps
    monkeypatch.setattr(html_module, "datetime", _FixedClock)
    args = _parse(
        [
            str(base),
            str(bad),
            "--html",
            str(tmp_path / "r.html"),
            "--plot",
            str(tmp_path / "p.png"),
            "--parquet",
            str(tmp_path / "t.parquet"),
            "--markdown",
            str(tmp_path / "r.md"),
            "--format",
            "json",
        ]
    )
    check_output_flags(args)
    out = io.StringIO()
    write_outputs(report, args, base, bad, stdout=out)
    assert json.loads(out.getvalue()) == report.to_json()
    assert (tmp_path / "r.md").read_text() == to_markdown(report)
    # each file is this report's: the plot its layer chart, the page its HTML with both manifests, the table its tensors
    save_layer_plot(report, tmp_path / "direct.png")
    plot, direct = matplotlib.image.imread(tmp_path / "p.png"), matplotlib.image.imread(tmp_path / "direct.png")
    assert plot.shape == direct.shape and np.array_equal(plot, direct) and plot.std() > 0
    page = render_html(report, baseline_manifest=load_manifest(base), target_manifest=load_manifest(bad))
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == page
    table = pd.read_parquet(tmp_path / "t.parquet")
    assert list(table["name"]) == [t.name for t in report.tensors]
    assert list(table["rel_diff"]) == [t.rel_diff for t in report.tensors]
    args = _parse([str(base), str(bad), "--markdown"])
    assert args.format == "table"
    out = io.StringIO()
    write_outputs(report, args, base, bad, stdout=out)
    assert out.getvalue() == to_markdown(report)


def test_cli_helpers_refuse_bad_flags(report, dumps, tmp_path):
    base, bad, _ = dumps
    with pytest.raises(UsageError, match="--format json"):
        check_output_flags(_parse([str(base), str(bad), "--markdown", "--format", "json"]))
    args = _parse([str(base), str(bad), "--markdown", str(tmp_path / "missing" / "r.md")])
    with pytest.raises(UsageError, match="missing/r.md: cannot write the Markdown report"):
        write_outputs(report, args, base, bad, stdout=io.StringIO())


def _terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=100), buf


def test_progress_bar_appears_only_on_a_terminal_after_the_delay():
    console, buf = _terminal()
    with progress_bar(True, "comparing", unit="tensors", delay=0.05, console=console) as progress:
        progress(1, 4)
        time.sleep(0.4)
        progress(4, 4)
    assert "comparing" in buf.getvalue()
    console, buf = _terminal()
    with progress_bar(True, "comparing", delay=5, console=console) as progress:  # quick work: nothing drawn
        progress(4, 4)
    assert buf.getvalue() == ""
    console, buf = _terminal()
    with progress_bar(False, "comparing", delay=0, console=console) as progress:  # --quiet
        progress(1, 4)
        time.sleep(0.1)
    assert buf.getvalue() == ""
    buf = io.StringIO()
    with progress_bar(True, "comparing", delay=0, console=Console(file=buf)) as progress:  # not a TTY
        progress(1, 4)
        time.sleep(0.1)
    assert buf.getvalue() == ""


def test_progress_callback_drives_compare_dumps(dumps, monkeypatch, capsys):
    base, bad, _ = dumps
    seen: list[tuple[int, int]] = []
    compare_dumps(base, bad, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == 2 * N_LAYERS
    from comparator.reports import outputs

    # on a terminal, the CLI's callback draws the "comparing" bar and compare_dumps fills it to its total
    # (drawn at once: no delay to wait out)
    console, buf = _terminal()
    monkeypatch.setattr(outputs, "progress_bar", functools.partial(progress_bar, delay=0, console=console))
    with outputs.progress_callback(True) as progress:
        time.sleep(0.2)  # the bar's timer thread starts it before the work
        compare_dumps(base, bad, progress=progress)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # without the terminal's escape codes
    assert "comparing" in shown and f"{2 * N_LAYERS}/{2 * N_LAYERS} tensors" in shown
    # stderr is not a TTY under pytest: the callback draws nothing there, even with no delay
    monkeypatch.setattr(outputs, "progress_bar", functools.partial(progress_bar, delay=0))
    capsys.readouterr()
    with outputs.progress_callback(True) as progress:
        compare_dumps(base, bad, progress=progress)
    assert capsys.readouterr().err == ""


def test_chunk_boundary_bug_is_a_vertical_edge(tmp_path):
    """A KV-cache row corrupted after chunk 1 (as in test_layouts): the heatmap's columns split at token 64.

    The baseline is the same chunked prefill without the corruption: what precedes it is the same computation on
    both sides, bit-identical by construction (a one-pass baseline would round apart from it on some CPUs)."""
    import torch

    import dumper
    from dumper.prefill.forward import cache_kwarg
    from tests.conftest import tiny_llama

    prompt = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 2
    model, tok = tiny_llama()
    kw = cache_kwarg(model)
    for name in ("clean", "chunked"):
        with torch.inference_mode(), dumper.capture(model, tmp_path / name, layers="all") as cap:
            cap.set_sequence_ids([0])
            ids = torch.tensor([tok.encode(prompt)])
            cache = None
            for start in range(0, ids.shape[1], 64):  # chunks of 64 tokens through the KV cache
                out = model(input_ids=ids[:, start : start + 64], use_cache=True, **{kw: cache})
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                if start == 0 and name == "chunked":
                    cache.layers[3].values[:, :, 63, :] += 5.0  # token 63's value row, read by every later chunk
    report = compare_dumps(tmp_path / "clean", tmp_path / "chunked")
    hm = report.heatmap
    assert report.first_divergent.token == 64 and hm.positions[0] == 64 - BEFORE
    values = np.asarray(hm.values)
    edge = hm.positions.index(64)
    assert not values[:, :edge].any()  # before the boundary every layer is bit-identical
    assert (values[4:, edge:] > report.token_threshold).mean() > 0.9  # after it, layers 4.. fail
    assert not values[:4].any()
