"""The HTML report in a real headless Chromium (Debian's chromium driven by playwright-core, tests/browser/).

Install both with ``.ci/install-browser.sh``; without them the test is skipped and says so.
``DRIFTSCOPE_UPDATE_SCREENSHOT=1`` also writes the screenshot to ``docs/report.png`` (shown in docs/reports.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from comparator import compare_dumps
from comparator.reports.html import write_html
from comparator.reports.plots import layer_figure
from dumper.format import load_manifest
from tests.report_dumps import clean_dump, one_token_bug_dump

ROOT = Path(__file__).resolve().parents[3]
BROWSER_DIR = ROOT / "tests" / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SCREENSHOT_BYTES = 300_000


def _missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} not found (apt-get install chromium, or run .ci/install-browser.sh)"
    if shutil.which("node") is None:
        return "node not found (needed to drive chromium with playwright-core; run .ci/install-browser.sh)"
    if not (BROWSER_DIR / "node_modules" / "playwright-core" / "package.json").is_file():
        return "playwright-core not installed (cd tests/browser && npm ci, or run .ci/install-browser.sh)"
    return None


pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """Render a divergent report, open it in chromium, and return what the page showed."""
    root = tmp_path_factory.mktemp("browser")
    base = clean_dump(root / "base")
    bad = one_token_bug_dump(root / "bad", layer=2, token=57)
    # short display paths, as in docs/reports.md (the screenshot is committed as docs/report.png)
    report = replace(compare_dumps(base, bad), baseline="dumps/base", target="dumps/bad")
    write_html(report, root / "report.html", baseline_manifest=load_manifest(base), target_manifest=load_manifest(bad))
    shot = root / "report.png"
    r = subprocess.run(
        ["node", str(BROWSER_DIR / "check_report.mjs"), str(root / "report.html"), str(shot), str(root / "profile")],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "CHROMIUM": CHROMIUM},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return report, json.loads(r.stdout.strip().splitlines()[-1]), shot


def test_page_loads_without_errors_or_fetches(page):
    _, seen, _ = page
    assert seen["consoleErrors"] == []
    assert seen["fetched"] == []
    assert seen["title"].startswith("driftscope: DIVERGED")


def test_charts_render(page):
    _, seen, _ = page
    for chart in ("layer-chart", "heatmap-chart", "logprob-chart", "amplification-chart"):
        box = seen["charts"][chart]
        assert box is not None, chart
        assert box["width"] > 100 and box["height"] > 100 and box["shapes"] > 5, (chart, box)
    assert seen["charts"]["heatmap-chart"]["images"] >= 1  # the heatmap's cells are one embedded raster


def test_table_lists_every_tensor_and_sorts(page):
    report, seen, _ = page
    assert sorted(seen["tableNames"]) == sorted(t.name for t in report.tensors)
    assert len(seen["tableNames"]) == report.matched
    expected = sorted(t.rel_diff for t in report.tensors)
    assert seen["sortedAscending"] == pytest.approx(expected, rel=1e-12)
    assert seen["sortedDescending"] == pytest.approx(expected[::-1], rel=1e-12)
    assert seen["ariaSort"] == "ascending"


def _near(rgb: np.ndarray, color: str) -> np.ndarray:
    """Pixels within 3/255 of ``color`` per channel."""
    return (np.abs(rgb - np.asarray(to_rgb(color))) <= 3 / 255).all(axis=-1)


def test_screenshot(page):
    """The screenshot is the viewport (1200 x 900) showing the report: the failing verdict box at the top (its
    background and red left border, no passing one), the per-layer chart's two series below it."""
    report, _, shot = page
    data = shot.read_bytes()
    assert len(data) < SCREENSHOT_BYTES  # small enough for docs/report.png
    rgb = matplotlib.image.imread(shot)[..., :3]  # [rows, cols, rgb], floats in 0..1
    assert rgb.shape == (900, 1200, 3)
    fail_bg, border = _near(rgb, "#fdecea"), _near(rgb, "#c0392b")  # .fail in the page's CSS
    assert fail_bg.mean() > 0.1 and not _near(rgb, "#e8f6ec").any()  # .pass background nowhere
    box_end = int(np.nonzero(fail_bg.any(axis=1))[0].max())
    assert box_end < 450 and border[:box_end, :40].sum(axis=0).max() > 100  # a tall red stripe at the left
    lines = {line.get_label(): line.get_color() for line in layer_figure(report).axes[0].lines}
    for label in ("max per-token rel_diff", "rel_diff (whole tensor)"):
        assert _near(rgb[box_end:], lines[label]).sum() > 100, label
    if os.environ.get("DRIFTSCOPE_UPDATE_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "report.png")
