"""Text from dumps is never markup: dump paths, tensor names and request ids shown as they are.

Real dumps in directories named ``m[/]``, ``[bold]x`` and ``<b>&|x`` (rich markup, HTML and a
Markdown table pipe), tensors named with rich markup, HTML, ``$`` (matplotlib mathtext) and an
emoji code, compared by the real CLI in a subprocess. The terminal output must hold them
verbatim; the Markdown and HTML reports, rendered by a real Markdown parser and parsed as HTML,
must show them as text and contain no element they did not put there themselves.
"""

from __future__ import annotations

import copy
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from markdown_it import MarkdownIt

import dumper
from comparator.hidden.types import Heatmap
from comparator.reports.plots import figure_svg, heatmap_figure
from tests.comparator.logprobs import test_engines as engines
from tests.conftest import run_cli

N1 = "a[/]<x>|y"
N2 = "[red]z</td><script>alert(1)</script>$\\frac$:cat:"
N3 = "<b>&|only[/]"
BASE, TARGET = "<b>&|x", "m[/]"


class _Page(HTMLParser):
    """Start tags (with counts) and text of an HTML document."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.parts: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_data(self, data: str) -> None:
        self.parts.append(data)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _ok(r) -> None:
    assert r.returncode in (0, 1), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


def _tensor_dump(out: Path, *, bad: bool) -> None:
    """Two layers of two tensors (16 positions of one sequence); ``bad``: N2 of layer 1 perturbed
    from token 5 on, and one more tensor (N3) only on this side."""
    g = torch.Generator().manual_seed(0)
    with dumper.capture(None, out):
        for layer in (0, 1):
            for name in (N1, N2):
                t = torch.randn(16, 8, generator=g)
                if bad and (layer, name) == (1, N2):
                    t[5:] += 1.0
                dumper.dump(name, t, layer=layer, positions=list(range(16)), sequence_ids=[0] * 16)
        if bad:
            dumper.dump(N3, torch.ones(2, 2), layer=0)


@pytest.fixture(scope="module")
def tensor_dumps(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("markup")
    (root / "m[").mkdir()
    _tensor_dump(root / BASE, bad=False)
    _tensor_dump(root / TARGET, bad=True)
    return root


def test_terminal_shows_paths_and_names_verbatim(tensor_dumps):
    r = run_cli("comparator", BASE, TARGET, cwd=tensor_dumps)
    _ok(r)
    assert r.returncode == 1
    assert f"{TARGET}  vs  baseline {BASE}" in r.stdout
    verdict = next(line for line in r.stdout.splitlines() if line.startswith("DIVERGED"))
    assert verdict.startswith(f"DIVERGED at layer 1 ({N2}, pass 0, rank 0), first failing token 5"), verdict
    assert f"unmatched in target (1): {N3}" in r.stdout
    assert "\N{CAT FACE}" not in r.stdout  # ":cat:" is a name, not an emoji code
    r = run_cli("comparator", BASE, TARGET, "--tensors", cwd=tensor_dumps)
    _ok(r)
    assert r.returncode == 1 and "[red]z" in r.stdout and "\N{CAT FACE}" not in r.stdout


def test_quiet_verdict_names_the_tensor_verbatim(tensor_dumps):
    r = run_cli("comparator", BASE, TARGET, "--quiet", cwd=tensor_dumps)
    _ok(r)
    assert r.returncode == 1 and N2.removesuffix(":cat:") in r.stdout


def test_quiet_verdict_keeps_emoji_codes_as_text(tensor_dumps):
    r = run_cli("comparator", BASE, TARGET, "--quiet", cwd=tensor_dumps)
    assert f"({N2}, pass 0" in r.stdout


def test_markdown_shows_names_as_text(tensor_dumps):
    r = run_cli("comparator", BASE, TARGET, "--markdown", "r.md", cwd=tensor_dumps)
    _ok(r)
    md = (tensor_dumps / "r.md").read_text()
    assert "<script>" not in md and "</td>" not in md.split("\n\n")[0]  # the verdict line: entities only
    page = _Page(MarkdownIt("commonmark").enable("table").render(md))
    assert set(page.tags) <= {"p", "strong", "code", "table", "thead", "tbody", "tr", "th", "td"}, page.tags
    assert page.tags["tr"] == 3 and page.tags["td"] == 2 * 10 and page.tags["th"] == 10  # the table is intact
    assert f"at layer 1 ({N2}, pass 0" in page.text
    assert f"target {TARGET} vs baseline {BASE}" in page.text


def test_html_report_shows_names_as_text(tensor_dumps):
    r = run_cli("comparator", BASE, TARGET, "--html", "r.html", cwd=tensor_dumps)
    _ok(r)
    page = _Page((tensor_dumps / "r.html").read_text())
    assert page.tags["script"] == 1 and "b" not in page.tags  # only the report's own sorting script
    assert page.tags["h1"] == 1 and page.tags["table"] == 3
    text = page.text
    assert f"at layer 1 ({N2}, pass 0" in text and f"target {TARGET} vs baseline {BASE}" in text
    assert f"1 {N2}#1" in text  # a heatmap row label: "$\frac$" drawn as text, not as a formula
    assert N1 in text and N3 in text


def test_heatmap_chart_draws_dollar_signs_as_text():
    """A ``$...$`` in a tensor name would be parsed as mathtext (and ``$\\frac$`` fails the chart)."""
    hm = Heatmap(
        sequence=0,
        positions=(0, 1, 2),
        layers=(0, 0),
        names=("a.$\\frac$.b", "c$x^$"),
        values=((0.0, 1e-3, 2e-1), (0.0, 0.0, 1e-5)),
    )
    svg = figure_svg(heatmap_figure(hm, token_threshold=1e-3))
    assert "0 $\\frac$" in svg and "0 c$x^$" in svg


@pytest.mark.slow
def test_tiny_llama_dumps_in_markup_named_directories(tmp_path):
    (tmp_path / "m[").mkdir()
    for out, attn in (("m[/]", "eager"), ("[bold]x", "sdpa")):
        r = run_cli("dumper", "run", "--out", out, "--quiet", "--layers", "all", "--attn", attn, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    r = run_cli("comparator", "m[/]", "[bold]x", "--markdown", "r.md", "--html", "r.html", cwd=tmp_path)
    _ok(r)
    assert r.returncode == 0 and "[bold]x  vs  baseline m[/]" in r.stdout
    md = _Page(MarkdownIt("commonmark").enable("table").render((tmp_path / "r.md").read_text()))
    assert "target [bold]x vs baseline m[/]" in md.text
    page = _Page((tmp_path / "r.html").read_text())
    assert "target [bold]x vs baseline m[/]" in page.text and page.tags["script"] == 1
    r = run_cli("comparator", "[bold]x", "m[/]", "--quiet", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "PASS", r.stdout + r.stderr


def test_markdown_code_spans_survive_backticks(tmp_path):
    for name in ("`a``b", "c|d`"):
        with dumper.capture(None, tmp_path / name):
            dumper.dump("t", torch.ones(2, 4), layer=0, positions=[0, 1])
    r = run_cli("comparator", "`a``b", "c|d`", "--markdown", cwd=tmp_path)
    _ok(r)
    assert r.returncode == 0
    md = r.stdout[r.stdout.index("**driftscope") :]
    assert "target c|d` vs baseline `a``b;" in _Page(MarkdownIt("commonmark").render(md)).text


def test_logprob_request_ids_are_shown_verbatim(tmp_path):
    rid = "[/]<b>|x:cat:"
    a = copy.deepcopy(engines.sglang_response(rid))
    b = copy.deepcopy(engines.sglang_response(rid))
    b["meta_info"]["input_token_logprobs"][2][0] = -5.0
    (tmp_path / "a.jsonl").write_text(json.dumps(a) + "\n" + json.dumps(engines.sglang_response("[bold]only")) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(b) + "\n")
    r = run_cli("comparator", "logprobs", "a.jsonl", "b.jsonl", cwd=tmp_path)
    _ok(r)
    assert r.returncode == 1
    assert f"(request {rid}, position 2)" in r.stdout
    assert "only in the baseline, not compared (1): [bold]only" in r.stdout
    assert "logprobs: FAIL (" in r.stdout
