"""Noise and golden baselines from sketch dumps: a NOISE.json made from sketches judges sketch comparisons, says
so when it judges another kind, and ``regress`` keeps sketch runs in a lineage of their own (subprocess CLIs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comparator.noise.file import load_noise
from dumper.errors import UsageError
from dumper.format.sketch import SketchSpec
from tests.conftest import run_cli

K = 32
RUN = ("run", "--layers", "all", "--points", "input,residual", "--quiet")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """The built-in tiny model: eager and SDPA, full and sketched (K=32 seed 0), and sketched with seed 1."""
    root = tmp_path_factory.mktemp("sketch-noise")
    for name, args in {
        "full": (),
        "full-sdpa": ("--attn", "sdpa"),
        "sk": ("--sketch", str(K)),
        "sk-sdpa": ("--sketch", str(K), "--attn", "sdpa"),
        "sk-seed1": ("--sketch", str(K), "--sketch-seed", "1"),
    }.items():
        r = run_cli("dumper", *RUN, *args, "--out", root / name)
        assert r.returncode == 0, r.stderr
    for name, base, variant in (("sk", "sk", "sk-sdpa"), ("full", "full", "full-sdpa")):
        r = run_cli("comparator", "calibrate", root / base, root / variant, "--out", root / f"{name}.json", "--quiet")
        assert r.returncode == 0, r.stderr
    return root


def _judge(root: Path, base: str, target: str, noise: str) -> dict:
    r = run_cli(
        "comparator",
        root / base,
        root / target,
        "--noise",
        root / f"{noise}.json",
        "--json",
        root / f"{base}-{target}-{noise}.json",
        "--quiet",
    )
    assert r.returncode in (0, 1), r.stderr
    return json.loads((root / f"{base}-{target}-{noise}.json").read_text())


@pytest.mark.slow
def test_noise_from_sketches_records_its_projection(dumps):
    assert load_noise(dumps / "sk.json").sketch == SketchSpec(k=K)
    assert load_noise(dumps / "full.json").sketch is None
    assert "sketch" not in json.loads((dumps / "full.json").read_text())  # a full dump's noise file is unchanged


@pytest.mark.slow
def test_sketch_noise_judges_a_sketch_comparison_without_a_warning(dumps):
    report = _judge(dumps, "sk", "sk-sdpa", "sk")
    assert report["passed"] and report["sketch"]["baseline"] and report["sketch"]["target"]
    assert not [w for w in report["warnings"] if "calibrated on" in w]


@pytest.mark.slow
@pytest.mark.parametrize(
    "base, target, noise, says",
    [
        ("sk", "sk-sdpa", "full", "calibrated on full dumps but judging a sketch comparison"),
        ("full", "full-sdpa", "sk", "calibrated on sketch comparisons (rademacher K=32 seed=0) but judging full dumps"),
    ],
)
def test_noise_of_the_other_kind_is_named_in_a_warning(dumps, base, target, noise, says):
    report = _judge(dumps, base, target, noise)
    assert [w for w in report["warnings"] if says in w], report["warnings"]


@pytest.mark.slow
def test_regress_keeps_sketch_runs_in_their_own_lineage(dumps, tmp_path):
    store = tmp_path / "store"

    def regress(name: str, *args: str) -> tuple[int, str]:
        r = run_cli("comparator", "regress", "--store", store, dumps / name, *args)
        assert r.returncode in (0, 1), r.stderr
        return r.returncode, r.stdout

    assert regress("full", "--bootstrap")[1].startswith("BOOTSTRAP")
    rc, out = regress("sk", "--bootstrap")  # another capture signature: no full run is its baseline
    assert rc == 0 and out.startswith("BOOTSTRAP"), out
    rc, out = regress("sk-sdpa")
    assert rc == 0 and "PASS: stored run" in out and "both sides sketched" in out, out
    rc, out = regress("sk-seed1", "--bootstrap")  # another projection: compared with nothing stored
    assert rc == 0 and out.startswith("BOOTSTRAP"), out


@pytest.mark.parametrize(
    ("sketch", "field"),
    [
        ({"kind": "rademacher", "k": 0, "seed": 0}, "sketch.k"),
        ({"kind": "gauss", "k": 8, "seed": 0}, "sketch.kind"),
        ([8], "sketch:"),
    ],
)
def test_a_bad_sketch_section_of_a_noise_file_names_that_field(dumps, tmp_path, sketch, field):
    """A noise file has no capture_signature: its own field is named, in one line."""
    d = json.loads((dumps / "sk.json").read_text())
    d["sketch"] = sketch
    path = tmp_path / "NOISE.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UsageError) as e:
        load_noise(path)
    assert f"{path}: {field}" in str(e.value) and "capture_signature" not in str(e.value), e.value
