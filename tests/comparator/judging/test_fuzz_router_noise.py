"""Fuzzing the ``router`` section of a noise file: real MoE dumps, a real NOISE.json, damaged routing noise.

The dumps are the tiny seeded Mixtral of :mod:`tests.routing_dumps` (3 MoE layers, 8 experts,
top-2, points ``input`` and ``router``): a baseline, a benign variant (SDPA attention) that
``python -m comparator calibrate`` turns into a real NOISE.json with a ``router`` list (one entry
per layer: ``layer``, ``score``, ``flip_rate``, ``weight``, ``tokens``), and a target with a
seeded routing flip (a logit bias that moves one token of layer 1 to another expert, far from any
tie: :func:`tests.routing_dumps.choose_flip_token`). Each case damages the router list one way
(entries retyped: strings, booleans, null, NaN, Infinity, negatives, 10**400, 1e300; keys
dropped or added; entries dropped, duplicated, or for layers the dumps lack; flip_rate above 1,
weight above 2; score 0 and 1e9; lists of thousands of entries), sometimes on top of noise loose
enough to excuse the flip (every tensor noise 1, layer 1's score 1e9, layer 2's weight 2), and
judges ``comparator BASE TARGET --noise NOISE --quiet --json R`` in-process
(:func:`tests.fuzzing.run_main`, :func:`tests.fuzzing.check_outcome`), with the oracle:

* a value the format cannot hold (a wrong type; a layer or tokens that is no int in [0, 2^63); a
  score, flip_rate or weight that is negative, NaN, infinite or past its bound: a float's
  largest, 1 and 2; a missing or unknown key; a layer listed twice) exits 2 with one line naming
  the noise file and the field (``router[1].score``);
* anything else exits 0 or 1; on the seeded flip a pass is never silent: an exit 0, or a
  routing section that passed, carries the warning that layer 1's routing noise excuses flips;
* every warning on stderr is one of the JSON report's ``warnings``, in order, and the routing
  section's warnings are among them.

The same mutations run against the reader alone (:func:`router_noise_from_json`, no dumps: the
quick tier). Explicit tests: score 1e9 on every layer, flip_rate 1.0, NaN and the other
impossible values per field, the honest calibration, and the peak RSS of the comparator in a
child (:func:`tests.fuzzing.run_child`) on router lists of 100k entries and of as many as the JSON
memory budget lets through. A renormalisation bug at the last MoE layer that a loose but
possible calibrated weight noise excuses passes only with a warning naming the layer (it once
passed silently: the weight limit had no "excessive" warning).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.cli.main import main as compare_main
from comparator.judging.router_noise import RouterNoise, router_noise_from_json
from dumper.errors import UsageError
from dumper.format.files import JSON_MEMORY_BUDGET, json_memory_bound, printable
from tests.fuzzing import FUZZ, LIMIT, Outcome, check_outcome, has_control, run_child, run_main
from tests.routing_dumps import choose_flip_token, router_dump

INF, NAN = math.inf, math.nan
FLOAT_MAX = sys.float_info.max
KEYS = ("layer", "score", "flip_rate", "weight", "tokens")
FLIPPED = 1
"""The MoE layer of the seeded flip."""
EXCUSED = f"layer {FLIPPED}: routing noise excuses flips"
"""The warning a pass of the seeded flip must carry (its margin is ~1000x the margin rule's unit)."""
CALIBRATED = [
    {"layer": 0, "score": 8.940696716308594e-08, "flip_rate": 0.0, "weight": 5.960464477539063e-08, "tokens": 80},
    {"layer": 1, "score": 8.940696716308594e-08, "flip_rate": 0.0, "weight": 5.960464477539063e-08, "tokens": 80},
    {"layer": 2, "score": 1.1920928955078125e-07, "flip_rate": 0.0, "weight": 1.1920928955078125e-07, "tokens": 80},
]
"""The router list ``calibrate`` writes for the tiny Mixtral, eager vs SDPA (the reader-only fuzz's template;
the CLI fuzz uses the one it calibrates)."""


# -- the format, as the oracle of the fuzz -------------------------------------------------------------
ODD = [
    "0.1",
    "3",
    "",
    True,
    False,
    None,
    [],
    {},
    [0.5],
    {"a": 1},
    -1,
    -1e-300,
    -0.0,
    0,
    5e-324,
    0.5,
    1,
    1.0,
    1.5,
    2,
    2.0,
    2.5,
    3,
    80,
    1e9,
    1e300,
    FLOAT_MAX,
    2**63 - 1,
    2**63,
    -(2**63),
    10**400,
    INF,
    -INF,
    NAN,
    "\ud800",
    "\x1b[31mred",
    "layer",
]
BOUND = {"score": FLOAT_MAX, "flip_rate": 1.0, "weight": 2.0}


def _value_ok(key: str, v: Any) -> bool:
    """Whether ``v`` is what ``router[i].<key>`` may hold: layer and tokens an int in [0, 2^63), the others a
    finite number (not a bool) in [0, bound] (10**400 is an int JSON allows, but no float)."""
    if key in ("layer", "tokens"):
        return type(v) is int and 0 <= v < 2**63
    return type(v) in (int, float) and 0 <= v <= BOUND[key]


def _first_twice(router: list[Any]) -> int | None:
    """The index of the first entry whose (valid) layer an earlier entry has."""
    seen: set[int] = set()
    for i, e in enumerate(router):
        layer = e.get("layer") if type(e) is dict else None
        if type(layer) is int:
            if layer in seen:
                return i
            seen.add(layer)
    return None


OPS = ["retype"] * 5 + [
    "entry",
    "whole",
    "drop-key",
    "add-key",
    "drop-entry",
    "duplicate",
    "phantom",
    "extreme",
    "long",
]


def mutate(router: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, set[int], str | None, str]:
    """One damage to a copy of ``router``: (the new value of ``router``, the exits allowed, the field an exit 2
    names, the operation)."""
    r: Any = copy.deepcopy(router)
    op = data.draw(st.sampled_from(OPS), label="op")
    i = data.draw(st.integers(0, len(r) - 1), label="entry")
    if op == "retype":
        key = data.draw(st.sampled_from(KEYS))
        r[i][key] = v = data.draw(st.sampled_from(ODD), label="value")
        if not _value_ok(key, v):
            return r, {2}, f"router[{i}].{key}", op
        j = _first_twice(r)
        return (r, {2}, f"router[{j}].layer", op) if j is not None else (r, {0, 1}, None, op)
    if op == "entry":
        r[i] = data.draw(st.sampled_from([v for v in ODD if type(v) is not dict]))
        return r, {2}, f"router[{i}]", op
    if op == "whole":
        r = data.draw(st.sampled_from([None, {}, "router", 0, True, {"layer": 0}, [], [[]]]))
        ok = r == [] and type(r) is list
        return r, {0, 1} if ok else {2}, None if ok else "router", op
    if op == "drop-key":
        del r[i][data.draw(st.sampled_from(KEYS))]
        return r, {2}, f"router[{i}]: missing keys", op
    if op == "add-key":
        r[i][data.draw(st.sampled_from(["zz", "Layer", "", "\x1b[2J", "\ud800", "tokens "]))] = 1
        return r, {2}, f"router[{i}]: unknown keys", op
    if op == "drop-entry":
        del r[i]
        return r, {0, 1}, None, op
    if op == "duplicate":  # an entry again, maybe with other values, anywhere: the later one is named
        entry = {**r[i], "score": data.draw(st.sampled_from([r[i]["score"], 0.0, 1e9]))}
        r.insert(data.draw(st.integers(0, len(r))), entry)
        return r, {2}, f"router[{_first_twice(r)}].layer", op
    if op == "phantom":  # layers the dumps do not have
        for layer in data.draw(
            st.lists(st.sampled_from([3, 7, 99, 2**31, 2**62, 2**63 - 1]), min_size=1, max_size=4, unique=True)
        ):
            r.insert(data.draw(st.integers(0, len(r))), {**r[i], "layer": layer})
        return r, {0, 1}, None, op
    if op == "extreme":  # possible values at their limits, on one entry or on all
        key = data.draw(st.sampled_from(KEYS[1:]))
        v = data.draw(
            st.sampled_from(
                {
                    "score": [0, 0.0, 5e-324, 1e-3, 1e9, 1e300, FLOAT_MAX],
                    "flip_rate": [0, 1e-300, 0.34, 1, 1.0],
                    "weight": [0, 0.5, 2, 2.0],
                    "tokens": [0, 1, 2**63 - 1],
                }[key]
            )
        )
        for e in r if data.draw(st.booleans(), label="all") else [r[i]]:
            e[key] = v
        return r, {0, 1}, None, op
    n = data.draw(st.sampled_from([100, 1000, 5000]), label="long")  # many phantom entries, maybe one twice
    r += [{**r[i], "layer": 3 + k} for k in range(n)]
    if data.draw(st.booleans(), label="twice"):
        r.append({**r[-1]})
        return r, {2}, f"router[{len(r) - 1}].layer", op
    return r, {0, 1}, None, op


def _one_line(msg: str) -> None:
    assert "\n" not in msg and not has_control(msg), repr(msg[:300])


# -- the reader alone: no dumps, the quick tier --------------------------------------------------------
@given(data=st.data())
@settings(FUZZ, max_examples=300)
def test_mutated_router_lists_in_the_reader(data: st.DataObject) -> None:
    """router_noise_from_json returns one RouterNoise per layer, each value as given, or raises one UsageError
    line naming the file and the field; never another exception."""
    r, expect, field, op = mutate(CALIBRATED, data)
    r = json.loads(json.dumps(r))  # as a noise file holds it (-0.0, NaN and 10**400 survive; tuples do not arise)
    try:
        noise = router_noise_from_json(r, "NOISE.json")
    except UsageError as e:
        msg = str(e)
        _one_line(msg)
        assert expect == {2} and msg.startswith(f"NOISE.json: {field}"), (op, msg[:300], field)
    else:
        assert expect != {2}, (op, field)
        assert sorted(noise) == sorted(e["layer"] for e in r) and all(type(n) is RouterNoise for n in noise.values())
        for e in r:
            n = noise[e["layer"]]
            assert (n.score, n.flip_rate, n.weight, n.tokens) == (
                float(e["score"]),
                float(e["flip_rate"]),
                float(e["weight"]),
                e["tokens"],
            )
            assert all(type(getattr(n, k)) is float for k in ("score", "flip_rate", "weight"))


@pytest.mark.parametrize("value", [NAN, INF, -INF, -1, -1e-300, 10**400, "0.1", True, None, [0.1]], ids=repr)
@pytest.mark.parametrize("key", KEYS)
def test_an_impossible_value_is_refused_by_the_reader_naming_the_field(key: str, value: Any) -> None:
    r = copy.deepcopy(CALIBRATED)
    r[1][key] = value
    with pytest.raises(UsageError) as e:
        router_noise_from_json(r, "NOISE.json")
    assert str(e.value).startswith(f"NOISE.json: router[1].{key}: expected "), e.value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("flip_rate", 1.0000001),
        ("weight", 2.0000001),
        ("layer", 2**63),
        ("tokens", 2**63),
        ("layer", 1.0),
        ("tokens", 80.0),
        ("score", 1e309),
    ],
    ids=repr,
)
def test_values_past_their_bounds_are_refused_by_the_reader(key: str, value: Any) -> None:
    r = copy.deepcopy(CALIBRATED)
    r[0][key] = value
    with pytest.raises(UsageError, match=rf"^NOISE\.json: router\[0\]\.{key}: expected "):
        router_noise_from_json(r, "NOISE.json")


# -- the comparator on real dumps ----------------------------------------------------------------------
class World:
    """Real Mixtral dumps (baseline, benign SDPA variant, seeded flip), their real noise file, a sentinel
    ``outside/``, and fresh files to damage."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base, self.sdpa = router_dump(root / "base"), router_dump(root / "sdpa", attn="sdpa")
        token, expert, bias = choose_flip_token(FLIPPED)
        self.flip = router_dump(root / "flip", bug="bias", layer=FLIPPED, token=token, expert=expert, bias=bias)
        self.noise = root / "NOISE.json"
        o = run_main(compare_main, ["calibrate", self.base, self.sdpa, "--out", self.noise, "--quiet"])
        assert o.code == 0, o.err
        self.json: dict[str, Any] = json.loads(self.noise.read_text())
        assert [e["layer"] for e in self.json["router"]] == [0, 1, 2], self.json.get("router")
        self.outside = root / "outside"  # valid copies: a reader that followed a path from the file would pass
        shutil.copytree(self.base, self.outside / "base")
        shutil.copy(self.noise, self.outside / "NOISE.json")
        self._n = itertools.count()

    def fresh(self, *, loose: bool = False) -> dict[str, Any]:
        """The real noise; ``loose``: loose enough to pass the seeded flip (tensor noise 1 everywhere, layer 1's
        score 1e9, layer 2's weight 2: all possible, each warned about but the weight)."""
        d = copy.deepcopy(self.json)
        if loose:
            for t in d["tensors"]:
                t.update(rel_diff=1.0, token_max=1.0, token_p999=1.0, token_p99=1.0, by_variant=[1.0])
            d["router"][FLIPPED]["score"] = 1e9
            d["router"][2]["weight"] = 2.0
        return d

    def write(self, content: dict[str, Any] | bytes) -> Path:
        path = self.root / "cases" / f"n{next(self._n)}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        return path

    def judge(self, noise: Path, target: Path | None = None) -> tuple[Outcome, dict[str, Any] | None]:
        """``comparator BASE TARGET --noise NOISE --quiet --json R``, checked (TARGET: the seeded flip by default)."""
        target = self.flip if target is None else target
        report = noise.with_suffix(".report.json")
        o = run_main(compare_main, [self.base, target, "--noise", noise, "--quiet", "--json", report])
        check_outcome(o, outside=self.outside)
        shown = [ln for ln in o.err.splitlines() if ln.startswith("warning: ")]
        data = json.loads(report.read_text()) if o.code in (0, 1) else None
        if data is not None:
            assert shown == [f"warning: {printable(w)}" for w in data["warnings"]], (shown, data["warnings"])
            assert set(data["router"]["warnings"]) <= set(data["warnings"]), data["router"]["warnings"]
        if target == self.flip:  # a real routing bug: never a silent pass
            if o.code == 0:
                assert any(ln.startswith(f"warning: {EXCUSED}") for ln in shown), o.err
            if data is not None and data["router"]["passed"]:
                assert any(w.startswith(EXCUSED) for w in data["router"]["warnings"]), data["router"]["warnings"]
        return o, data


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("fuzz-router-noise"))


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=150)
def test_mutated_router_noise_judged(world: World, data: st.DataObject) -> None:
    """Each damage judged on the seeded flip (mostly) or the benign variant, over the real noise or a loose one."""
    loose = data.draw(st.booleans(), label="loose")
    d = world.fresh(loose=loose)
    d["router"], expect, field, op = mutate(d["router"], data)
    target = data.draw(st.sampled_from([world.flip] * 3 + [world.sdpa]), label="target")
    path = world.write(d)
    o, _ = world.judge(path, target)
    assert o.code in expect, (op, o.code, expect, o.err[:500])
    if o.code == 2:
        assert str(path) in o.err and field is not None and f"{path}: {field}" in o.err, (op, field, o.err[:300])


# -- each class, explicitly ----------------------------------------------------------------------------
def _router_layers(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {la["layer"]: la for la in report["router"]["layers"]}


@pytest.mark.slow
def test_the_honest_calibration_fails_the_flip_without_a_warning(world: World) -> None:
    o, report = world.judge(world.noise)
    assert o.code == 1 and report is not None and report["warnings"] == [] and "warning" not in o.err, o.err
    router = report["router"]
    assert not router["passed"] and router["first_failing_flip"]["layer"] == FLIPPED, router["first_failing_flip"]
    o, report = world.judge(world.noise, world.sdpa)
    assert o.code == 0 and report is not None and report["warnings"] == [], o.err


@pytest.mark.slow
def test_score_1e9_on_every_layer_excuses_the_flip_only_with_a_warning_naming_the_layer(world: World) -> None:
    d = world.fresh()
    d["router"] = [{**e, "score": 1e9} for e in d["router"]]
    o, report = world.judge(world.write(d))
    assert o.code == 1 and report is not None, o.err  # the hidden states after the flip still fail
    layer = _router_layers(report)[FLIPPED]
    assert layer["passed"] and layer["flips"] == 1 and layer["failing_flips"] == 0, layer  # the flip is excused ...
    warned = report["router"]["warnings"]
    assert [w.split(":")[0] for w in warned] == ["layer 0", "layer 1", "layer 2"], warned  # ... never silently
    assert all("routing noise excuses flips with margins up to 3e+09" in w for w in warned), warned
    assert any(n.startswith("routing noise decided: 1 flips at layers 1") for n in report["router"]["notes"])
    o, report = world.judge(world.write(world.fresh(loose=True)))  # tensors and weights loose too: exit 0, warned
    assert o.code == 0 and report is not None and report["router"]["passed"], o.err
    assert f"warning: {EXCUSED}" in o.err and "calibrated tensors are over 10x" in o.err, o.err


@pytest.mark.slow
@pytest.mark.parametrize("target", ["flip", "sdpa"])
def test_flip_rate_1_lets_every_token_flip_and_says_so(world: World, target: str) -> None:
    d = world.fresh()
    for e in d["router"]:
        e["flip_rate"] = 1.0
    o, report = world.judge(world.write(d), getattr(world, target))
    assert report is not None and o.code == (1 if target == "flip" else 0), o.err  # the flip's margin still fails
    assert report["router"]["warnings"] == [
        f"layer {k}: routing noise lets every token flip (flip rate limit 3): a real routing bug there would pass"
        for k in (0, 1, 2)
    ], report["router"]["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("score", NAN, "expected a finite number >= 0, got NaN"),
        ("score", INF, "got Infinity"),
        ("score", 10**400, "expected a finite number >= 0"),
        ("flip_rate", 1.5, "expected a number in [0, 1]"),
        ("weight", 2.5, "expected a number in [0, 2]"),
        ("tokens", -1, "expected an integer >= 0"),
        ("layer", "1", "expected an integer >= 0"),
        ("score", "\x1b[31m0.1", "expected a finite number"),
    ],
    ids=repr,
)
def test_an_impossible_value_exits_2_naming_the_file_and_the_field(
    world: World, key: str, value: Any, needle: str
) -> None:
    d = world.fresh()
    d["router"][2][key] = value
    path = world.write(d)
    o, _ = world.judge(path)
    assert o.code == 2 and o.err.startswith(f"error: {path}: router[2].{key}: expected ") and needle in o.err, o.err


@pytest.mark.slow
def test_a_layer_listed_twice_and_layers_the_dumps_lack(world: World) -> None:
    d = world.fresh()
    d["router"].append({**d["router"][0], "score": 1e9})
    path = world.write(d)
    o, _ = world.judge(path)
    assert o.code == 2 and o.err == f"error: {path}: router[3].layer: expected each layer once, got 0\n", o.err
    d = world.fresh()
    d["router"] += [{**d["router"][0], "layer": k, "score": 1e9, "flip_rate": 1.0} for k in (3, 99, 2**63 - 1)]
    o, report = world.judge(world.write(d))  # judged by the layers the dumps have; the others decide nothing
    assert o.code == 1 and report is not None and report["router"]["warnings"] == [], o.err
    assert sorted(_router_layers(report)) == [0, 1, 2]


# -- a weight bug excused by loose noise: never silently -----------------------------------------------
@pytest.mark.slow
def test_weight_noise_that_excuses_a_real_weight_bug_is_warned_about(world: World, tmp_path: Path) -> None:
    order = router_dump(tmp_path / "order", bug="order", layer=2)  # layer 2's weights not renormalised, same ids
    o, report = world.judge(world.noise, order)
    assert o.code == 1 and report is not None and not _router_layers(report)[2]["passed"], o.err  # honest: fails
    d = world.fresh()
    d["router"][2]["weight"] = 0.5  # possible (the format allows up to 2), and 15000x the fixed 1e-4
    o, report = world.judge(world.write(d), order)
    assert report is not None
    assert o.code == 1 or any(w.startswith("layer 2:") for w in report["router"]["warnings"]), (
        f"exit {o.code}, warnings {report['warnings']}: the weight bug passed silently"
    )


# -- the largest hostile router lists, in real processes ---------------------------------------------------
def _entries(n: int, start: int = 10**6) -> str:
    """``n`` router entries of phantom layers ``start``...: 7 digits each, so the file's memory bound is linear in n."""
    return ",".join(
        f'{{"layer":{start + k},"score":1e-07,"flip_rate":0.0,"weight":1e-07,"tokens":80}}' for k in range(n)
    )


def _with_router(world: World, n: int, tail: str = "") -> bytes:
    d = world.fresh()
    head = json.dumps(d, separators=(",", ":"))
    assert head.endswith("]}") and '"router":[' in head  # router is the last key, so the list is at the end
    return (head[:-2] + "," + _entries(n) + tail + "]}").encode()


@pytest.mark.slow
def test_largest_hostile_router_lists_stay_under_512_mib(world: World, tmp_path: Path) -> None:
    """100k entries (phantom layers 10^6...), as many as the JSON memory budget lets through, and that many with the
    last one's layer twice (everything read, then refused): the comparator's peak RSS (VmHWM) in a child."""
    per = (json_memory_bound(_with_router(world, 2000)) - json_memory_bound(_with_router(world, 1000))) / 1000
    most = int((JSON_MEMORY_BUDGET - json_memory_bound(_with_router(world, 1000))) / per) + 999
    largest = _with_router(world, most)
    assert JSON_MEMORY_BUDGET - 4096 < json_memory_bound(largest) <= JSON_MEMORY_BUDGET
    last = f',{{"layer":{10**6 + most - 2},"score":0,"flip_rate":0,"weight":0,"tokens":0}}'
    files = {
        "100k entries": (_with_router(world, 100_000), 1, None),
        f"{most} entries (the JSON budget)": (largest, 1, None),
        f"{most} entries, the last layer twice": (
            _with_router(world, most - 1, last),
            2,
            f"router[{3 + most - 1}].layer: expected each layer once",
        ),
    }
    results = {}
    for label, (content, code, needle) in files.items():
        path = tmp_path / "hostile.json"
        path.write_bytes(content)
        start = time.perf_counter()
        rc, err, rss = run_child("comparator", world.base, world.flip, "--noise", path, "--quiet")
        wall = time.perf_counter() - start
        assert rc == code and (needle is None or needle in err), (label, rc, err[-500:])
        assert "Traceback" not in err and rss < LIMIT, (label, rss)
        results[f"{label} ({len(content) >> 20} MiB)"] = f"{rss >> 20} MiB, {wall:.1f} s"
        path.unlink()
    print("peak RSS of the comparator:", results)
