"""SGLang dumps: ``.pt`` files written by the real sglang 0.5.23 dumper convert and compare.

The fixtures in ``tests/fixtures/sglang`` were written by ``make_fixtures.py`` beside them (SGLang's
dumper over the tiny-llama preset, run as SGLang runs it: flattened batches, chunked prefill and
a decode token). Variants the tests need beyond them are made from those files by re-saving
them with the dumper's layout (``{"value": ..., "meta": ...}``, tags in the file name).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from comparator import CompareConfig, compare_dumps
from comparator.judging.identity import IDENTITY_FIELDS
from dumper.engines.sglang import convert_sglang_dump, open_dump_side
from dumper.engines.sglang_files import is_sglang_dump
from dumper.errors import CorruptDumpError, DumpError, ModelMismatchError, UsageError
from dumper.format import load_manifest
from tests.conftest import ROOT, run_cli

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "sglang"
INFO = json.loads((FIX / "fixture.json").read_text())
ATTN = [f"model.layers.{i}.self_attn.input" for i in INFO["layers"]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("sglang")
    for variant in ("clean", "bug"):
        convert_sglang_dump(FIX / variant, out / variant)
    return {"clean": out / "clean", "bug": out / "bug"}


def _compare(baseline: Path, target: Path) -> Any:
    return compare_dumps(baseline, target, CompareConfig.resolve(env={}))


def _copy(tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of the clean SGLang dump without the files of the names in ``drop``."""
    d = tmp_path / "sglang"
    d.mkdir()
    for f in (FIX / "clean").iterdir():
        if not any(f"___name={n}___" in f.name for n in drop):
            shutil.copy(f, d / f.name)
    return d


def _resave(src: Path, dst_dir: Path, **tags: Any) -> Path:
    """Re-save an SGLang file with some tags changed, in its name and in its meta, as the dumper would."""
    obj = torch.load(src, weights_only=True)
    obj["meta"].update(tags)
    parts = dict(p.split("=", 1) for p in src.name[:-3].split("___"))
    parts.update({k: str(v) for k, v in tags.items()})
    out = dst_dir / ("___".join(f"{k}={v}" for k, v in parts.items()) + ".pt")
    torch.save(obj, out)
    return out


def _hidden_files(d: Path) -> list[Path]:
    return sorted(f for f in d.iterdir() if "self_attn.inputs.hidden_states" in f.name)


def test_detects_sglang_dumps(tmp_path: Path) -> None:
    assert is_sglang_dump(FIX / "clean") and not is_sglang_dump(FIX / "hf") and not is_sglang_dump(tmp_path)
    assert is_sglang_dump(FIX)  # DUMPER_DIR itself: runs one level down
    with pytest.raises(DumpError, match="pass one of: bug, clean"):
        convert_sglang_dump(FIX, tmp_path / "out")


def test_conversion_keeps_the_batch_layout(converted: dict[str, Path]) -> None:
    m = load_manifest(converted["clean"])
    assert m.extra["input_ids"] == INFO["input_ids"] == load_manifest(FIX / "hf").extra["input_ids"]
    assert sorted({r.name for r in m.tensors}) == ATTN and {r.point for r in m.tensors} == {"input"}
    assert m.capture_signature["layers"] == INFO["layers"] and m.environment["engine"] == "sglang"
    for rec in m.tensors:  # each step's flattened batch: (sequence, first position, count) per request
        batch = INFO["schedule"][rec.forward_pass]
        assert rec.positions == [[p, n] for _, p, n in batch] and rec.sequence_ids == [[s, n] for s, _, n in batch]
        assert rec.layer == int(rec.name.split(".")[2]) and rec.shape == (sum(n for *_, n in batch), 64)


def test_clean_sglang_dump_passes_against_hf(converted: dict[str, Path]) -> None:
    report = _compare(FIX / "hf", converted["clean"])
    assert report.passed and report.matched == len(ATTN) * len(INFO["input_ids"])
    assert max(t.rel_diff for t in report.tensors) < 1e-9
    assert "target computed by sglang" in report.notes


def test_seeded_bug_is_localized(converted: dict[str, Path]) -> None:
    want = INFO["first_divergence"]
    for base, target in ((FIX / "hf", converted["bug"]), (converted["bug"], FIX / "hf")):  # either side
        fd = _compare(base, target).first_divergent
        assert fd is not None and (fd.layer, fd.sequence, fd.token) == (want["layer"], want["sequence"], want["token"])
        assert fd.failing_ranges == [[want["token"], want["token"]]] and fd.failing_sequences == [want["sequence"]]
    clean_vs_bug = _compare(converted["clean"], converted["bug"])  # SGLang against SGLang
    assert clean_vs_bug.first_divergent is not None and clean_vs_bug.first_divergent.layer == want["layer"]
    assert all(t.passed for t in clean_vs_bug.tensors if t.layer < want["layer"])


@pytest.mark.slow
def test_cli_converts_and_compares(tmp_path: Path) -> None:
    out = tmp_path / "converted"
    r = run_cli("dumper.engines.sglang", FIX / "bug", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        f"{out}: 6 tensors from 16 SGLang files (2 steps, 1 ranks, self_attn inputs of layers 0..2)"
    )
    r = run_cli("comparator", FIX / "hf", out, "--quiet")
    assert r.returncode == 1 and r.stdout.startswith("DIVERGED at layer 2"), r.stdout + r.stderr
    again = run_cli("dumper.engines.sglang", FIX / "clean", "--out", out)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_checkpoint_gives_the_model_identity(tmp_path: Path) -> None:
    config = json.loads((ROOT / "configs" / "tiny-llama.json").read_text())  # the preset's HF config
    for name, change in (("ckpt", {}), ("other", {"num_hidden_layers": 4}), ("narrow", {"hidden_size": 32})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UsageError, match="hidden_size 32, but the dumped self_attn inputs are 64 wide"):
        convert_sglang_dump(FIX / "clean", tmp_path / "narrow-dump", checkpoint=str(tmp_path / "narrow"))
    m = convert_sglang_dump(FIX / "clean", tmp_path / "same", checkpoint=str(tmp_path / "ckpt"))
    hf = load_manifest(FIX / "hf").model
    assert {k: m.model[k] for k in IDENTITY_FIELDS} == {k: hf[k] for k in IDENTITY_FIELDS}
    assert _compare(FIX / "hf", tmp_path / "same").passed
    convert_sglang_dump(FIX / "clean", tmp_path / "other-dump", checkpoint=str(tmp_path / "other"))
    with pytest.raises(ModelMismatchError, match="num_layers 8 .baseline. vs 4 .target."):
        _compare(FIX / "hf", tmp_path / "other-dump")


@pytest.mark.parametrize("drop", [("rids",), ("rids", "req_pool_indices"), ("rids", "req_pool_indices", "seq_lens")])
def test_requests_followed_without_ids(tmp_path: Path, converted: dict[str, Path], drop: tuple[str, ...]) -> None:
    m = convert_sglang_dump(_copy(tmp_path, drop), tmp_path / "out")
    full = load_manifest(converted["clean"])
    assert [(r.positions, r.sequence_ids) for r in m.tensors] == [(r.positions, r.sequence_ids) for r in full.tensors]
    assert _compare(FIX / "hf", tmp_path / "out").passed


def test_without_positions_rows_fall_back(tmp_path: Path) -> None:
    m = convert_sglang_dump(_copy(tmp_path, ("positions",)), tmp_path / "out")
    assert all(r.positions is None and r.sequence_ids is None for r in m.tensors)
    assert "input_ids" not in m.extra


def test_tensor_parallel_replicas(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    for f in list(d.iterdir()):
        _resave(f, d, rank=1)
    m = convert_sglang_dump(d, tmp_path / "tp")
    assert m.capture_signature["world_size"] == 2 and {r.rank for r in m.tensors} == {0, 1}
    assert _compare(FIX / "hf", tmp_path / "tp").passed
    bad = next(f for f in d.iterdir() if "rank=1" in f.name and "layers.1.self_attn" in f.name)
    obj = torch.load(bad, weights_only=True)
    obj["value"] = obj["value"] * 1.01
    torch.save(obj, bad)
    convert_sglang_dump(d, tmp_path / "tp-bad")
    report = _compare(FIX / "hf", tmp_path / "tp-bad")
    assert not report.passed and report.replica_mismatches


def test_per_layer_copies_and_name_map(tmp_path: Path, converted: dict[str, Path]) -> None:
    d = _copy(tmp_path, ("rids", "req_pool_indices"))  # requests followed by their positions alone
    positions = next(f for f in d.iterdir() if "step=0" in f.name and "name=positions" in f.name)
    for layer in INFO["layers"]:  # SGLang's attention modules receive positions= too: copies per layer
        _resave(positions, d, dump_index=900 + layer, layer_id=layer)
    _resave(positions, d, dump_index=4)  # a nested module's copy of the root field: the same batch
    for f in _hidden_files(d):
        _resave(f, d, name="attn_in")
        f.unlink()
    kept = convert_sglang_dump(d, tmp_path / "kept")
    assert {r.name for r in kept.tensors} == {"attn_in"} and kept.extra["sglang"]["per_layer_aux_skipped"] == 3
    full = load_manifest(converted["clean"]).tensors
    assert [(r.positions, r.sequence_ids) for r in kept.tensors] == [(r.positions, r.sequence_ids) for r in full]
    assert kept.extra["input_ids"] == INFO["input_ids"]  # the copy did not start another forward
    mapped = convert_sglang_dump(d, tmp_path / "mapped", names={"attn_in": "model.layers.{layer}.self_attn.input"})
    assert sorted({r.name for r in mapped.tensors}) == ATTN and _compare(FIX / "hf", tmp_path / "mapped").passed


class _Payload:
    """Pickles as a call of ``os.mkdir(path)``: what a hostile ``.pt`` file runs when it is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


@pytest.mark.parametrize(
    "container, why",
    [("torch.save", "unsupported GLOBAL posix.mkdir"), ("raw pickle", "(a plain pickle or legacy torch.save file)")],
)
def test_malicious_pickle_is_refused_unrun(tmp_path: Path, container: str, why: str) -> None:
    def write(path: Path, marker: Path) -> None:
        if container == "torch.save":
            torch.save({"value": _Payload(marker), "meta": {}}, path)
        else:
            path.write_bytes(pickle.dumps({"value": _Payload(marker)}))

    live, live_marker = tmp_path / "live.pt", tmp_path / "proof"
    write(live, live_marker)  # the payload is live: plain unpickling runs it
    torch.load(live, weights_only=False) if container == "torch.save" else pickle.loads(live.read_bytes())
    assert live_marker.is_dir()
    d, marker = _copy(tmp_path), tmp_path / "pwned"
    evil = d / "step=0___rank=0___dump_index=7___name=evil___recompute_status=disabled.pt"
    write(evil, marker)
    r = run_cli("dumper.engines.sglang", d, "--out", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert str(evil) in r.stderr and "weights_only=True" in r.stderr and why in r.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no half-written dump left


def _truncate(d: Path) -> Path:
    f = _hidden_files(d)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f


def _non_tensor(d: Path) -> Path:
    f = _hidden_files(d)[0]
    torch.save({"value": {"x": 3}, "meta": {}}, f)
    return f


def _renamed(d: Path) -> Path:
    f = _hidden_files(d)[0]
    return f.rename(d / f.name.replace("step=0", "step=1"))


def _bad_name(d: Path) -> Path:
    f = d / "hidden.pt"
    shutil.copy(_hidden_files(d)[0], f)
    return f


def _rezip(f: Path, *, data0: Any = None, method: int = zipfile.ZIP_STORED) -> Path:
    """Rewrite ``f`` with Python's zipfile (fresh CRCs and sizes), its ``data/0`` record replaced or compressed."""
    z = zipfile.ZipFile(f)
    items = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(f, "w") as out:
        for name, b in items:
            last = name.endswith("/data/0")
            out.writestr(name, data0(b) if last and data0 else b, compress_type=method if last else zipfile.ZIP_STORED)
    return f


def _deflated(d: Path) -> Path:
    return _rezip(_hidden_files(d)[0], method=zipfile.ZIP_DEFLATED)


def _short_record(d: Path) -> Path:
    return _rezip(_hidden_files(d)[0], data0=lambda b: b[: len(b) // 2])


def _seq_lens_lie(d: Path) -> Path:
    f = next(f for f in d.iterdir() if "step=0" in f.name and "name=seq_lens" in f.name)
    obj = torch.load(f, weights_only=True)
    obj["value"] = obj["value"] + 1
    torch.save(obj, f)
    return f.parent


@pytest.mark.parametrize(
    "damage, why",
    [
        (_truncate, "not a file torch.load(weights_only=True) accepts (truncated, or not a torch.save zip archive)"),
        (_non_tensor, 'holds int at "x", not a tensor or a dict of tensors'),
        (_renamed, "its name says step=1 but its meta says 0"),
        (_bad_name, "not an SGLang dumper file name"),
        (_seq_lens_lie, "step 0 rank 0: positions and seq_lens disagree at request 0"),
        (_deflated, "zip record data/0: compressed (method 8); torch.save writes plain stored records"),
        (_short_record, 'storage "0" needs 4608 bytes but its record holds 2304; refusing to map it'),
    ],
)
def test_damaged_files_are_refused_in_one_line(tmp_path: Path, damage: Any, why: str) -> None:
    d = _copy(tmp_path)
    where = damage(d)
    with pytest.raises(CorruptDumpError) as err:
        convert_sglang_dump(d, tmp_path / "out")
    assert str(where) in str(err.value) and why in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def _zip64(f: Path) -> None:
    with mock.patch.object(zipfile, "ZIP64_LIMIT", -1), mock.patch.object(zipfile, "ZIP_FILECOUNT_LIMIT", 0):
        _rezip(f)  # every size and offset in zip64 extra fields, and a zip64 end record


def _no_crc(f: Path) -> None:
    obj = torch.load(f, weights_only=True)
    with mock.patch.object(torch.utils.serialization.config.save, "compute_crc32", False):
        torch.save(obj, f)
    assert {i.CRC for i in zipfile.ZipFile(f).infolist()} == {0}


@pytest.mark.parametrize("layout", [_rezip, _zip64, _no_crc], ids=["python-zipfile", "zip64", "no-crc32"])
def test_other_layouts_torch_reads_are_read(tmp_path: Path, layout: Any) -> None:
    """The archive checks refuse misframed records, not other writers' layouts of the same bytes."""
    d = _copy(tmp_path)
    for f in d.iterdir():
        layout(f)
    convert_sglang_dump(d, tmp_path / "out")
    assert _compare(FIX / "hf", tmp_path / "out").passed


def test_open_dump_side(converted: dict[str, Path]) -> None:
    with open_dump_side(converted["clean"]) as same:
        assert same == converted["clean"]
    with open_dump_side(FIX / "bug") as tmp:
        assert load_manifest(tmp).environment["engine"] == "sglang" and not _compare(FIX / "hf", tmp).passed
    assert not tmp.exists()
