"""The run store keeps a baseline's measured noise, and ``regress`` judges by it (issue 11).

Real tiny-llama dumps: the baseline from ``python -m dumper run`` in a subprocess; two benign
variants to calibrate from (SDPA attention, 50-token chunks), a third benign layout held out
(SDPA with 32-token chunks) and a real change (layer 1's MLP down-projection scaled by 1 + 1e-3,
in float32, which the fixed 1e-3 thresholds pass), dumped meanwhile in this process through the
functions the CLI calls (:mod:`dumper.prefill.run`: each costs a fraction of a second there, against
seconds of imports in a subprocess). The CLIs run in subprocesses on local stores; a
``memory://`` store goes through the Python API."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from comparator import regress
from comparator.noise.file import load_noise
from comparator.store import RunRecord, RunStore, StoreError
from comparator.store.record import noise_bytes
from tests.conftest import run_cli, subprocess_env
from tests.storeutil import synth_dump

VARIANTS = {"sdpa": {"attn": "sdpa"}, "chunk": {"chunk_size": 50}}
HELD_OUT = {"attn": "sdpa", "chunk_size": 32}


def _dump(out: Path, *, perturb: bool = False, **settings: object) -> None:
    """``python -m dumper run --out OUT --layers all`` with ``settings``, through the function the CLI calls.

    ``perturb``: layer 1's MLP output weights scaled by 1 + 1e-3 (fp32), a change far below 1e-3.
    """
    from dumper.prefill.presets import load_model
    from dumper.prefill.run import RunConfig, dump_sequences, prompt_token_ids

    cfg = RunConfig(out=str(out), layers="all", **settings)  # type: ignore[arg-type]
    model, tok = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, seed=cfg.seed)
    if perturb:
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(1 + 1e-3)
    dump_sequences(model, prompt_token_ids(cfg, tok, model.get_input_embeddings().num_embeddings), cfg)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """The baseline from the real CLI (in a subprocess, meanwhile the others are dumped in this process)."""
    root = tmp_path_factory.mktemp("noise-dumps")
    env = subprocess_env(OMP_NUM_THREADS="1")
    cli = subprocess.Popen(
        [sys.executable, "-m", "dumper", "run", "--out", str(root / "base"), "--layers", "all", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI dump: the runs differ in their layout (or weights) only
    try:
        for name, settings in (*VARIANTS.items(), ("held_out", HELD_OUT)):
            _dump(root / name, **settings)
        _dump(root / "perturbed", perturb=True)
    finally:
        torch.set_num_threads(threads)
    _, err = cli.communicate(timeout=600)
    assert cli.returncode == 0, err
    out = {name: root / name for name in ("base", *VARIANTS, "held_out", "perturbed")}
    out["synth"] = synth_dump(root / "synth")  # another model: not a variant of the baseline
    return out


@pytest.fixture(scope="module")
def calibrated(dumps, tmp_path_factory) -> dict[str, object]:
    """``calibrate --out`` and a store bootstrapped with ``--calibrate`` from the same two variants."""
    root = tmp_path_factory.mktemp("calibrated")
    r = run_cli(
        "comparator", "calibrate", dumps["base"], dumps["sdpa"], dumps["chunk"], "--out", root / "n.json", "--quiet"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli(
        "comparator",
        "regress",
        dumps["base"],
        "--store",
        root / "store",
        "--bootstrap",
        "--calibrate",
        dumps["sdpa"],
        dumps["chunk"],
        "--json",
        root / "boot.json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return {
        "noise": root / "n.json",
        "store": root / "store",
        "boot": json.loads((root / "boot.json").read_text()),
        "stdout": r.stdout,
    }


def _copy(store: Path, to: Path) -> Path:
    shutil.copytree(store, to)
    return to


def _lines(text: str) -> str:
    return " ".join(text.split())  # rich wraps long messages at the console width


@pytest.mark.slow
def test_bootstrap_stores_exactly_the_noise_calibrate_writes(calibrated):
    store, boot = calibrated["store"], calibrated["boot"]
    run_id = boot["run_id"]
    stored = store / "runs" / run_id / "noise.json"
    written = json.loads(calibrated["noise"].read_text())  # what calibrate wrote, its side file named as the store's
    written["rows"]["file"] = "noise.rows.safetensors"
    assert json.loads(stored.read_bytes()) == written
    assert (stored.parent / "noise.rows.safetensors").read_bytes() == calibrated["noise"].with_name(
        "n.rows.safetensors"
    ).read_bytes()  # byte for byte
    assert sorted(os.listdir(stored.parent)) == ["COMPLETE", "dump", "noise.json", "noise.rows.safetensors", "run.json"]
    rec = RunStore(store).get(run_id)
    assert rec.label == "baseline" and rec.calibration.to_json() == boot["calibration"]
    assert rec.calibration.variants == 2 and rec.calibration.measured_on == run_id
    assert rec.calibration.sha256 == hashlib.sha256(stored.read_bytes()).hexdigest()
    got = RunStore(store).noise(rec)
    assert got is not None and got.noise == load_noise(calibrated["noise"])
    assert noise_bytes(got.noise) == stored.read_bytes()
    assert "calibrated from 2 variants" in _lines(calibrated["stdout"])
    r = run_cli("comparator", "store", "show", store, run_id)
    assert r.returncode == 0 and "calibration: noise of 8 tensors from 2 variants, measured on this run" in _lines(
        r.stdout
    ), r.stdout + r.stderr


@pytest.mark.slow
def test_later_runs_are_judged_against_the_stored_noise(calibrated, dumps, tmp_path):
    store = _copy(calibrated["store"], tmp_path / "store")
    base = calibrated["boot"]["run_id"]
    noise_at = RunStore(store).where(base, "noise.json")
    r = run_cli("comparator", "regress", dumps["held_out"], "--store", store, "--json", tmp_path / "held.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"judged against the noise of baseline {base} (2 variants)" in _lines(r.stdout)
    res = json.loads((tmp_path / "held.json").read_text())
    assert res["noise"] == noise_at and res["report"]["noise"] == noise_at and res["warnings"] == []
    ratios = [(t["noise_ratio"], t["token_noise_ratio"]) for t in res["report"]["tensors"]]
    assert len(ratios) == 16 and all(a is not None and b is not None and b < 10 for a, b in ratios)
    assert max(b for _, b in ratios) > 0  # the held-out layout does differ from the baseline, within noise
    assert res["calibration"]["measured_on"] == base  # it passed: the next baseline keeps the noise

    fixed = run_cli("comparator", dumps["base"], dumps["perturbed"], "--quiet")
    assert fixed.returncode == 0 and fixed.stdout.startswith("PASS"), fixed.stdout  # 1e-3 thresholds miss it
    r = run_cli("comparator", "regress", dumps["perturbed"], "--store", store, "--json", tmp_path / "bad.json")
    assert r.returncode == 1, r.stdout + r.stderr
    bad = json.loads((tmp_path / "bad.json").read_text())
    held = res["run_id"]
    assert f"judged against the noise of baseline {held} (2 variants, measured on run {base})" in _lines(r.stdout)
    fd = bad["report"]["first_divergent"]
    worst = max(bad["report"]["tensors"], key=lambda t: t["token_noise_ratio"])
    assert fd["layer"] == 2 and 1e-10 < worst["max_token_rel_diff"] < 1e-5 and worst["token_noise_ratio"] > 1e3
    assert bad["calibration"] is None and bad["label"] == "failed"  # a failed run never carries noise forward

    r = run_cli("comparator", "regress", dumps["perturbed"], "--store", store, "--noise-factor", "0.5")
    assert r.returncode == 2 and "--noise-factor must be" in r.stderr
    r = run_cli(
        "comparator",
        "regress",
        dumps["perturbed"],
        "--store",
        store,
        "--noise-floor",
        "1e-4",
        "--json",
        tmp_path / "floor.json",
    )
    assert r.returncode == 0, r.stdout + r.stderr  # a floor above the change: the flags reach the verdict
    assert json.loads((tmp_path / "floor.json").read_text())["report"]["noise_floor"] == 1e-4


@pytest.mark.slow
def test_uncalibrated_baseline_falls_back_then_promote_calibrates(dumps, tmp_path):
    store = tmp_path / "store"
    r = run_cli("comparator", "regress", dumps["base"], "--store", store, "--bootstrap")
    assert r.returncode == 0 and "not calibrated" in r.stdout, r.stdout + r.stderr
    base = RunStore(store).runs()[0].name
    r = run_cli("comparator", "regress", dumps["held_out"], "--store", store, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"warning: baseline {base} is not calibrated: judged by the fixed thresholds" in r.stderr
    assert "judged by the fixed thresholds" in _lines(r.stdout)
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["noise"] is None and res["report"]["noise"] is None and res["calibration"] is None
    assert any("is not calibrated" in w for w in res["warnings"])
    assert all(t["noise_ratio"] is None for t in res["report"]["tensors"])

    held = res["run_id"]
    record = store / "runs" / held / "run.json"
    before = record.read_bytes()
    r = run_cli("comparator", "store", "promote", store, held, "--calibrate", dumps["sdpa"], dumps["synth"])
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert record.read_bytes() == before and not (store / "runs" / held / "noise.json").exists()
    r = run_cli("comparator", "store", "promote", store, held, "--calibrate", dumps["sdpa"], dumps["chunk"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "baseline now (was passed); calibrated from 2 variants" in _lines(r.stdout)
    st = RunStore(store)
    rec = st.get(held)
    got = st.noise(rec)
    assert rec.label == "baseline" and rec.calibration.measured_on == held and got is not None
    assert got.noise.baseline == st.where(held, "dump") and len(got.noise.tensors) == 8
    r = run_cli("comparator", "regress", dumps["perturbed"], "--store", store, "--quiet")
    assert r.returncode == 1 and f"judged against the noise of baseline {held} (2 variants)" in _lines(r.stdout)


@pytest.mark.slow
def test_broken_stored_noise_is_one_line_and_changes_nothing(calibrated, dumps, tmp_path):
    store = _copy(calibrated["store"], tmp_path / "store")
    base = calibrated["boot"]["run_id"]
    noise = store / "runs" / base / "noise.json"
    for damage in ("edit", "remove"):
        if damage == "edit":
            noise.write_bytes(b'{"format": "driftscope-noise/1"}')
        else:
            noise.unlink()
        r = run_cli("comparator", "regress", dumps["held_out"], "--store", store)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        assert str(noise) in r.stderr and f"store promote {store} {base} --calibrate" in r.stderr
        assert ("does not match" if damage == "edit" else "missing") in r.stderr
        assert [e.name for e in RunStore(store).runs()] == [base]  # nothing stored
        r = run_cli("comparator", "store", "ls", store)
        assert r.returncode == 0 and "1 runs shown; 0 incomplete" in r.stdout, r.stdout + r.stderr
        r = run_cli("comparator", "store", "show", store, base)
        assert r.returncode == 0 and "calibration: UNUSABLE" in r.stdout and "warning: " in r.stderr
        assert "Traceback" not in r.stderr
    shutil.copy(calibrated["store"] / "runs" / base / "noise.json", noise)
    assert run_cli("comparator", "regress", dumps["held_out"], "--store", store, "--quiet").returncode == 0


MALFORMED = {
    "empty": b"",
    "cut": b"{",
    "deep": b"[" * 100_000,
    "no-variants": b'{"format": "driftscope-noise/1"}',
    "bad-tensor": b'{"format": "driftscope-noise/1", "variants": ["v"], "tensors": [{"name": 1}]}',
    "bad-model": b'{"format": "driftscope-noise/1", "variants": ["v"], "tensors": [], "model": [1, 2]}',
    "not-utf8": b"\xff\xfe",
}


@pytest.mark.slow
@pytest.mark.parametrize("payload", MALFORMED.values(), ids=list(MALFORMED))
def test_noise_json_vouched_for_but_malformed_is_refused(calibrated, tmp_path, payload):
    """Even a hand edit that updates run.json's sha256 too is parsed as untrusted input: one StoreError line."""
    store = _copy(calibrated["store"], tmp_path / "store")
    base = calibrated["boot"]["run_id"]
    (store / "runs" / base / "noise.json").write_bytes(payload)
    d = json.loads((store / "runs" / base / "run.json").read_text())
    d["calibration"]["sha256"] = hashlib.sha256(payload).hexdigest()
    (store / "runs" / base / "run.json").write_text(json.dumps(d))
    st = RunStore(store)
    with pytest.raises(StoreError) as e:
        st.noise(st.get(base))
    assert str(store / "runs" / base / "noise.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_noise_json_over_the_size_limit_is_not_read(calibrated, tmp_path, monkeypatch):
    store = _copy(calibrated["store"], tmp_path / "store")
    base = calibrated["boot"]["run_id"]
    monkeypatch.setattr("comparator.noise.file.MAX_NOISE_BYTES", 100)  # the bound StoredNoise.read takes
    st = RunStore(store)
    with pytest.raises(StoreError, match="over the 100 bytes"):
        st.noise(st.get(base))


@pytest.mark.slow
def test_writes_that_fail_leave_the_old_state(calibrated, dumps, tmp_path, monkeypatch):
    """A put that dies before run.json leaves no complete run; a promote that does leaves the old record in force."""
    st = RunStore(_copy(calibrated["store"], tmp_path / "store"))
    base = calibrated["boot"]["run_id"]
    noise = load_noise(calibrated["noise"])
    plain = st.put(dumps["held_out"], model="tiny-llama", label="passed")
    real = type(st.backend).write_bytes

    def dies_at_run_json(self, rel, data):
        if rel.endswith("/run.json"):
            raise OSError("disk full")
        real(self, rel, data)

    monkeypatch.setattr(type(st.backend), "write_bytes", dies_at_run_json)
    with pytest.raises(OSError):
        st.put(dumps["held_out"], model="tiny-llama", label="baseline", noise=noise)
    assert [e.name for e in st.runs()] == [base, plain.run_id]  # the half-written run was removed
    for run_id, new in ((plain.run_id, noise), (base, dataclasses.replace(noise, baseline="another dump"))):
        with pytest.raises(OSError):
            st.promote(run_id, new)  # noise.json is written, run.json is not
    monkeypatch.undo()
    rec = st.get(plain.run_id)
    assert rec.label == "passed" and rec.calibration is None and st.noise(rec) is None  # still uncalibrated
    assert (st.backend.root / "runs" / plain.run_id / "noise.json").is_file()  # ignored: the record is the authority
    rec = st.get(base)
    assert rec.calibration.to_json() == calibrated["boot"]["calibration"]
    with pytest.raises(StoreError, match="does not match the calibration"):  # detected, never used unvouched
        st.noise(rec)


@pytest.mark.slow
def test_memory_store_round_trip_through_the_python_api(calibrated, dumps):
    url = f"memory://driftscope-noise-{uuid.uuid4().hex[:8]}"
    try:
        boot = regress(dumps["base"], url, bootstrap=True, calibrate_from=[dumps["sdpa"], dumps["chunk"]])
        assert boot.label == "baseline" and boot.calibration.variants == 2
        st = RunStore(url)
        got = st.noise(st.get(boot.run_id))
        written = json.loads(calibrated["noise"].read_text())
        written["rows"]["file"] = "noise.rows.safetensors"
        assert (
            json.loads(got.data) == written
            and got.rows_data == calibrated["noise"].with_name("n.rows.safetensors").read_bytes()
        )
        res = regress(dumps["held_out"], url)
        assert res.exit_code == 0 and res.noise == st.where(boot.run_id, "noise.json")
        assert res.report is not None and all(t.noise_ratio is not None for t in res.report.tensors)
        assert st.get(res.run_id).calibration == boot.calibration  # inherited byte for byte
    finally:
        import fsspec

        fs = fsspec.filesystem("memory")
        root = url.removeprefix("memory://")
        if fs.exists(root):
            fs.rm(root, recursive=True)


@pytest.mark.slow
def test_run_records_with_and_without_calibration(calibrated):
    rec = RunStore(calibrated["store"]).get(calibrated["boot"]["run_id"])
    old = {k: v for k, v in rec.to_json().items() if k != "calibration"}  # as versions before calibration wrote
    parsed = RunRecord.from_json(old)
    assert parsed.calibration is None and "calibration" not in parsed.to_json()
    assert RunRecord.from_json(json.loads(rec.dumps())) == rec
    for bad in ({"variants": 0}, {"sha256": "ABC"}, {"measured_on": "../x"}, {"extra": 1}, {"variants": True}):
        with pytest.raises(ValueError, match="calibration"):
            RunRecord.from_json({**rec.to_json(), "calibration": {**rec.calibration.to_json(), **bad}})
