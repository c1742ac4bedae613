"""The verdict says how each side ran and whether its capture was proven harmless.

Real dumps: ``python -m dumper run --layers all --logprobs`` on the tiny-llama preset, eager and
``--compile`` (built once per module), judged by ``python -m comparator A B --json R`` subprocesses.
The observer check's record (``extra.observer``) and hostile values are written into copies of the
real dumps with :mod:`dumper.format`'s own manifest reader and writer.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dumper.errors import EXIT_OK
from dumper.format import MANIFEST_NAME, load_manifest, write_manifest
from tests.conftest import run_cli

MODE = "baseline ran eager, target compiled (torch.compile); differences may come from compilation"
UNCHECKED = (
    "{side} ran compiled and its capture was never checked against a probe-free run (dumper run --observer-check)"
)
CHANGED = (
    "{side}: capture changed its own numbers (observer check{where}); its hidden states may not be what "
    "the engine computes without the probe"
)
UNREADABLE = "{side}: unreadable observer check ({field} is {value}); its capture is not proven harmless"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """An eager and a ``--compile`` dump of the same job, each with every layer and logprobs."""
    root = tmp_path_factory.mktemp("runmode")
    for name, flags in (("eager", ()), ("compiled", ("--compile",))):
        r = run_cli("dumper", "run", "--layers", "all", "--logprobs", "--out", root / name, "--quiet", *flags)
        assert r.returncode == 0, r.stderr
    return {"eager": root / "eager", "compiled": root / "compiled", "root": root}


def _variant(dumps: dict[str, Path], of: str, name: str, **extra: Any) -> Path:
    """A copy of the real dump ``of`` whose manifest ``extra`` is updated with ``extra`` (None: key removed)."""
    out = dumps["root"] / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(dumps[of], out)
    m = load_manifest(out)
    new = {k: v for k, v in {**m.extra, **extra}.items() if v is not None}
    write_manifest(out, dataclasses.replace(m, extra=new))
    return out


def _compare(base: Path, target: Path, tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """``python -m comparator base target --json R``: the JSON report and stdout; it must pass (exit 0)."""
    report = tmp_path / f"{target.name}.json"
    r = run_cli("comparator", base, target, "--json", report, *flags)
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    data = json.loads(report.read_text())
    assert data["passed"] is True
    return data, r.stdout


@pytest.mark.slow
def test_manifests_record_the_mode(dumps):
    assert load_manifest(dumps["eager"]).extra["compiled"] is False
    assert load_manifest(dumps["compiled"]).extra["compiled"] is True


@pytest.mark.slow
def test_eager_against_compiled_says_so_and_still_passes(dumps, tmp_path):
    """The mode note and the unchecked-capture note, in the JSON report, the table summary and --quiet."""
    data, out = _compare(dumps["eager"], dumps["compiled"], tmp_path)
    assert data["notes"] == [MODE, UNCHECKED.format(side="target")]
    flat = " ".join(out.split())  # the table's summary wraps at the console width
    assert MODE in flat and UNCHECKED.format(side="target") in flat
    _, quiet = _compare(dumps["eager"], dumps["compiled"], tmp_path, "--quiet")
    assert quiet.strip() == f"PASS ({MODE}; {UNCHECKED.format(side='target')})"


@pytest.mark.slow
def test_the_compiled_side_is_named(dumps, tmp_path):
    data, _ = _compare(dumps["compiled"], dumps["eager"], tmp_path)
    assert data["notes"] == [
        "baseline ran compiled (torch.compile), target eager; differences may come from compilation",
        UNCHECKED.format(side="baseline"),
    ]


@pytest.mark.slow
def test_same_mode_has_no_mode_note(dumps, tmp_path):
    """Eager against eager: no note at all; compiled against compiled: only each side's unchecked capture."""
    data, _ = _compare(dumps["eager"], _variant(dumps, "eager", "eager-copy"), tmp_path)
    assert data["notes"] == []
    data, _ = _compare(dumps["compiled"], _variant(dumps, "compiled", "compiled-copy"), tmp_path)
    assert data["notes"] == [UNCHECKED.format(side="baseline"), UNCHECKED.format(side="target")]


@pytest.mark.slow
def test_older_dumps_without_a_mode_get_no_note(dumps, tmp_path):
    """A dump from before the mode was recorded: unknown, so neither a mode nor an unchecked note."""
    data, _ = _compare(
        _variant(dumps, "eager", "old-eager", compiled=None),
        _variant(dumps, "compiled", "old-compiled", compiled=None),
        tmp_path,
    )
    assert data["notes"] == []


def _observer(bit_exact: Any, **kw: Any) -> dict[str, Any]:
    return {
        "checked": True,
        "bit_exact": bit_exact,
        "compared": "logprobs",
        "values": 289,
        "max_abs_diff": 0.0,
        "sequence": None,
        "position": None,
        **kw,
    }


@pytest.mark.slow
def test_a_capture_that_changed_the_numbers_is_noted(dumps, tmp_path):
    target = _variant(
        dumps, "compiled", "changed", observer=_observer(False, max_abs_diff=2.5e-07, sequence=1, position=37)
    )
    data, out = _compare(dumps["eager"], target, tmp_path, "--quiet")
    note = CHANGED.format(side="target", where=": largest |Δ| 2.5e-07 at sequence 1, position 37")
    assert data["notes"] == [MODE, note]  # checked, so no "never checked" note
    assert note in out
    base = _variant(dumps, "eager", "changed-eager", observer=_observer(False, max_abs_diff=3, sequence=0, position=0))
    data, _ = _compare(base, dumps["eager"], tmp_path)  # an eager side's failed check is said too
    assert data["notes"] == [CHANGED.format(side="baseline", where=": largest |Δ| 3 at sequence 0, position 0")]


@pytest.mark.slow
def test_a_bit_exact_capture_adds_no_note(dumps, tmp_path):
    data, _ = _compare(dumps["eager"], _variant(dumps, "compiled", "exact", observer=_observer(True)), tmp_path)
    assert data["notes"] == [MODE]
    unchecked = _variant(dumps, "compiled", "not-checked", observer={"checked": False})
    data, _ = _compare(dumps["eager"], unchecked, tmp_path)
    assert data["notes"] == [MODE, UNCHECKED.format(side="target")]


@pytest.mark.slow
def test_the_vllm_contract_fields_are_read(dumps, tmp_path):
    """A vLLM dump records its mode in ``extra.engine.settings`` (written here into a real dump)."""
    engine = {"name": "vllm", "version": "0", "checkpoint": "ckpt", "settings": {"compiled": True, "cuda_graphs": True}}
    data, _ = _compare(dumps["eager"], _variant(dumps, "eager", "vllm-graphs", engine=engine), tmp_path)
    assert data["notes"] == [
        "baseline ran eager, target compiled (vLLM, CUDA graphs); differences may come from "
        "compilation and CUDA graphs",
        UNCHECKED.format(side="target"),
    ]
    eager_graphs = {**engine, "settings": {"compiled": False, "cuda_graphs": True}}
    data, _ = _compare(dumps["eager"], _variant(dumps, "eager", "vllm-eager", engine=eager_graphs), tmp_path)
    assert data["notes"] == [
        "baseline ran eager, target eager (vLLM, CUDA graphs); differences may come from CUDA graphs"
    ]


HOSTILE = {  # name -> (extra written into the compiled dump, the notes expected after the mode note)
    "observer-list": (
        {"observer": [1, 2]},
        [UNREADABLE.format(side="target", field="extra.observer", value="a JSON list")],
    ),
    "bit-exact-no": (
        {"observer": _observer("no")},
        [UNREADABLE.format(side="target", field="extra.observer.bit_exact", value='"no"')],
    ),
    "nan-as-text": (
        {"observer": _observer(False, max_abs_diff="nan", sequence="\x1b[31m0", position=[0])},
        [CHANGED.format(side="target", where=': largest |Δ| "nan" at sequence "\\u001b[31m0", position a JSON list')],
    ),
    "nothing-said": ({"observer": {"bit_exact": False}}, [CHANGED.format(side="target", where="")]),
    "huge-int": (
        {"observer": _observer(False, max_abs_diff=10**30)},
        [CHANGED.format(side="target", where=": largest |Δ| a huge integer")],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_observer_records_do_not_crash(dumps, tmp_path, name):
    extra, notes = HOSTILE[name]
    data, out = _compare(dumps["eager"], _variant(dumps, "compiled", name, **extra), tmp_path, "--quiet")
    assert data["notes"] == [MODE, *notes]
    assert "\x1b" not in out and len(out.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_nan_difference_prints_as_nan(dumps, tmp_path):
    """JSON readers accept ``NaN``; the manifest's own writer never writes it, so it is put in as text."""
    target = _variant(dumps, "compiled", "nan", observer=_observer(False, max_abs_diff="__nan__", sequence=0))
    path = target / MANIFEST_NAME
    path.write_text(path.read_text().replace('"__nan__"', "NaN"))
    data, _ = _compare(dumps["eager"], target, tmp_path)
    assert data["notes"] == [MODE, CHANGED.format(side="target", where=": largest |Δ| nan at sequence 0")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"compiled": "yes"},
        {"engine": {"settings": "compiled"}},
        {"engine": {"name": 7, "settings": {"compiled": 1, "cuda_graphs": "no"}}},
    ],
    ids=["compiled-text", "settings-text", "settings-ints"],
)
def test_a_mode_of_the_wrong_type_is_unknown(dumps, tmp_path, extra):
    data, _ = _compare(dumps["eager"], _variant(dumps, "compiled", "bad-mode", **extra), tmp_path)
    assert data["notes"] == []
