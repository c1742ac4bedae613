"""Fuzzing ``python -m dumper sweep --grid``: hostile grids, parsed and refused before any engine loads.

Each case builds a list of ``--grid`` items from hostile parts (engine-arg keys, ``chunk_size``,
``batch_size`` and ``lengths``, unknown keys, empty keys, ``=``, unicode, control characters,
keys of 10,000 characters; empty, repeated, ``none``, negative, 10**30, float, ``block``,
unicode and control-character values; up to 60 axes; axes of up to 10,000 values, products of
10**12 cells and far past; keys given twice) and a cap (``max_cells``), and checks
:func:`dumper.jobs.sweep.grid.parse_grid` in-process against an oracle written from its
contract:

* an item is ``KEY=V1,V2,...`` (split at the first ``=``, key and values stripped) with no empty
  key or value, no value twice, and no key given twice; the grid has an axis; the cap is an int
  >= 1; the cells, the product of the axes' value counts (``lengths=block``, any case, counting
  as its six lengths), are at most the cap;
* a grid that breaks one of these raises :class:`~dumper.errors.UsageError`, never another
  exception, whose message is one printable line that names the problem (the item, the key,
  the cell count and the cap); any other grid is returned, axis by axis as given;
* every call ends within 5 s (:func:`tests.fuzzing.deadline`).

A second fuzz runs such grids through the real CLI in-process (:func:`tests.fuzzing.run_main`,
:func:`tests.fuzzing.check_outcome`), with a ``--baseline`` that does not exist: ``cmd_sweep``
parses the grid before it reads the baseline, so a bad grid exits 2 naming the grid, a good one
exits 2 naming the missing baseline, and no engine module is ever imported, no ``--out`` made.

Explicit tests: each class of bad item; the 10^6-cell grid (3 axes x 100) in a child process
(:func:`tests.fuzzing.run_child`: wall time and peak RSS); a 10**12-cell grid refused in bounded
time; control characters in a key escaped on stderr; and a grid whose cell count has over 4,300
digits (Python's int-to-str limit), once an internal error (exit 3), now one line.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dumper.cli.main import main as dumper_main
from dumper.errors import UsageError
from dumper.format.files import printable
from dumper.jobs.sweep.grid import MAX_CELLS, parse_grid
from tests.fuzzing import FUZZ, LIMIT, check_outcome, deadline, has_control, run_child, run_main

ENGINE_KEYS = [
    "enable_prefix_caching",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_model_len",
    "enforce_eager",
    "tensor_parallel_size",
    "kv",
    "threads",
    "flash_attn",
    "hf_dir",
    "verbose",
]
"""Keys of the engines' ``ENGINE_ARGS`` tables (vLLM, llama.cpp, ONNX Runtime GenAI): valid grid keys."""
KEYS = [
    "chunk_size",
    "batch_size",
    "lengths",
    *ENGINE_KEYS,
    "LENGTHS",
    " lengths ",
    "\tchunk_size",
    "nope",
    "",
    " ",
    "=",
    "a,b",
    "\x1b[31mred",
    "\x07",
    "\x00",
    "\x9b",
    "\u2028",
    "\x85",
    "\x1c",
    "\u00a0",
    "é",
    "名前",
    "\ud800",
    "k" * 10_000,
    "-",
    "--grid",
    "--debug",
]
VALUES = [
    "none",
    "None",
    "NONE",
    "block",
    "Block",
    "BLOCK",
    "0",
    "1",
    "2",
    "16",
    "-1",
    "-0",
    "+3",
    str(10**30),
    "1.5",
    "1e3",
    "nan",
    "inf",
    "true",
    "",
    " ",
    "\t",
    "=",
    "\x1b[2J",
    "\x00",
    "\x07",
    "é",
    "\u2028",
    "\ud800",
    "v" * 5_000,
]
NO_ENGINE = ("vllm", "llama_cpp", "onnxruntime_genai")
"""Top-level modules of the engines: none may be imported by a sweep that stops at its arguments."""

keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=12))
values = st.one_of(st.sampled_from(VALUES), st.integers(-(10**40), 10**40).map(str), st.text(max_size=6))
good_keys = keys.filter(lambda k: k.strip() != "" and "=" not in k)
good_values = values.filter(lambda v: v.strip() != "" and "," not in v)


@st.composite
def items(draw: st.DrawFn, *, most: int = 12) -> list[str]:
    """A hostile ``--grid`` list: well-formed axes (hostile keys and values, a few of up to 10^4 values; in a
    third of the lists 60 axes, products far past 10^12 cells), then, in most lists, damage: an empty value, a
    repeated value, a key given again, no ``=``, an empty key, raw text."""
    out: list[str] = []
    seen: set[str] = set()
    many = draw(st.integers(0, 2)) == 0
    for _ in range(60 if many else draw(st.integers(0, most))):
        key = draw(good_keys)
        if key.strip() in seen:
            continue
        seen.add(key.strip())
        if draw(st.integers(0, 5)) == 0:  # a big axis of distinct values
            vals = list(map(str, range(1, draw(st.sampled_from([2, 6, 10, 100, 1000, 10_000])) + 1)))
        else:
            vals = draw(st.lists(good_values, min_size=1, max_size=8, unique_by=str.strip))
        out.append(f"{key}={','.join(vals)}")
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        form = draw(st.sampled_from(["empty-value", "raw", "no-sep", "repeat-key", "repeat-value", "empty-key"]))
        if form == "empty-value":
            item = f"{draw(good_keys)}={draw(st.sampled_from(['', ' ', ',', '1,', ',1', '1,,2', '1, ,2']))}"
        elif form == "raw":
            item = draw(st.one_of(st.text(max_size=20), st.sampled_from(["", "=", "==", ",", "=,", "a=,", "a=b,"])))
        elif form == "no-sep":
            item = draw(keys.filter(lambda k: "=" not in k))
        elif form == "repeat-key" and out:  # an earlier item's key again (maybe respaced), other values
            key = draw(st.sampled_from(out)).partition("=")[0]
            item = f"{draw(st.sampled_from(['', ' ']))}{key}={draw(good_values)}"
        elif form == "repeat-value":
            v = draw(good_values)
            item = f"{draw(good_keys)}={v},{draw(good_values)},{draw(st.sampled_from(['', ' ']))}{v}"
        else:
            item = f"{draw(st.sampled_from(['', ' ', chr(9)]))}={draw(good_values)}"
        out.insert(draw(st.integers(0, len(out))), item)
    return out


caps = st.one_of(st.sampled_from([1, 6, 7, 100, MAX_CELLS, 10**6, 10**12, 10**30]), st.integers(1, 10**13))


def _oracle(grid: list[str], max_cells: Any) -> tuple[str, Any]:
    """What ``parse_grid(grid, max_cells=max_cells)`` must do, from its contract: ("ok", (keys, values, cells)),
    or the first problem: ("malformed", item), ("twice", key), ("repeated", item), ("empty", None),
    ("cap", max_cells), ("over", (cells, sizes))."""
    seen: set[str] = set()
    axes: list[tuple[str, tuple[str, ...]]] = []
    for item in grid:
        key, sep, rest = item.partition("=")
        key, vals = key.strip(), tuple(v.strip() for v in rest.split(","))
        if not sep or not key or "" in vals:
            return "malformed", item
        if key in seen:
            return "twice", key
        if len(set(vals)) != len(vals):
            return "repeated", item
        seen.add(key)
        axes.append((key, vals))
    if not axes:
        return "empty", None
    if type(max_cells) is not int or max_cells < 1:
        return "cap", max_cells
    sizes = [
        sum(6 if v.lower() == "block" else 1 for v in vals) if key == "lengths" else len(vals) for key, vals in axes
    ]
    cells = math.prod(sizes)
    return ("ok", (axes, cells)) if cells <= max_cells else ("over", (cells, sizes))


def _one_line(msg: str) -> None:
    assert "\n" not in msg and len(msg.splitlines()) == 1, repr(msg[:300])
    assert not has_control(msg) and msg.isprintable(), repr(msg[:300])


def _check_parse(grid: list[str], max_cells: Any) -> str:
    """parse_grid against the oracle; returns the oracle's class."""
    kind, detail = _oracle(grid, max_cells)
    start = time.perf_counter()
    try:
        with deadline(5):
            axes = parse_grid(grid, max_cells=max_cells)
    except UsageError as e:
        msg = str(e)
        _one_line(msg)
        assert kind != "ok", msg
        if kind == "malformed":
            assert msg == f"--grid {printable(detail)!r}: expected KEY=V1,V2,... with no empty value", msg[:300]
        elif kind == "twice":
            assert msg == f"--grid {printable(detail)}: given twice; list all its values in one --grid", msg[:300]
        elif kind == "repeated":
            assert msg == f"--grid {printable(detail)!r}: a value is repeated", msg[:300]
        elif kind == "empty":
            assert msg.startswith("--grid: give at least one axis"), msg
        elif kind == "cap":
            assert msg.startswith("--max-cells must be a positive integer"), msg
        else:
            cells, sizes = detail
            assert msg.startswith(f"--grid: {cells} cells ("), msg[:300]
            assert f"more than --max-cells {max_cells};" in msg, msg[:300]
            assert all(f" {n}" in msg for n in sizes), msg[:300]
    else:
        assert kind == "ok", (kind, repr(detail)[:300])
        expected, cells = detail
        assert [(a.key, a.values) for a in axes] == expected and cells <= max_cells
    assert time.perf_counter() - start < 5
    return kind


# -- the fuzz ----------------------------------------------------------------------------------------
@pytest.mark.slow
@given(grid=items(), max_cells=caps, bad_cap=st.sampled_from([None] * 9 + [0, -1, True, 2.5, "7", None]))
@settings(FUZZ, max_examples=400)
def test_hostile_grids_in_process(grid: list[str], max_cells: int, bad_cap: Any) -> None:
    """parse_grid returns the axes as given (cells within the cap) or raises one printable UsageError line naming
    the problem; never another exception, never slowly."""
    _check_parse(grid, max_cells if bad_cap is None else bad_cap)


def _cli(tmp: Path, grid: list[str], *extra: str) -> tuple[int, str, Path]:
    """``dumper sweep --baseline MISSING --grid=... --out OUT`` in-process, checked; (exit, stderr, missing)."""
    missing, out = tmp / "no-baseline", tmp / "sweep-out"
    before = set(sys.modules)
    with deadline(30):
        o = run_main(
            dumper_main, ["sweep", "--baseline", missing, *[f"--grid={g}" for g in grid], "--out", out, *extra]
        )
    assert check_outcome(o) == 2, o.err
    loaded = [m for m in set(sys.modules) - before if m.split(".")[0] in NO_ENGINE]
    assert not loaded and not out.exists(), loaded
    return o.code, o.err, missing


@given(
    grid=items(most=12),
    cap=st.one_of(st.none(), st.none(), caps.map(str), st.sampled_from(["0", "-1", "x", "", " 5 ", "1e3", "9" * 5000])),
)
@settings(FUZZ, max_examples=40)
def test_hostile_grids_through_the_cli_stop_before_any_engine(
    tmp_path_factory: pytest.TempPathFactory, grid: list[str], cap: str | None
) -> None:
    """Exit 2, one line: the grid's problem (or --max-cells's), else the missing baseline; no engine imported."""
    tmp = tmp_path_factory.mktemp("sweep")
    _, err, missing = _cli(tmp, grid, *(["--max-cells", cap] if cap is not None else []))
    try:
        parsed = int(cap) if cap is not None else MAX_CELLS
    except ValueError:
        parsed = 0
    if cap is not None and parsed < 1:  # argparse converts --max-cells as it reads it: before its required --grid
        assert err.startswith("error: python -m dumper sweep: argument --max-cells: expected a positive integer"), err
    elif not grid:
        assert "--grid" in err and "required" in err, err
    elif _oracle(grid, parsed)[0] == "ok":
        assert err == f"error: {missing}: no such dump directory\n", err[:300]
    else:
        assert err.startswith(("error: --grid ", "error: --grid: ")), err[:300]


# -- each class, explicitly --------------------------------------------------------------------------
HUNDRED = ",".join(map(str, range(1, 101)))
MILLION = (f"chunk_size={HUNDRED}", f"batch_size={HUNDRED}", f"lengths={HUNDRED}")


@pytest.mark.parametrize(
    ("grid", "kind"),
    [
        ([], "empty"),
        ([""], "malformed"),
        (["="], "malformed"),
        (["chunk_size"], "malformed"),
        (["chunk_size="], "malformed"),
        (["=1,2"], "malformed"),
        (["chunk_size=1,,2"], "malformed"),
        (["chunk_size=1, "], "malformed"),
        (["chunk_size=1,1"], "repeated"),
        (["lengths=block, block"], "repeated"),
        (["chunk_size=1", " chunk_size =2"], "twice"),
        (["lengths=4", "chunk_size=1", "lengths=5"], "twice"),
        (["lengths=block,BLOCK,Block"], "over"),
        (["nope=1,2", "\u00e9=x"], "ok"),
        (["chunk_size=none,-1,1e3"], "ok"),
        ([f"k{i}=1,2" for i in range(12)], "ok"),
        ([f"k{i}=1,2" for i in range(13)], "over"),
        ([f"batch_size={10**30},{-(10**30)}"], "ok"),
        (["lengths=block"], "ok"),
    ],
    ids=repr,
)
def test_each_class_of_grid(grid: list[str], kind: str) -> None:
    """Stripped keys compare equal; ``block`` in any case is six lengths (an upper bound: 18 here, over a cap of 17)."""
    max_cells = 17 if kind == "over" and grid[0].startswith("lengths") else MAX_CELLS
    assert _check_parse(grid, max_cells) == kind


def test_the_million_cell_grid_in_a_child_is_refused_fast_and_small(tmp_path: Path) -> None:
    """10^6 cells (3 axes x 100 valid values): exit 2 at parse time, in a real process, its RSS measured."""
    flags = [a for g in MILLION for a in ("--grid", g)]
    start = time.perf_counter()
    rc, err, rss = run_child(
        "dumper", "sweep", "--baseline", tmp_path / "missing", *flags, "--out", tmp_path / "s", timeout=60
    )
    wall = time.perf_counter() - start
    assert rc == 2 and err == (
        "error: --grid: 1000000 cells (chunk_size 100 x batch_size 100 x lengths 100), more "
        "than --max-cells 4096; narrow an axis, or raise the cap with --max-cells N"
    ), err
    assert wall < 30 and rss < LIMIT and not (tmp_path / "s").exists(), (wall, rss)
    print(f"10^6-cell grid: exit 2 in {wall:.2f} s, peak RSS {rss / 2**20:.0f} MiB (VmHWM of the child)")


def test_a_grid_of_10_12_cells_is_refused_in_bounded_time(tmp_path: Path) -> None:
    grid = [f"{k}={','.join(map(str, range(1, 1001)))}" for k in ("chunk_size", "batch_size", "lengths", "threads")]
    start = time.perf_counter()
    with pytest.raises(
        UsageError,
        match=r"^--grid: 1000000000000 cells \(chunk_size 1000 x batch_size 1000 x "
        r"lengths 1000 x threads 1000\), more than --max-cells 4096;",
    ):
        with deadline(5):
            parse_grid(grid)
    assert time.perf_counter() - start < 5
    with deadline(30):
        _, err, _ = _cli(tmp_path, grid, "--max-cells", str(10**12 - 1))
    assert err.startswith("error: --grid: 1000000000000 cells (") and "--max-cells 999999999999;" in err, err
    assert _check_parse([*grid, "lengths=block"], 10**30) == "twice"


@pytest.mark.parametrize(
    "key", ["\x1b[31mred", "\x1b]0;title\x07", "\x9b2J", "a\rb", "a\u2028b", "\x00", "\ud800"], ids=repr
)
@pytest.mark.parametrize("how", ["malformed", "twice", "over", "repeated"])
def test_control_characters_in_a_key_never_reach_stderr_raw(tmp_path: Path, key: str, how: str) -> None:
    grid = {
        "malformed": [key],
        "twice": [f"{key}=1", f"{key}=2"],
        "over": [f"{key}=1,2", f"b{key}=1,2,3"],
        "repeated": [f"{key}=1,1"],
    }[how]
    cap = "5" if how == "over" else "4096"
    assert _check_parse(grid, int(cap)) == how
    _, err, _ = _cli(tmp_path, grid, "--max-cells", cap)
    shown = repr(printable(grid[0])) if how in ("malformed", "repeated") else printable(key)  # as the message names it
    assert shown in err and key not in err and not has_control(err), repr(err)
    assert err.count("\n") == 1 and err.rstrip("\n").isprintable(), repr(err)


DIGITS = [f"k{i}={','.join(map(str, range(10)))}" for i in range(4301)]
"""4,301 axes of 10 values: 10^4301 cells, a number of 4,302 digits, past Python's int-to-str limit (4,300)."""


@pytest.mark.parametrize("surface", ["parse_grid", "cli"])
def test_a_cell_count_of_over_4300_digits_is_refused_in_one_line(tmp_path: Path, surface: str) -> None:
    if surface == "parse_grid":
        with pytest.raises(UsageError, match=r"^--grid: .* cells .*more than --max-cells 4096;"):
            parse_grid(DIGITS)
    else:
        _, err, _ = _cli(tmp_path, DIGITS)  # check_outcome: exit 2, one line (today: exit 3, "internal error")
        assert err.startswith("error: --grid: "), err[:300]
