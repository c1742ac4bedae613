"""``sweep``'s cap on a grid's cells (``--max-cells``, default 4096): checked from the axes' value counts,
before a value is parsed or a cell planned, so a grid of 10^6 cells is refused at once and in little memory."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dumper.cli.main import build_parser, main
from dumper.errors import UsageError
from dumper.jobs.sweep.grid import MAX_CELLS, Axis, axis_size, parse_grid
from tests.conftest import subprocess_env

HUNDRED = ",".join(map(str, range(1, 101)))
MILLION = (f"chunk_size={HUNDRED}", f"batch_size={HUNDRED}", f"lengths={HUNDRED}")
"""Three axes of 100 valid values each: 10^6 cells."""
MILLION_LINE = (
    "error: --grid: 1000000 cells (chunk_size 100 x batch_size 100 x lengths 100), more than "
    "--max-cells 4096; narrow an axis, or raise the cap with --max-cells N"
)
JUST_OVER = (f"chunk_size={','.join(map(str, range(1, 18)))}", f"lengths={','.join(map(str, range(1, 242)))}")
"""17 x 241 = 4097 cells: one over the default cap."""
MAX_RSS_MB = 300
"""The refusing CLI's peak RSS, at most: its imports (torch among them) take about 230 MB; planning the
10^6 cells took over 2 GB."""


def _grid_flags(grid: tuple[str, ...]) -> list[str]:
    return [a for g in grid for a in ("--grid", g)]


def test_a_grid_of_a_million_cells_is_refused_naming_the_count_each_axis_and_the_cap():
    with pytest.raises(UsageError) as e:
        parse_grid(MILLION)
    assert f"error: {e.value}" == MILLION_LINE


def test_the_cap_is_on_the_product_with_lengths_block_as_its_six_lengths():
    assert axis_size(Axis("lengths", ("block", "4"))) == 7 and axis_size(Axis("chunk_size", ("none", "4"))) == 2
    grid = ["lengths=block,4", "chunk_size=none,4"]
    assert len(parse_grid(grid, max_cells=14)) == 2
    with pytest.raises(UsageError) as e:
        parse_grid(grid, max_cells=13)
    assert str(e.value) == (
        "--grid: 14 cells (lengths 7 x chunk_size 2), more than --max-cells 13; narrow an axis, "
        "or raise the cap with --max-cells N"
    )
    at_cap = ("chunk_size=" + ",".join(map(str, range(1, 17))), "lengths=" + ",".join(map(str, range(1, 257))))
    assert [len(a.values) for a in parse_grid(at_cap)] == [16, 256]  # 4096 cells: at the cap, not over it
    with pytest.raises(
        UsageError,
        match=r"^--grid: 4097 cells \(chunk_size 17 x lengths 241\), more than "
        r"--max-cells 4096;",
    ):
        parse_grid(JUST_OVER)


def test_sweep_help_states_the_default_cap(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert MAX_CELLS == 4096 and f"(default {MAX_CELLS})" in " ".join(capsys.readouterr().out.split())


def test_one_huge_axis_is_refused_in_linear_time():
    start = time.perf_counter()
    with pytest.raises(UsageError, match=r"^--grid: 200000 cells \(lengths 200000\), more than --max-cells 4096;"):
        parse_grid([f"lengths={','.join(map(str, range(1, 200_001)))}"])
    assert time.perf_counter() - start < 5  # linear: a set finds a repeated value


def test_max_cells_raises_the_cap_of_parse_grid_and_of_the_cli(tmp_path, capsys):
    assert [len(a.values) for a in parse_grid(JUST_OVER, max_cells=4097)] == [17, 241]
    assert (
        build_parser()
        .parse_args(["sweep", "--baseline", "b", "--out", "o", "--grid", "chunk_size=1", "--max-cells", "5000"])
        .max_cells
        == 5000
    )
    args = ["sweep", "--baseline", str(tmp_path / "missing"), *_grid_flags(JUST_OVER), "--out", str(tmp_path / "s")]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("error: --grid: 4097 cells (chunk_size 17 x lengths 241)")
    assert main([*args, "--max-cells", "4097"]) == 2  # past the cap: the next check, the baseline, refuses
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'}: no such dump directory\n"


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_bad_max_cells_is_one_line_and_exit_2(value, tmp_path, capsys):
    args = ["sweep", "--baseline", "b", "--grid", "chunk_size=1", "--out", str(tmp_path / "s"), "--max-cells", value]
    assert main(args) == 2
    shown = value if value != "x" else "'x'"
    assert (
        capsys.readouterr().err == f"error: python -m dumper sweep: argument --max-cells: expected a positive "
        f"integer, got {shown}\n"
    )
    with pytest.raises(UsageError, match="--max-cells must be a positive integer"):
        parse_grid(["chunk_size=1"], max_cells=int(value) if value != "x" else value)  # type: ignore[arg-type]


_MEASURED = """import resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "dumper", *sys.argv[2:]], stdout=subprocess.DEVNULL,
                   timeout=float(sys.argv[1]))
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(r.returncode)
"""
"""Runs ``python -m dumper ARGS`` and prints its peak RSS. Started from this small process, not from pytest's:
a child started by ``vfork`` (``subprocess`` does) keeps its parent's peak RSS as its own across ``exec``."""


def _run_measured(args: list[str], timeout: float) -> tuple[int, str, float, float]:
    """``python -m dumper args``: its exit code, stderr, wall seconds and peak RSS in MB; killed after ``timeout``."""
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", _MEASURED, str(timeout), *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout + 30,
    )
    wall = time.perf_counter() - start
    assert "TimeoutExpired" not in r.stderr, f"python -m dumper {' '.join(args)[:200]}...: over {timeout} s"
    rss = int(r.stdout) / (1 << 20 if sys.platform == "darwin" else 1 << 10)  # bytes on macOS, KiB on Linux
    return r.returncode, r.stderr, wall, rss


def test_the_cli_refuses_a_million_cells_at_once_in_one_line_and_little_memory(tmp_path):
    """The cap is checked before the baseline is read (so a missing one does not matter here) or a cell planned."""
    code, stderr, wall, rss = _run_measured(
        ["sweep", "--baseline", str(tmp_path / "base"), *_grid_flags(MILLION), "--out", str(tmp_path / "s")], timeout=30
    )
    assert code == 2 and stderr == MILLION_LINE + "\n", stderr
    assert "Traceback" not in stderr and not (tmp_path / "s").exists()
    assert rss < MAX_RSS_MB, f"peak RSS {rss:.0f} MB ({wall:.1f} s)"
