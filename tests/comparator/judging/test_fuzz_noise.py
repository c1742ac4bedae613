"""Fuzzing the noise file: a real NOISE.json, damaged, read by ``python -m comparator BASE TARGET --noise``.

A real tiny-llama baseline (float32, every layer, logprobs with top-3) is calibrated from one
benign variant (SDPA attention) with ``python -m comparator calibrate``; the target is the same
preset with another seed (other weights): a real divergence, failed by the fixed thresholds and
by the real noise alike. Each case damages the noise file one way and runs the comparator
in-process (:func:`tests.fuzzing.run_main`), checking :func:`tests.fuzzing.check_outcome` (exit
0, 1 or 2, no traceback, one ``error:`` line, no control character, nothing under ``outside/``
opened, bounded memory) and the noise rules:

* a value the format cannot hold (a wrong type, a noise value that is negative, NaN or, for a
  rel_diff, above 2, an integer that is not an int, a duplicate tensor, a missing or unknown
  key) exits 2;
* the divergent target never passes silently: an exit 0 carries a ``warning:`` line (only noise
  that excuses what the fixed thresholds fail can pass it), and the JSON report lists the
  warnings stderr shows.

Explicit tests cover each class (a FIFO and a /dev/zero symlink at the noise path, under a
deadline; Infinity integers; a non-object model; strings and booleans as numbers; duplicates;
values above 2; 1e9 everywhere; large but possible noise, which passes with a warning), the run
store's reader (the same one), calibration from a variant with other weights, and the peak RSS of
the comparator in a child process on the largest hostile noise files.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.cli.main import main as compare_main
from comparator.noise.file import MAX_NOISE_BYTES, load_noise
from comparator.store.errors import StoreError
from comparator.store.record import StoredNoise
from comparator.store.types import Calibration
from dumper.format import load_manifest
from dumper.format.files import JSON_MEMORY_BUDGET, is_text, json_memory_bound, printable
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, run_dump
from tests.fuzzing import FUZZ, LIMIT, Outcome, check_outcome, deadline, get_path, json_paths, run_child, run_main

INF, NAN = math.inf, math.nan


class World:
    """Real dumps and their real noise file, a sentinel ``outside/``, and fresh files to damage."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name, settings_ in (("base", {}), ("sdpa", {"attn": "sdpa"}), ("other", {"seed": 1})):
            run_dump(RunConfig(out=str(root / name), layers="all", logprobs=LogprobSpec(top_k=3), **settings_))  # type: ignore[arg-type]
        self.base, self.sdpa, self.other = root / "base", root / "sdpa", root / "other"
        self.noise = root / "NOISE.json"
        o = run_main(compare_main, ["calibrate", self.base, self.sdpa, "--out", self.noise, "--quiet"])
        assert o.code == 0, o.err
        self.json: dict[str, Any] = json.loads(self.noise.read_text())
        self.json["model_mismatch"] = []  # present, so that the fuzz can damage it too
        del self.json["rows"]  # the row-noise side file and its reference: tests/comparator/noise/test_row_noise.py
        self.outside = root / "outside"  # valid copies: a reader that followed a path from the file would pass
        shutil.copytree(self.base, self.outside / "base")
        shutil.copy(self.noise, self.outside / "NOISE.json")
        self._n = itertools.count()

    def fresh(self) -> dict[str, Any]:
        return copy.deepcopy(self.json)

    def write(self, content: dict[str, Any] | bytes) -> Path:
        path = self.root / "cases" / f"n{next(self._n)}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        return path

    def judge(
        self, noise: Path, *args: str | os.PathLike[str], divergent: bool = True
    ) -> tuple[Outcome, dict[str, Any] | None]:
        """``comparator BASE OTHER --noise NOISE --quiet --json R`` (``args``: another command line), checked;
        ``divergent``: the comparison is a real divergence, so a pass must warn."""
        report = noise.with_suffix(".report.json")
        argv = list(args) or [self.base, self.other, "--noise", noise, "--quiet"]
        o = run_main(compare_main, [*argv, "--json", report])
        check_outcome(o, outside=self.outside)
        shown = [ln for ln in o.err.splitlines() if ln.startswith("warning: ")]
        if o.code == 0 and divergent:
            assert shown, f"the divergent target passed without a warning: {o.out}"
        data = json.loads(report.read_text()) if o.code in (0, 1) else None
        if data is not None:
            warnings = data["warnings"] if "warnings" in data else data["noise"]["warnings"]
            assert shown == [f"warning: {printable(w)}" for w in warnings], (shown, warnings)
        return o, data


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("fuzz-noise"))


# -- the schema, as the oracle of the fuzz -------------------------------------------------------------
REL = {"rel_diff", "token_max", "token_p999", "token_p99"}
TOP_REQUIRED = {"format", "baseline", "variants", "model", "dtype", "tensors", "logprobs"}
LOGPROB_REQUIRED = {"variants", "positions", "metrics", "means", "by_variant"}
ODD = [
    "0.0",
    "3",
    True,
    False,
    None,
    [],
    {},
    "",
    -1,
    -1e-300,
    0,
    0.5,
    1,
    2,
    2.5,
    3.0,
    1e9,
    2**63,
    10**400,
    INF,
    -INF,
    NAN,
    "\ud800",
    "\x1b[31mred",
    "model.layers.0.self_attn.input",
    [0.5],
    {"a": 1},
]


def _num(v: Any, high: float = INF) -> bool:
    """A finite number in [0, high] that a float can hold (10**400 is an int JSON allows, but no float)."""
    return type(v) in (int, float) and 0 <= v <= min(high, sys.float_info.max)


def _int(v: Any, low: int | None = 0) -> bool:
    return type(v) is int and (-(2**63) if low is None else low) <= v < 2**63


def _kind_ok(path: tuple, v: Any) -> bool | None:
    """Whether ``v`` is a value the format allows at ``path`` (None: allowed, but it may still exit 2,
    as another model identity or dtype does, or not a field the oracle knows)."""
    head, n = path[0], len(path)
    if head == "format":
        return False
    if head in ("baseline",) or head == "variants" and n == 2:
        return is_text(v)
    if head == "variants" or head == "tensors" and n == 2:
        return False  # no odd value is a list of names or a tensor entry
    if head == "dtype":
        return False if not (v is None or is_text(v)) else None
    if head == "model":
        if n == 1:
            return False if type(v) is not dict else None
        return (
            False
            if path[1] in ("num_layers", "hidden_size")
            and not (v is None or _int(v))
            or path[1] in ("name", "architecture", "config_hash", "weights_hash")
            and not (v is None or is_text(v))
            else None
        )
    if head == "tensors" and n == 3:
        key = path[2]
        return (
            _num(v, 2)
            if key in REL
            else _int(v)
            if key == "positions"
            else _int(v, None) or v is None
            if key == "layer"
            else v is None or is_text(v)
            if key == "point"
            else is_text(v) and bool(v) and v.isprintable()
            if key == "name"
            else type(v) is list and len(v) == 1 and _num(v[0], 2)
            if key == "by_variant"
            else None
        )
    if head == "tensors" and n == 4:
        return _num(v, 2)
    if head == "logprobs" and n == 1:
        return True if v is None else False if type(v) is not dict else None
    if head == "logprobs" and n == 2:
        return (
            v == 1 and type(v) is int
            if path[1] == "variants"
            else _int(v, 1)
            if path[1] == "positions"
            else False
            if type(v) is not dict
            else None
        )
    if head == "logprobs" and n == 3:
        return (
            v is None or _num(v)
            if path[1] == "metrics"
            else False
            if path[1] == "means" and type(v) is not dict
            else type(v) is list and len(v) == 1 and (v[0] is None or _num(v[0]))
            if path[1] == "by_variant"
            else None
        )
    if head == "logprobs" and n == 4:
        return _int(v) if path[3] == "positions" else _num(v) if path[1] == "means" else v is None or _num(v)
    if head == "model_mismatch":
        return False if n == 1 and type(v) is not list else None
    if head == "layouts":  # a list of the baseline's and each variant's settings, each a flat object of scalars
        if n == 1:
            return v == [] if type(v) is list else False
        if n == 2:
            return v == {} if type(v) is dict else False
        return False if type(v) in (list, dict) else None
    return None


def _dropped_ok(path: tuple) -> bool | None:
    """Whether the format allows the key or list item at ``path`` to be missing."""
    head, n = path[0], len(path)
    if n == 1:
        return head in ("model_mismatch", "layouts")
    if head == "layouts":
        return n == 3  # one run's layout missing is a count mismatch; one setting missing, another layout
    if head == "model" or head == "logprobs" and n == 3 or head == "tensors" and n == 2:
        return True  # identity fields, one metric, one tensor: each optional
    if head == "variants" or head == "tensors" and n in (3, 4) or head == "logprobs" and n in (2, 4):
        return False
    return None


# -- the fuzz ----------------------------------------------------------------------------------------
OPS = ["retype"] * 4 + ["drop"] * 2 + ["unknown", "duplicate", "everywhere", "mismatch"]
"""Retyped values are most of the surface: drawn most often."""


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=240)
def test_mutated_noise_files(world: World, data: st.DataObject) -> None:
    """Values retyped or made huge, keys dropped or added, tensors duplicated, hostile paths and text."""
    d = world.fresh()
    op = data.draw(st.sampled_from(OPS))
    expect = {0, 1, 2}
    if op == "retype":
        path = data.draw(st.sampled_from(json_paths(d)))
        value = data.draw(st.sampled_from([*ODD, str(world.outside / "base"), str(world.outside / "NOISE.json")]))
        names = {t["name"] for t in d["tensors"]}
        get_path(d, path[:-1])[path[-1]] = value
        ok = _kind_ok(path, value)
        expect = {2} if ok is False else {0, 1} if ok else expect
        if path[-1] == "name" and isinstance(value, str) and value in names and value != get_path(world.json, path):
            expect = {2}  # now two entries of one tensor
    elif op == "drop":
        path = data.draw(st.sampled_from([p for p in json_paths(d) if p != ("format",)]))
        del get_path(d, path[:-1])[path[-1]]
        ok = _dropped_ok(path)
        expect = {2} if ok is False else {0, 1} if ok else expect
    elif op == "unknown":
        where = data.draw(
            st.sampled_from(
                [
                    (),
                    ("tensors", 0),
                    ("logprobs",),
                    ("logprobs", "metrics"),
                    ("logprobs", "means", "k3_mean"),
                    ("model",),
                ]
            )
        )
        get_path(d, where)[data.draw(st.sampled_from(["zz", "\x1b[2J", "\ud800"]))] = 1
        expect = {0, 1} if where == ("model",) else {2}
        if where == ("model",) and "\ud800" in get_path(d, where):
            expect = {2}  # keys are text too
    elif op == "duplicate":
        entry = copy.deepcopy(data.draw(st.sampled_from(d["tensors"])))
        entry["rel_diff"] = data.draw(st.sampled_from([entry["rel_diff"], 2.0, 1e9]))
        d["tensors"].insert(data.draw(st.integers(0, len(d["tensors"]))), entry)
        expect = {2}
    elif op == "everywhere":  # every tensor value at v, every logprob value at w: 1e9 everywhere among them
        v, w = (
            data.draw(st.sampled_from([0, 1e-3, 0.5, 1.0, 2.0, 2.5, 1e9])),
            data.draw(st.sampled_from([0, 1e3, 1e9, -1.0])),
        )
        for t in d["tensors"]:
            t.update({k: v for k in REL}, by_variant=[v])
        lp = d["logprobs"]
        lp["metrics"] = {k: w for k in lp["metrics"]}
        lp["by_variant"] = {k: [w] for k in lp["by_variant"]}
        for m in lp["means"].values():
            m.update(mean=w, se=w)
        expect = {2} if v > 2 or w < 0 else {0, 1}
    else:  # a calibration across models, recorded: every verdict must say so
        field = data.draw(st.sampled_from(["weights_hash", "config_hash", "num_layers", "colour"]))
        variant = data.draw(st.sampled_from(["listed", "unlisted", "escaped"]))
        if variant == "escaped":  # a variant path with an escape sequence: warned about, escaped
            d["variants"][0] = "\x1b[31m" + d["variants"][0]
        name = "not-a-variant" if variant == "unlisted" else d["variants"][0]
        d["model_mismatch"].append({"variant": name, "field": field, "baseline": "a", "target": 8})
        expect = {2} if field == "colour" or variant == "unlisted" else {0, 1}
    o, report = world.judge(world.write(d))
    assert o.code in expect, (op, o.code, expect, o.err)
    if op == "mismatch" and report is not None:
        assert any("--allow-model-mismatch" in w for w in report["warnings"]), report["warnings"]


@given(data=st.data())
@settings(FUZZ, max_examples=60)
def test_damaged_noise_bytes(world: World, data: st.DataObject) -> None:
    """Cut, overwritten or spliced bytes, and numbers respelled (Infinity, NaN, 1e999, -0, 1.0): never a crash."""
    text = json.dumps(world.json, indent=1).encode()
    op = data.draw(st.sampled_from(["cut", "byte", "splice", "number"]))
    if op == "cut":
        text = text[: data.draw(st.integers(0, len(text) - 1))]
    elif op == "byte":
        i = data.draw(st.integers(0, len(text) - 1))
        text = text[:i] + bytes([data.draw(st.integers(0, 255))]) + text[i + 1 :]
    elif op == "splice":
        i = data.draw(st.integers(0, len(text)))
        junk = data.draw(st.sampled_from([b"\xff\xfe", b"[" * 5000, b'"\\ud800"', b"\x00", b",,"]))
        text = text[:i] + junk + text[i:]
    else:
        spots = [i for i in range(len(text)) if text[i : i + 1].isdigit() and not text[i - 1 : i].isdigit()]
        i = data.draw(st.sampled_from(spots))
        j = i
        while j < len(text) and text[j : j + 1] in b"0123456789.e-+":
            j += 1
        text = text[:i] + data.draw(st.sampled_from([b"Infinity", b"NaN", b"1e999", b"-0", b"1.0", b"true"])) + text[j:]
    world.judge(world.write(text))


# -- each class of hostile noise file -----------------------------------------------------------------
def _refused(world: World, noise: Path, *needles: str) -> str:
    o, _ = world.judge(noise)
    assert o.code == 2 and all(n in o.err for n in needles), o.err
    return o.err


def _edited(world: World, edit: Callable[[dict[str, Any]], None]) -> Path:
    d = world.fresh()
    edit(d)
    return world.write(d)


def test_a_fifo_at_the_noise_path_is_refused_at_once(world: World, tmp_path: Path) -> None:
    fifo = tmp_path / "NOISE.json"
    os.mkfifo(fifo)
    with deadline(30):  # before: a stat, then a read that waits for a writer forever
        _refused(world, fifo, str(fifo), "a FIFO, not a regular file")


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_a_symlink_to_a_device_is_refused_at_once(world: World, tmp_path: Path, target: str) -> None:
    link = tmp_path / "NOISE.json"
    link.symlink_to(target)  # st_size 0 passed the old size cap, then the read never ended
    with deadline(30):
        _refused(world, link, str(link), "a device, not a regular file")


def test_a_directory_and_a_missing_file_are_refused(world: World, tmp_path: Path) -> None:
    _refused(world, tmp_path, "a directory, not a regular file")
    _refused(world, tmp_path / "missing.json", "cannot open noise file")


INT_FIELDS = {
    "tensors[0] positions": ("tensors", 0, "positions"),
    "tensors[0] layer": ("tensors", 0, "layer"),
    "logprobs.variants": ("logprobs", "variants"),
    "logprobs.positions": ("logprobs", "positions"),
    "logprobs.means.mean_abs_err.positions": ("logprobs", "means", "mean_abs_err", "positions"),
}


@pytest.mark.parametrize("value", [INF, -INF, NAN, 3.0, 1e9, True, "3", 2**63], ids=repr)
@pytest.mark.parametrize("field", list(INT_FIELDS))
def test_an_integer_field_that_is_not_an_int_is_refused(world: World, field: str, value: Any) -> None:
    """int(Infinity) raised OverflowError (exit 3) in the tensor and logprob readers before."""
    path = INT_FIELDS[field]
    err = _refused(
        world,
        _edited(world, lambda d: get_path(d, path[:-1]).__setitem__(path[-1], value)),
        str(world.root),
        "expected an integer",
    )
    assert path[-1] in err and ("model.layers.0.self_attn.input" in err) == (path[0] == "tensors"), err


@pytest.mark.parametrize(
    "model", [[1, 2], "tiny-llama", 3, True, None, {"num_layers": "8"}, {"name": "\ud800"}], ids=repr
)
def test_a_model_identity_that_is_not_an_object_of_its_types_is_refused(world: World, model: Any) -> None:
    _refused(world, _edited(world, lambda d: d.__setitem__("model", model)), "model", "expected")


@pytest.mark.parametrize("value", ["0.0", True, False, None, [0.0], {"v": 0}], ids=repr)
@pytest.mark.parametrize(
    "field", ["rel_diff", "token_max", "by_variant[0]", "logprobs.metrics.max_abs_err", "logprobs.means.k3_mean.se"]
)
def test_noise_values_are_numbers_not_strings_or_booleans(world: World, field: str, value: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        if field.startswith("logprobs.metrics"):
            d["logprobs"]["metrics"]["max_abs_err"] = value
        elif field.startswith("logprobs.means"):
            d["logprobs"]["means"]["k3_mean"]["se"] = value
        elif field == "by_variant[0]":
            d["tensors"][3]["by_variant"][0] = value
        else:
            d["tensors"][3][field] = value

    if value is None and field == "logprobs.metrics.max_abs_err":  # null: a metric not computed, allowed
        o, _ = world.judge(_edited(world, edit))
        assert o.code == 1, o.err
        return
    _refused(world, _edited(world, edit), field.split(".")[-1], "expected")


@pytest.mark.parametrize("value", [2.0, 1e9], ids=repr)
def test_a_tensor_listed_twice_is_refused(world: World, value: float) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["tensors"].append({**d["tensors"][2], "rel_diff": value})

    err = _refused(world, _edited(world, edit), "model.layers.2.self_attn.input")
    assert ("listed twice (also tensors[2])" in err) == (value <= 2), err


@pytest.mark.parametrize("field", ["rel_diff", "token_max", "token_p999", "token_p99", "by_variant[0]"])
def test_a_rel_diff_noise_above_2_is_impossible(world: World, field: str) -> None:
    """rel_diff = |x-y|^2 / (|x|^2 + |y|^2) <= 2, the bound reached at y = -x: above it, exit 2 naming all."""

    def edit(d: dict[str, Any]) -> None:
        if field == "by_variant[0]":
            d["tensors"][5]["by_variant"][0] = 2.000001
        else:
            d["tensors"][5][field] = 2.000001

    _refused(
        world, _edited(world, edit), str(world.root), "model.layers.5.self_attn.input", field, "a rel_diff is at most 2"
    )


def _everywhere(d: dict[str, Any], tensor: float, logprob: float) -> None:
    for t in d["tensors"]:
        t.update(rel_diff=tensor, token_max=tensor, token_p999=tensor, token_p99=tensor, by_variant=[tensor])
    lp = d["logprobs"]
    lp["metrics"] = {k: logprob for k in lp["metrics"]}
    lp["by_variant"] = {k: [logprob] for k in lp["by_variant"]}
    for m in lp["means"].values():
        m.update(mean=logprob, se=logprob)


def test_1e9_everywhere_is_refused(world: World) -> None:
    """It turned the real divergence into PASS, silently, before."""
    _refused(world, _edited(world, lambda d: _everywhere(d, 1e9, 1e9)), "a rel_diff is at most 2")


def test_possible_noise_that_excuses_everything_passes_with_warnings(world: World) -> None:
    """Noise 1 per tensor (possible: unrelated vectors reach it) and 1e3 per logprob metric pass the
    other-weights target; the verdict warns on stderr and in the JSON report, for both parts."""
    big = _edited(world, lambda d: _everywhere(d, 1.0, 1e3))
    o, report = world.judge(big)
    assert o.code == 0 and report is not None and len(report["warnings"]) == 2, o.err
    tensors, logprobs = report["warnings"]
    assert str(big) in tensors and "8 of 8 calibrated tensors" in tensors and "over 10x" in tensors, tensors
    assert "logprob thresholds over 10x" in logprobs and "max_abs_err" in logprobs, logprobs
    assert report["logprobs"]["noise"]["warnings"] == [logprobs]
    o, verdict = world.judge(big, "logprobs", world.base, world.other, "--noise", big, "--quiet")
    assert o.code == 0 and verdict is not None and verdict["noise"]["warnings"] == [logprobs], o.err
    o, _ = world.judge(
        big,
        world.base,
        world.other,
        "--noise",
        big,
        "--quiet",
        "--threshold",
        "1e-3",
        "--logprob-threshold",
        "max_abs_err=1e-4",
    )  # explicit thresholds on top: no excuse, no warning
    assert o.code == 1 and o.err.count("warning: ") == 1, o.err  # the logprob metrics left to the noise warn
    assert "calibrated tensors" not in o.err and "max_abs_err <=" not in o.err and "mse <=" in o.err, o.err


def test_the_real_calibration_gives_no_warning(world: World) -> None:
    o, report = world.judge(world.noise, world.base, world.sdpa, "--noise", world.noise, "--quiet", divergent=False)
    assert o.code == 0 and report is not None and report["warnings"] == [] and "warning" not in o.err, o.err
    o, report = world.judge(world.noise)
    assert o.code == 1 and report is not None and report["warnings"] == [], o.err


def test_the_store_reads_noise_with_the_same_reader(world: World) -> None:
    """A stored noise.json vouched for by its record (sha256) but hostile: one StoreError, never an OverflowError."""
    cases = {
        "Infinity int": lambda d: d["tensors"][0].__setitem__("positions", INF),
        "1e9": lambda d: _everywhere(d, 1e9, 1e9),
        "model list": lambda d: d.__setitem__("model", [1]),
        "twice": lambda d: d["tensors"].append(d["tensors"][0]),
        "logprob variants 1.0": lambda d: d["logprobs"].__setitem__("variants", 1.0),
    }
    for label, edit in cases.items():
        raw = _edited(world, edit).read_bytes()
        with pytest.raises(StoreError) as e:
            StoredNoise.parse(raw, Calibration.of(raw, variants=1, measured_on="r"), "store/runs/r/noise.json")
        assert str(e.value).startswith("store/runs/r/noise.json: ") and "\n" not in str(e.value), (label, e.value)
    raw = world.noise.read_bytes()
    good = StoredNoise.parse(
        raw,
        Calibration.of(raw, variants=1, measured_on="r"),
        "noise.json",
        lambda name: ((world.noise.parent / name).read_bytes(), name),
    )
    assert good.noise == load_noise(world.noise) and good.noise.rows is not None


def test_calibrate_refuses_a_variant_with_other_weights(world: World, tmp_path: Path) -> None:
    """Another seed of the same preset is not a benign re-run: refused, or recorded with --allow-model-mismatch."""
    out = tmp_path / "NOISE.json"
    o = run_main(compare_main, ["calibrate", world.base, world.other, "--out", out, "--quiet"])
    assert check_outcome(o) == 2 and str(world.other) in o.err and "weights_hash" in o.err, o.err
    assert "--allow-model-mismatch" in o.err and not out.exists()
    o = run_main(
        compare_main,
        ["calibrate", world.base, world.sdpa, world.other, "--out", out, "--quiet", "--allow-model-mismatch"],
    )
    assert check_outcome(o) == 0 and "warning: " in o.err and "weights_hash" in o.err, o.err
    hashes = [load_manifest(p).model["weights_hash"] for p in (world.base, world.other)]
    assert json.loads(out.read_text())["model_mismatch"] == [
        {"variant": str(world.other), "field": "weights_hash", "baseline": hashes[0], "target": hashes[1]}
    ]
    noise = load_noise(out)
    assert noise.to_json() == json.loads(out.read_text()) and len(noise.model_mismatch) == 1
    o, report = world.judge(out)  # the other weights' difference became noise: it excuses itself, and says so
    assert report is not None and any("--allow-model-mismatch" in w for w in report["warnings"]), o.err
    assert o.code == 0 and any("over 10x" in w for w in report["warnings"]), report["warnings"]


# -- the largest hostile noise files, in real processes -----------------------------------------------
def _largest(text: str, unit: Callable[[int], str]) -> bytes:
    """``text`` with ``"@@"`` replaced by ``unit(n)``, n the largest the JSON memory budget lets through."""

    def at(n: int) -> bytes:
        return text.replace('"@@"', unit(n)).encode()

    per = (json_memory_bound(at(2000)) - json_memory_bound(at(1000))) / 1000  # the bound is linear in n
    out = at(int((JSON_MEMORY_BUDGET - json_memory_bound(at(1000))) / per) + 999)
    assert JSON_MEMORY_BUDGET - 4096 < json_memory_bound(out) <= JSON_MEMORY_BUDGET
    return out


@pytest.mark.slow
def test_largest_hostile_noise_files_stay_under_512_mib(world: World, tmp_path: Path) -> None:
    d = world.fresh()
    d["model"]["extra"] = "@@"  # the costliest JSON under the budget: distinct keys, kept in memory
    keys = _largest(
        json.dumps(d, separators=(",", ":")), lambda n: "{" + ",".join(f'"k{i:07d}":"ab"' for i in range(n)) + "}"
    )
    d = world.fresh()
    d["tensors"].append("@@")  # as many tensor entries as the budget allows, each read into a TensorNoise
    entry = (
        '{{"name":"t{:07d}","layer":1,"point":"p","rel_diff":0.1,"token_max":0.1,"token_p999":0.1,'
        '"token_p99":0.1,"positions":1,"by_variant":[0.1]}}'
    )
    tensors = _largest(json.dumps(d, separators=(",", ":")), lambda n: ",".join(entry.format(i) for i in range(n)))
    dense = b'{"format":"driftscope-noise/1","tensors":[' + b"0," * ((MAX_NOISE_BYTES - 64) // 2) + b"0]}"
    files = {
        "distinct keys in model": (keys, 1, None),
        "tensor entries": (tensors, 1, None),
        "dense numbers at the cap": (dense, 2, "too many JSON values"),
        "one byte over the cap": (None, 2, "exceeds the 64 MiB limit"),
    }
    results = {}
    for label, (content, code, needle) in files.items():
        path = tmp_path / "hostile.json"
        if content is None:
            with open(path, "wb") as f:
                f.truncate(MAX_NOISE_BYTES + 1)  # sparse: refused on its size, before a byte is read
        else:
            path.write_bytes(content)
        rc, err, rss = run_child("comparator", world.base, world.other, "--noise", path, "--quiet")
        assert rc == code and (needle is None or needle in err), (label, rc, err[-500:])
        assert "Traceback" not in err and rss < LIMIT, (label, rss)
        results[f"{label} ({path.stat().st_size >> 20} MiB)"] = rss >> 20
        path.unlink()
    print("peak RSS (MiB):", results)
