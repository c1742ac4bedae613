"""The onset, the amplification and the noise multiples in the report outputs: heatmap, HTML, Markdown.

Real tiny-llama dumps (one model, built once): a clean run, two benign layouts for a noise file,
and two bugs injected with forward hooks on decoder layers (batch 1, one forward pass per prompt):

- ``growing``: from position :data:`P` on, layer 1's output gets noise whose amplitude grows
  10% per position, so the divergence starts at ``P`` but first crosses 1e-3 some 60 tokens later;
- ``far``: layer 1's output gets a small constant error from :data:`FAR_ONSET` on (it passes), and
  layer 4's a large one from :data:`FAR_TOKEN` on: the first failing layer is 5, its first failing
  token ``FAR_TOKEN``, while the error starts at token ``FAR_ONSET`` in layer 2 (layer 1's output).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from comparator import compare_dumps
from comparator.formatting import format_ratio
from comparator.hidden.heatmap import BEFORE, WINDOW, window_positions, window_runs
from comparator.hidden.types import Report
from comparator.outcome import describe_divergence
from comparator.reports.files import write_json
from comparator.reports.html import render_html, write_html
from comparator.reports.layer_table import FROM_ZERO, amplification_cell
from comparator.reports.markdown import to_markdown
from dumper.format import load_manifest
from dumper.prefill.run import RunConfig, dump_sequences
from dumper.prompts import BUILTIN_PROMPTS
from tests.conftest import ROOT, run_cli, tiny_llama

P = 40
FAR_ONSET, FAR_TOKEN = 20, 170
N_LAYERS = 8
Edit = tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]
"""(decoder layer, first position, amplitude of the added noise per position from there, relative to the row's rms)."""


def _dump(model, tok, out: Path, edits: tuple[Edit, ...] = (), **layout) -> Path:
    """The built-in prompts through ``model``, every layer, with ``edits`` applied to layer outputs."""
    gen = torch.Generator().manual_seed(1)
    handles = []
    for layer, start, amplitude in edits:

        def hook(module, args, output, start=start, amplitude=amplitude):
            hidden = output[0] if isinstance(output, tuple) else output  # [1, seq, hidden]
            rows = hidden[0, start:]  # [seq - start, hidden]
            if rows.shape[0]:
                scale = amplitude(torch.arange(rows.shape[0], dtype=rows.dtype))[:, None]
                rms = rows.norm(dim=-1, keepdim=True) / math.sqrt(rows.shape[-1])
                rows.add_(scale * rms * torch.randn(rows.shape, generator=gen))
            return output

        handles.append(model.model.layers[layer].register_forward_hook(hook))
    try:
        dump_sequences(model, [tok.encode(p) for p in BUILTIN_PROMPTS], RunConfig(out=str(out), layers="all", **layout))
    finally:
        for h in handles:
            h.remove()
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onset")
    model, tok = tiny_llama()
    return {
        "base": _dump(model, tok, root / "base"),
        "chunked": _dump(model, tok, root / "chunked", chunk_size=64),
        "batched": _dump(model, tok, root / "batched", batch_size=2),
        # rel_diff is ~amplitude^2 / 2: 5e-9 at P, 1e-3 about 64 positions later
        "growing": _dump(model, tok, root / "growing", ((1, P, lambda k: torch.clamp(1e-4 * 1.1**k, max=0.2)),)),
        "far": _dump(
            model,
            tok,
            root / "far",
            ((1, FAR_ONSET, lambda k: torch.full_like(k, 3e-3)), (4, FAR_TOKEN, lambda k: torch.full_like(k, 0.2))),
        ),
    }


@pytest.fixture(scope="module")
def growing(dumps) -> Report:
    return compare_dumps(dumps["base"], dumps["growing"])


@pytest.fixture(scope="module")
def far(dumps) -> Report:
    return compare_dumps(dumps["base"], dumps["far"])


def _html(report: Report, dumps) -> str:
    return render_html(report, baseline_manifest=load_manifest(dumps["base"]))


@pytest.fixture(scope="module")
def growing_page(growing, dumps) -> str:
    return _html(growing, dumps)


def _section(page: str, element_id: str, end: str) -> str:
    start = page.index(f'id="{element_id}"')
    return page[start : page.index(end, start)]


def _layer_rows(page: str) -> list[str]:
    table = _section(page, "layer-table", "</table>")
    return re.findall(r"<tr class=\"[^\"]*\">.*?</tr>", table[table.index("<tbody>") :])


def _cells(row: str) -> list[str]:
    return re.findall(r"<td[^>]*>(.*?)</td>", row)


def test_window_runs_hold_the_onset_and_stay_bounded():
    pos = np.arange(400)
    assert [r.tolist() for r in window_runs(pos, 57)] == [list(range(57 - BEFORE, 57 - BEFORE + WINDOW))]
    assert window_positions(pos, 57, onset=57).tolist() == window_positions(pos, 57).tolist()
    near = window_runs(pos, 104, onset=P)  # one run from BEFORE ahead of the onset, holding the token
    assert len(near) == 1 and near[0][0] == P - BEFORE and near[0].size == WINDOW and 104 + BEFORE <= near[0][-1] + 1
    far_runs = window_runs(pos, 300, onset=FAR_ONSET)  # too far apart: two runs, the gap between them
    assert [(int(r[0]), int(r[-1])) for r in far_runs] == [
        (FAR_ONSET - BEFORE, FAR_ONSET - BEFORE + WINDOW // 2 - 1),
        (300 - BEFORE, 300 - BEFORE + WINDOW // 2 - 1),
    ]
    for token in range(0, 400, 7):
        for onset in range(0, token + 1, 5):
            shown = window_positions(pos, token, onset=onset)
            assert shown.size <= WINDOW and onset in shown and token in shown and np.all(np.diff(shown) > 0)
    sparse = np.arange(0, 800, 2)  # positions with holes of their own: runs are counted in dump rows
    assert window_runs(sparse, 500, onset=100)[0][0] == 100 - 2 * BEFORE


def test_onset_before_the_first_failing_token_is_inside_the_heatmap(growing):
    fd, hm = growing.first_divergent, growing.heatmap
    assert (fd.layer, fd.sequence, fd.onset, fd.onset_method) == (2, 0, P, "change-point")
    assert fd.token > P + BEFORE  # the window of the first failing token alone would miss the onset
    assert hm.positions[0] == P - BEFORE and len(hm.positions) == WINDOW and fd.token in hm.positions
    assert list(hm.positions) == list(range(P - BEFORE, P - BEFORE + WINDOW))
    values = np.asarray(hm.values)  # [layers, positions]
    at = hm.positions.index(P)
    assert hm.layers == tuple(range(N_LAYERS))
    assert not values[:, :at].any() and not values[:2].any()  # exact before the onset and up to layer 1
    assert (values[2:, at:] > 0).all() and values[2, at] < 1e-6  # departs at P, far under the threshold
    first = hm.positions.index(fd.token)
    assert values[2, first] > growing.token_threshold and (values[2, :first] <= growing.token_threshold).all()


def test_far_onset_shows_both_regions_with_a_gap(far):
    fd, hm = far.first_divergent, far.heatmap
    assert (fd.layer, fd.token, fd.onset, fd.onset_method) == (5, FAR_TOKEN, FAR_ONSET, "change-point")
    assert (fd.onset_layer, fd.onset_layer_method) == (2, "change-point")
    head = list(range(FAR_ONSET - BEFORE, FAR_ONSET - BEFORE + WINDOW // 2))
    tail = list(range(FAR_TOKEN - BEFORE, len(BUILTIN_PROMPTS[0].encode()) + 1))  # to the prompt's end (bos + bytes)
    assert list(hm.positions) == head + tail and len(hm.positions) <= WINDOW
    values = np.asarray(hm.values)
    onset, token = hm.positions.index(FAR_ONSET), hm.positions.index(FAR_TOKEN)
    assert not values[:, :onset].any() and (values[2:, onset:] > 0).all()
    assert (values[5, onset:token] < far.token_threshold).all() and values[5, token] > far.token_threshold
    amp = {a.layer: a for a in far.amplification}
    assert amp[1].introduced and amp[4].introduced and amp[1].ratio == math.inf
    assert not any(amp[k].introduced for k in (2, 3, 5, 6))


def test_html_names_the_onset_first_and_marks_it(growing, growing_page):
    fd, page = growing.first_divergent, growing_page
    verdict = _section(page, "verdict", "</section>")
    onset = re.search(r'<p id="onset">(.*?)</p>', verdict).group(1)
    assert onset.startswith(
        f"Divergence starts at token <strong>{P}</strong> of sequence 0 (change point estimated from the run)"
    )
    assert f"first over the threshold at token {fd.token}, layer 2" in onset
    assert verdict.index('id="onset"') < verdict.index(describe_divergence(fd))
    heat = _section(page, "heatmap-chart", "</figure>")
    for gid in ("heatmap-onset", "heatmap-first-failing", "heatmap-onset-layer"):
        assert f'id="{gid}"' in heat
    assert f"solid: onset, token {P}; dashed: first failing token {fd.token}" in heat
    assert 'id="heatmap-gap-1"' not in heat
    # the window's tokens: the onset and the first failing token each marked once
    assert len(re.findall(rf'<code class="tok onset" title="position {P}, token id \d+">', page)) == 1
    assert len(re.findall(rf'<code class="tok hit" title="position {fd.token}, token id \d+">', page)) == 1


def test_html_amplification_chart_and_layer_table(growing, growing_page):
    page = growing_page
    chart = _section(page, "amplification-chart", "</figure>")
    assert "<svg" in chart and 'id="amplification-introduced"' in chart and "introduces error: layer 1" in chart
    heads = re.findall(r"<th data-type=\"\w+\">(.*?)</th>", _section(page, "layer-table", "</thead>"))
    assert heads == [
        "layer",
        "tensors",
        "rel_diff",
        "max token rel_diff",
        "max |diff|",
        "min cosine",
        "amplification",
        "first failing token",
        "worst token",
        "verdict",
    ]
    rows, layers = _layer_rows(page), growing.layers()
    assert len(rows) == len(layers) == N_LAYERS
    for row, s in zip(rows, layers, strict=True):
        cells = _cells(row)
        assert cells[0] == str(s.layer) and cells[6] == amplification_cell(growing, s)[0]
        assert bool(re.match(r'<tr class="[^"]*\bintroduced\b', row)) == s.introduced
    assert "INTRODUCES ERROR" in rows[1] and _cells(rows[1])[6] == FROM_ZERO  # inf: grows from an exact 0
    assert "FIRST DIVERGENCE" in rows[2] and "ONSET" not in rows[2]  # the onset layer is the first divergent one


def test_html_of_a_far_onset_shows_the_gap_and_the_onset_layer(far, dumps):
    page = _html(far, dumps)
    heat = _section(page, "heatmap", "</section>")
    assert f"positions {FAR_ONSET - BEFORE}..{FAR_ONSET - BEFORE + WINDOW // 2 - 1}, {FAR_TOKEN - BEFORE}.." in heat
    assert f"(onset {FAR_ONSET}, first failing token {FAR_TOKEN}; the positions between are left out)" in heat
    assert 'id="heatmap-gap-1"' in heat and "triangle: onset layer 2" in heat
    assert 'id="layer-onset"' in _section(page, "layer-chart", "</figure>")
    rows = _layer_rows(page)
    assert "ONSET" in _cells(rows[2])[-1] and "FIRST DIVERGENCE" not in rows[2]
    assert "FIRST DIVERGENCE" in rows[5] and "ONSET" not in _cells(rows[5])[-1]
    assert [i for i, r in enumerate(rows) if "INTRODUCES ERROR" in r] == [1, 4]
    onset = re.search(r'<p id="onset">(.*?)</p>', page).group(1)
    assert f"token <strong>{FAR_ONSET}</strong> of sequence 0" in onset and "in layer <strong>2</strong>" in onset


def test_markdown_layer_table_has_the_amplification_column(growing, far):
    md = to_markdown(growing)
    lines = md.splitlines()
    assert (
        lines[0].startswith("**driftscope: DIVERGED** at layer 2 ") and f"divergence starts at token {P} " in lines[0]
    )
    head = next(line for line in lines if line.startswith("| layer"))
    assert [c.strip() for c in head.strip("|").split(" | ")] == [
        "layer",
        "tensors",
        "rel_diff",
        "max token rel_diff",
        "max \\|diff\\|",
        "min cosine",
        "amplification",
        "first failing token",
        "worst token",
        "verdict",
    ]
    rows = [line for line in lines if re.match(r"^\| (\*\*)?\d", line)]
    assert len(rows) == N_LAYERS
    for row, s in zip(rows, growing.layers(), strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        amp = amplification_cell(growing, s)[0]
        assert len(cells) == 10 and cells[6] == (f"**{amp}**" if s.introduced else amp)
    assert [c.strip() for c in rows[1].strip("|").split(" | ")][6] == f"**{FROM_ZERO}**"
    far_rows = [line for line in to_markdown(far).splitlines() if re.match(r"^\| (\*\*)?\d", line)]
    assert far_rows[2].endswith("| PASS ONSET |") and "**FIRST DIVERGENCE**" in far_rows[5]


def test_noise_file_puts_noise_multiples_in_every_output(dumps, tmp_path):
    r = run_cli(
        "comparator",
        "calibrate",
        dumps["base"],
        dumps["chunked"],
        dumps["batched"],
        "--out",
        tmp_path / "n.json",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "comparator",
        dumps["base"],
        dumps["growing"],
        "--noise",
        tmp_path / "n.json",
        "--format",
        "json",
        "--html",
        tmp_path / "r.html",
        "--markdown",
        tmp_path / "r.md",
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    report = Report.from_json(json.loads(r.stdout))
    assert report.noise == str(tmp_path / "n.json") and report.first_divergent.onset_method == "calibrated"
    layers = report.layers()
    assert all(s.noise_ratio is not None for s in layers)
    md = (tmp_path / "r.md").read_text()
    assert f"thresholds {report.noise_factor:g} x the noise in `{tmp_path / 'n.json'}` " in md
    rows = [line for line in md.splitlines() if re.match(r"^\| (\*\*)?\d", line)]
    assert "| rel_diff | x noise | max token rel_diff |" in md and len(rows) == N_LAYERS
    for row, s in zip(rows, layers, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 11 and cells[3] == format_ratio(s.noise_ratio)
    page = (tmp_path / "r.html").read_text()
    assert "over its calibrated noise" in re.search(r'<p id="onset">(.*?)</p>', page).group(1)
    assert f"thresholds {report.noise_factor:g} x the noise in {tmp_path / 'n.json'}" in _section(
        page, "verdict", "</section>"
    )
    for row, s in zip(_layer_rows(page), layers, strict=True):
        assert _cells(row)[3] == format_ratio(s.noise_ratio)
    assert 'id="layer-noise-threshold"' in _section(page, "layer-chart", "</figure>")
    tensor_heads = re.findall(r"<th data-type=\"\w+\">(.*?)</th>", _section(page, "tensor-table", "</thead>"))
    assert tensor_heads[5:9] == ["rel_diff", "x noise", "token x noise", "max token rel_diff"]
    body = _section(page, "tensor-table", "</tbody>")
    t = report.tensors[-1]
    assert f'data-v="{t.token_noise_ratio!r}">{format_ratio(t.token_noise_ratio)}</td>' in body


def test_renderers_never_import_torch(growing, tmp_path):
    """The JSON report rendered to HTML and Markdown in a fresh interpreter: torch is never imported."""
    write_json(growing, tmp_path / "r.json")
    code = (
        "import sys\n"
        "import comparator.cli.main, comparator.hidden.heatmap, comparator.reports.plots, comparator.reports.text\n"
        "from comparator.reports.html import render_html\n"
        "from comparator.reports.markdown import to_markdown\n"
        "from comparator.results import load_report\n"
        f"report = load_report({str(tmp_path / 'r.json')!r})\n"
        "page, md = render_html(report), to_markdown(report)\n"
        "assert 'id=\"heatmap-onset\"' in page and 'amplification-chart' in page, 'marks missing'\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_comparing_preset_dumps_with_every_report_never_imports_torch(dumps, tmp_path):
    """``python -m comparator A B --html --markdown`` on preset dumps (token texts included): no torch."""
    code = (
        "import sys\n"
        "from comparator.cli.main import main\n"
        f"rc = main([{str(dumps['base'])!r}, {str(dumps['far'])!r}, '--quiet', '--html', "
        f"{str(tmp_path / 'r.html')!r}, '--markdown', {str(tmp_path / 'r.md')!r}])\n"
        "print(rc, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("1 []"), r.stdout
    page = (tmp_path / "r.html").read_text()
    assert "heatmap-onset" in page and "tokens of the window" in page  # the byte tokenizer's texts are there


def test_passing_report_has_no_onset(dumps, tmp_path):
    report = compare_dumps(dumps["base"], dumps["chunked"])
    assert report.passed and report.first_divergent is None
    write_html(report, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert 'id="onset"' not in page and "<h1>PASS</h1>" in page and 'id="layer-table"' in page
