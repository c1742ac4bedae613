"""The run store and regress from Python: selection rules, laundering, promote/prune, faults, fsspec URLs."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dumper
from comparator import CompareConfig, regress
from comparator.store import EnvMismatchError, NoBaselineError, RunStatus, RunStore, StoreError, select_baseline
from comparator.store.environment import env_differences
from comparator.store.record import RunRecord
from comparator.store.runid import new_run_id, run_id_time
from dumper.errors import EXIT_DIVERGED, EXIT_OK, EXIT_UNUSABLE, UsageError
from dumper.format import load_manifest
from dumper.prefill.run import RunConfig, run_dump
from tests.storeutil import OTHER_GPU, edited_copy, synth_dump

PROMPTS = ("Inference engines change daily; each change can shift numerics.",)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Real tiny-llama dumps: two good runs (seed 0) and two runs with perturbed weights (seed 1)."""
    root = tmp_path_factory.mktemp("real")
    out = {}
    for name, seed in (("good", 0), ("good2", 0), ("buggy", 1), ("buggy2", 1)):
        run_dump(RunConfig(out=str(root / name), prompts=PROMPTS, layers="all", seed=seed))
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    return {"a": synth_dump(root / "a"), "a2": synth_dump(root / "a2"), "bad": synth_dump(root / "bad", bump=(1, 5))}


def labels(store: RunStore) -> list[str]:
    return [e.record.label for e in store.runs() if e.record is not None]


def test_a_failed_run_never_launders_a_regression(real, tmp_path):
    """The seed's scenario: baseline A; buggy B fails; unchanged buggy C is compared against A, not B, and fails."""
    store = RunStore(tmp_path / "store")
    a = regress(real["good"], store, bootstrap=True)
    assert a.exit_code == EXIT_OK and a.label == "baseline" and a.report is None and "BOOTSTRAP" in a.message
    b = regress(real["buggy"], store)
    assert b.exit_code == EXIT_DIVERGED and b.label == "failed" and b.baseline_run == a.run_id
    assert b.report is not None and b.report.first_divergent.layer == 0
    # the failed run is stored whole as evidence: its dump loads and its report is kept
    run_b = tmp_path / "store" / "runs" / b.run_id
    assert load_manifest(run_b / "dump").files == load_manifest(real["buggy"]).files
    assert json.loads((run_b / "report.json").read_text())["passed"] is False
    assert store.get(b.run_id).summary.first_divergent["layer"] == 0
    c = regress(real["buggy2"], store)
    assert c.exit_code == EXIT_DIVERGED and c.baseline_run == a.run_id, "a failed run became the baseline"
    assert labels(store) == ["baseline", "failed", "failed"]
    d = regress(real["good2"], store)
    assert d.exit_code == EXIT_OK and d.label == "passed" and d.baseline_run == a.run_id
    assert d.report.matched == 8 and "PASS" in d.message
    m = load_manifest(real["good2"])
    assert select_baseline(store, "tiny-llama", m.capture_signature, m.environment).run_id == d.run_id


def test_selection_skips_failed_other_signatures_and_models_and_picks_the_latest(synth, tmp_path):
    store = RunStore(tmp_path / "store")
    m = load_manifest(synth["a"])
    other_sig = edited_copy(synth["a"], tmp_path / "sig", capture_signature={"dtype": "bfloat16"})
    old = store.put(synth["a"], model="synth", label="baseline")
    newest_good = store.put(synth["a2"], model="synth", label="passed", baseline_run=old.run_id)
    store.put(synth["bad"], model="synth", label="failed", baseline_run=old.run_id)
    store.put(other_sig, model="synth", label="passed")
    store.put(synth["a"], model="another-model", label="baseline")
    picked = select_baseline(store, "synth", m.capture_signature, m.environment)
    assert picked.run_id == newest_good.run_id
    assert select_baseline(store, "synth", {**m.capture_signature, "world_size": 2}, m.environment) is None
    assert select_baseline(store, "nobody", m.capture_signature, m.environment) is None
    # a promoted baseline is a baseline like any other; the latest non-failed run still wins
    promoted = store.promote(old.run_id)  # already a baseline: unchanged
    assert promoted == old
    assert select_baseline(store, "synth", m.capture_signature, m.environment).run_id == newest_good.run_id


def test_environment_mismatch_is_refused_naming_the_fields(synth, tmp_path):
    store = RunStore(tmp_path / "store")
    m = load_manifest(synth["a"])
    regress(synth["a"], store, bootstrap=True)
    gpu = edited_copy(synth["a"], tmp_path / "gpu", environment=OTHER_GPU)
    with pytest.raises(EnvMismatchError) as err:
        regress(gpu, store)
    msg = str(err.value)
    for field in ("torch", "cuda", "device_type", "device_name"):
        assert field in msg
    assert "'2.99.0+cu999'" in msg and "'NVIDIA H100 80GB HBM3'" in msg and m.environment["torch"] in msg
    assert "platform" not in msg and "--bootstrap" in msg and "--allow-env-mismatch" in msg
    assert {d.field for d in err.value.differences} == {"torch", "cuda", "device_type", "device_name"}
    # bootstrapping gives the new environment its own baseline; each environment then picks its own
    boot = regress(gpu, store, bootstrap=True)
    assert boot.label == "baseline" and "environment" in boot.message
    gm = load_manifest(gpu)
    assert select_baseline(store, "synth", gm.capture_signature, gm.environment).run_id == boot.run_id
    assert select_baseline(store, "synth", m.capture_signature, m.environment).run_id != boot.run_id
    # compared across environments on request (against the latest candidate), differences reported
    a100 = edited_copy(gpu, tmp_path / "a100", environment={"device_name": "NVIDIA A100-SXM4-80GB"})
    r = regress(a100, store, allow_env_mismatch=True)
    assert r.exit_code == EXIT_OK and r.baseline_run == boot.run_id
    assert [(d.field, d.baseline, d.run) for d in r.env_differences] == [
        ("device_name", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
    ]
    assert "across environments" in r.message


def test_fields_that_do_not_change_numerics_are_ignored(synth, tmp_path):
    env = load_manifest(synth["a"]).environment
    py = env["python"].split(".")
    same = {
        **env,
        "platform": "Linux-9.9-other-kernel",
        "attn_implementation": "sdpa",
        "python": ".".join([py[0], py[1], "99"]),
    }
    assert env_differences(env, same) == []
    assert [d.field for d in env_differences(env, {**env, "python": f"{py[0]}.{int(py[1]) + 1}.0"})] == ["python"]


def test_no_baseline_says_how_to_bootstrap(synth, tmp_path):
    with pytest.raises(NoBaselineError, match="--bootstrap"):
        regress(synth["a"], tmp_path / "store")
    store = RunStore(tmp_path / "store")
    store.put(synth["bad"], model="synth", label="failed")
    with pytest.raises(NoBaselineError, match="labelled failed.*promote"):
        regress(synth["a"], store)
    assert not list((tmp_path / "store" / "runs").glob(".tmp-*"))


def test_promote_and_prune_keep_the_current_baseline(synth, tmp_path):
    store = RunStore(tmp_path / "store")
    m = load_manifest(synth["a"])
    base = regress(synth["a"], store, bootstrap=True)
    failed = [regress(synth["bad"], store) for _ in range(3)]
    assert [f.exit_code for f in failed] == [EXIT_DIVERGED] * 3
    assert store.prune(1, dry_run=True).deleted == (failed[0].run_id, failed[1].run_id)
    assert len(store.runs()) == 4
    res = store.prune(1)
    # the baseline is older than the newest run, but it is what select_baseline picks: kept
    assert res.deleted == (failed[0].run_id, failed[1].run_id) and res.protected == (base.run_id,)
    assert [e.name for e in store.runs()] == [base.run_id, failed[2].run_id]
    # a human blesses the failed run (an intended numerics change): it becomes the baseline
    rec = store.promote(failed[2].run_id)
    assert rec.label == "baseline" and rec.promoted.previous == "failed"
    assert store.get(failed[2].run_id).label == "baseline"
    assert select_baseline(store, "synth", m.capture_signature, m.environment).run_id == failed[2].run_id
    assert regress(synth["bad"], store).exit_code == EXIT_OK
    assert store.prune(1).deleted == (base.run_id, failed[2].run_id)
    with pytest.raises(StoreError, match="keep"):
        store.prune(-1)


def test_prune_leaves_young_unfinished_uploads_alone(synth, tmp_path):
    store = RunStore(tmp_path / "store")
    regress(synth["a"], store, bootstrap=True)
    run_id, _ = new_run_id()
    staging = tmp_path / "store" / "runs" / f".tmp-{run_id}-0badc0de"
    (staging / "dump").mkdir(parents=True)
    (staging / "dump" / "r0-p000000-000.safetensors").write_bytes(b"partial")
    res = store.prune(5)
    assert res.deleted == () and any("younger" in s for s in res.skipped) and staging.exists()
    res = store.prune(5, grace_s=0)
    assert res.deleted == (staging.name,) and not staging.exists()


def test_corrupt_and_incomplete_runs_are_reported_and_never_selected(synth, tmp_path):
    store = RunStore(tmp_path / "store")
    m = load_manifest(synth["a"])
    base = regress(synth["a"], store, bootstrap=True)
    newer = regress(synth["a2"], store)
    (tmp_path / "store" / "runs" / newer.run_id / "run.json").write_text('{"format_version": 1, "run_id": ')
    entries = {e.name: e for e in store.runs()}
    assert entries[newer.run_id].status is RunStatus.CORRUPT
    assert f"runs/{newer.run_id}/run.json" in entries[newer.run_id].problem
    assert select_baseline(store, "synth", m.capture_signature, m.environment).run_id == base.run_id
    # a run folder without its COMPLETE marker (an upload that never finished) is incomplete
    latest = regress(synth["a2"], store)
    (tmp_path / "store" / "runs" / latest.run_id / "COMPLETE").unlink()
    r = regress(synth["a2"], store)
    assert r.baseline_run == base.run_id and r.exit_code == EXIT_OK
    assert any(newer.run_id in w and "corrupt" in w for w in r.warnings)
    assert any(latest.run_id in w and "incomplete" in w for w in r.warnings)
    with pytest.raises(StoreError, match="corrupt run record"):
        store.get(newer.run_id)
    # run.json whose id does not match its folder (a copied folder) is corrupt too
    other = tmp_path / "store" / "runs" / r.run_id / "run.json"
    other.write_text(json.dumps({**json.loads(other.read_text()), "run_id": base.run_id}))
    assert {e.name: e.status for e in store.runs()}[r.run_id] is RunStatus.CORRUPT


def test_unalignable_run_is_stored_failed_exit_2(synth, tmp_path):
    store = RunStore(tmp_path / "store")
    base = regress(synth["a"], store, bootstrap=True)
    shifted = synth_dump(tmp_path / "shifted", hidden=8)  # same signature, other hidden size
    r = regress(shifted, store)
    assert r.exit_code == EXIT_UNUSABLE and r.label == "failed" and "UNUSABLE" in r.message
    assert store.get(r.run_id).summary.error and store.get(r.run_id).verdict().startswith("UNUSABLE")
    m = load_manifest(synth["a"])
    assert select_baseline(store, "synth", m.capture_signature, m.environment).run_id == base.run_id


@pytest.fixture
def memory_url():
    url = f"memory://driftscope-{uuid.uuid4().hex[:8]}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_remote_store_through_fsspec_memory(synth, tmp_path, memory_url):
    store = RunStore(memory_url)
    assert not store.backend.atomic_rename
    base = regress(synth["a"], memory_url, bootstrap=True)
    cache = tmp_path / "cache"
    ok = regress(synth["a2"], memory_url, cache_dir=cache)
    assert ok.exit_code == EXIT_OK and ok.baseline_run == base.run_id
    assert (cache / base.run_id / "manifest.json").is_file()  # fetched once, kept for the next run
    bad = regress(synth["bad"], memory_url, cache_dir=cache, config=CompareConfig(threshold=1e-3))
    assert bad.exit_code == EXIT_DIVERGED and bad.report.first_divergent.layer == 1
    assert bad.report.first_divergent.token == 5 and bad.baseline_run == ok.run_id
    fs, root = fsspec.core.url_to_fs(memory_url)
    assert fs.cat_file(f"{root}/runs/{bad.run_id}/COMPLETE").decode().strip() == bad.run_id
    assert labels(store) == ["baseline", "passed", "failed"]
    # an upload that died before its marker lists as incomplete and is never selected
    run_id, _ = new_run_id()
    fs.pipe_file(
        f"{root}/runs/{run_id}/run.json",
        RunStore(memory_url).get(ok.run_id).dumps().replace(ok.run_id.encode(), run_id.encode()),
    )
    assert {e.name: e.status for e in store.runs()}[run_id] is RunStatus.INCOMPLETE
    again = regress(synth["a2"], memory_url)  # no cache_dir: a temporary download
    assert again.baseline_run == ok.run_id and any("incomplete" in w for w in again.warnings)
    # promote rewrites the record in place; prune deletes remotely (marker first)
    assert store.promote(bad.run_id).label == "baseline"
    res = store.prune(1)
    assert res.kept == (again.run_id,) and res.deleted == (base.run_id, ok.run_id, bad.run_id)
    assert any(run_id in s and "younger" in s for s in res.skipped)
    assert [e.name for e in store.runs()] == [run_id, again.run_id]
    assert not fs.exists(f"{root}/runs/{base.run_id}")


def test_local_file_url(synth, tmp_path):
    url = (tmp_path / "store").as_uri()
    assert url.startswith("file://")
    store = RunStore(url)
    assert store.backend.atomic_rename
    base = regress(synth["a"], url, bootstrap=True)
    r = regress(synth["a2"], url)
    assert r.exit_code == EXIT_OK and r.baseline_run == base.run_id
    assert (tmp_path / "store" / "runs" / r.run_id / "COMPLETE").is_file()
    assert not list((tmp_path / "store" / "runs").glob(".tmp-*"))


def test_run_ids_sort_by_creation_time_and_records_round_trip(synth, tmp_path):
    ids = [new_run_id(t)[0] for t in (1_700_000_000_000_000_001, 1_700_000_000_000_000_010, 1_800_000_000_000_000_000)]
    assert ids == sorted(ids) and abs(run_id_time(ids[0]) - 1.7e9) < 1e-3
    rec = RunStore(tmp_path / "s").put(synth["a"], model="synth", label="baseline")
    assert RunRecord.from_json(json.loads(rec.dumps())) == rec
    with pytest.raises(ValueError, match="pass_label"):
        RunRecord.from_json({**rec.to_json(), "pass_label": "great"})
    with pytest.raises(StoreError, match="not a run id"):
        RunStore(tmp_path / "s").get("../../etc")


def test_unknown_protocol_is_one_line():
    with pytest.raises(StoreError, match="not a usable store URL|not installed"):
        RunStore("nosuchproto://bucket/x")


def test_model_name_required(tmp_path):
    with dumper.capture(None, tmp_path / "anon"):
        dumper.dump("x", torch.ones(2, 3), layer=0)
    with pytest.raises(UsageError, match="--model"):
        regress(tmp_path / "anon", tmp_path / "store", bootstrap=True)
    r = regress(tmp_path / "anon", tmp_path / "store", bootstrap=True, model="anon")
    assert r.label == "baseline" and RunStore(tmp_path / "store").get(r.run_id).model == "anon"


def test_run_dir_path_kept_out_of_the_store(synth, tmp_path):
    """The stored dump holds exactly the dump's files: the manifest's data files and the manifest."""
    store = RunStore(tmp_path / "store")
    (Path(synth["a"]) / "notes.txt").write_text("not part of the dump")
    try:
        r = regress(synth["a"], store, bootstrap=True)
    finally:
        (Path(synth["a"]) / "notes.txt").unlink()
    stored = sorted(p.name for p in (tmp_path / "store" / "runs" / r.run_id / "dump").iterdir())
    assert stored == sorted([*load_manifest(synth["a"]).files, "manifest.json"])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(
    raw=st.one_of(
        st.binary(max_size=64),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(
            st.sampled_from(
                [
                    "format_version",
                    "run_id",
                    "model",
                    "pass_label",
                    "summary",
                    "capture_signature",
                    "environment",
                    "created_at",
                ]
            ),
            json_values,
        ).map(lambda d: json.dumps({**d, "format_version": 1}).encode()),
    )
)
def test_any_run_record_bytes_list_as_complete_or_corrupt(raw):
    """The record reader never raises: whatever run.json holds, the run lists as complete or corrupt."""
    run_id, _ = new_run_id(1_700_000_000_000_000_000)
    entry = RunStore("unused-store")._entry(run_id, b"x", raw)
    assert entry.status in (RunStatus.COMPLETE, RunStatus.CORRUPT)
    assert (entry.record is not None) == (entry.status is RunStatus.COMPLETE)
    if entry.record is not None:
        assert isinstance(entry.record.verdict(), str)
