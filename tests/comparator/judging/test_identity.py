"""Nothing passes that was not compared: model identity, the same dump twice, tensors on one side only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from comparator import CompareConfig, compare_dumps, regress
from comparator.cli.main import main as comparator_main
from comparator.hidden.notes import DTYPE_NOTE
from comparator.judging.identity import IDENTITY_FIELDS, identity_differences
from comparator.store import RunStore
from dumper.errors import EXIT_DIVERGED, EXIT_OK, EXIT_UNUSABLE, ModelMismatchError, NotComparableError, UsageError
from dumper.format import MANIFEST_NAME, load_manifest, write_json_atomic
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, run_dump

PROMPTS = ("Inference engines change daily.", "A second prompt, a little longer than the first one.")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """Real preset dumps: tiny-llama twice, another seed, tiny-qwen2, fewer prompts, logprobs on one side."""
    root = tmp_path_factory.mktemp("identity")
    specs = {
        "llama": dict(),
        "llama2": dict(),
        "seed1": dict(seed=1),
        "qwen": dict(model="tiny-qwen2"),
        "one_prompt": dict(prompts=PROMPTS[:1]),
        "logprobs": dict(logprobs=LogprobSpec()),
        "bf16": dict(dtype="bfloat16"),
        "qwen_logprobs": dict(model="tiny-qwen2", logprobs=LogprobSpec()),
        "one_prompt_logprobs": dict(prompts=PROMPTS[:1], logprobs=LogprobSpec()),
    }
    out = {}
    for name, kw in specs.items():
        kw = {"prompts": PROMPTS, **kw}
        run_dump(RunConfig(out=str(root / name), layers="first,last", **kw))
        out[name] = root / name
    return out


def _run(capsys, *argv: str | os.PathLike[str]) -> tuple[int, str, str]:
    code = comparator_main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_manifest_records_the_identity_fields(dumps):
    model = load_manifest(dumps["llama"]).model
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["num_layers"] == 8 and model["hidden_size"] == 64
    assert all(model.get(f) is not None for f in IDENTITY_FIELDS)


def test_another_model_is_unusable_input_naming_the_fields(dumps, capsys):
    """tiny-llama vs tiny-qwen2 used to read as DIVERGED at layer 0; it is exit 2 naming what differs."""
    with pytest.raises(ModelMismatchError) as e:
        compare_dumps(dumps["llama"], dumps["qwen"])
    msg = str(e.value)
    assert "architecture 'LlamaForCausalLM' (baseline) vs 'Qwen2ForCausalLM' (target)" in msg
    assert "num_layers 8" in msg and "config_hash" in msg and "--allow-model-mismatch" in msg
    code, out, err = _run(capsys, dumps["llama"], dumps["qwen"])
    assert code == EXIT_UNUSABLE and out == "" and err.count("\n") == 1 and "architecture" in err


def test_allow_model_mismatch_compares_and_reports_the_differences(dumps, capsys):
    code, out, _ = _run(capsys, dumps["llama"], dumps["qwen"], "--allow-model-mismatch", "--quiet")
    assert code == EXIT_DIVERGED  # different random weights: a real divergence, now judged
    assert "model differs (allowed): architecture" in out
    report = compare_dumps(dumps["llama"], dumps["qwen"], CompareConfig(allow_model_mismatch=True))
    assert any(n.startswith("model differs (allowed): num_layers") for n in report.to_json()["notes"])


def test_run_settings_are_not_identity(dumps):
    """float32 reference vs bfloat16 candidate: the comparison this tool exists for."""
    assert identity_differences(load_manifest(dumps["llama"]), load_manifest(dumps["bf16"])) == []
    report = compare_dumps(dumps["llama"], dumps["bf16"])
    assert report.matched > 0 and report.notes == (DTYPE_NOTE.format(dtype="bfloat16"),)  # no identity note


def test_different_weights_are_reported_not_fatal(dumps, capsys):
    code, out, _ = _run(capsys, dumps["llama"], dumps["seed1"], "--quiet")
    assert code == EXIT_DIVERGED and "different weights: weights_hash" in out
    report = compare_dumps(dumps["llama"], dumps["llama2"])
    assert report.passed and report.notes == ()


def test_a_changed_config_hash_is_a_mismatch(dumps, tmp_path):
    """A dump whose config differs (here: its recorded hash) is another model, even with equal sizes."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(dumps["llama2"], other)
    m = json.loads((other / MANIFEST_NAME).read_text())
    m["model"]["config_hash"] = "0" * 16
    write_json_atomic(other / MANIFEST_NAME, m)
    with pytest.raises(ModelMismatchError, match="config_hash"):
        compare_dumps(dumps["llama"], other)


def test_the_same_directory_twice_is_refused(dumps, tmp_path, capsys):
    with pytest.raises(UsageError, match="same directory"):
        compare_dumps(dumps["llama"], dumps["llama"])
    link = tmp_path / "link"
    link.symlink_to(dumps["llama"], target_is_directory=True)
    code, _, err = _run(capsys, dumps["llama"], link)
    assert code == EXIT_UNUSABLE and "same directory" in err


def test_tensors_on_one_side_are_named_in_the_verdict_line(dumps, capsys):
    """The target lacks the second prompt: the common tensors pass, and even --quiet says what was not compared."""
    code, out, _ = _run(capsys, dumps["llama"], dumps["one_prompt"], "--quiet")
    assert code == EXIT_OK
    assert out.strip() == "PASS (2 tensors only in the baseline, 0 only in the target: not compared)"
    code, out, _ = _run(capsys, dumps["llama"], dumps["one_prompt"])
    assert code == EXIT_OK and "2 tensors only in the baseline, 0 only in the target: not compared" in out


def test_logprobs_on_one_side_count_as_not_compared(dumps, capsys):
    code, out, _ = _run(capsys, dumps["logprobs"], dumps["llama"], "--quiet")
    assert code == EXIT_OK and "1 tensors only in the baseline" in out
    report = compare_dumps(dumps["logprobs"], dumps["llama"])
    assert "logprobs" in report.unmatched_baseline and report.logprobs is None


def test_require_all_makes_missing_tensors_unusable(dumps, capsys):
    with pytest.raises(NotComparableError, match="2 tensors only in the baseline .*--require-all"):
        compare_dumps(dumps["llama"], dumps["one_prompt"], CompareConfig(require_all=True))
    code, out, err = _run(capsys, dumps["llama"], dumps["one_prompt"], "--require-all")
    assert code == EXIT_UNUSABLE and out == "" and "--require-all" in err
    code, _, _ = _run(capsys, dumps["llama"], dumps["llama2"], "--require-all", "--quiet")
    assert code == EXIT_OK


def test_regress_requires_all_tensors_by_default(dumps, tmp_path):
    store = RunStore(tmp_path / "store")
    assert regress(dumps["llama"], store, bootstrap=True).exit_code == EXIT_OK
    res = regress(dumps["one_prompt"], store)
    assert res.exit_code == EXIT_UNUSABLE and res.label == "failed" and "--require-all" in res.message
    res = regress(dumps["one_prompt"], store, require_all=False)
    assert res.exit_code == EXIT_OK and res.label == "passed"


def test_regress_notes_different_weights(dumps, tmp_path):
    store = RunStore(tmp_path / "store")
    regress(dumps["llama"], store, bootstrap=True)
    res = regress(dumps["seed1"], store)
    assert res.exit_code == EXIT_DIVERGED and "different weights: weights_hash" in res.message


def test_logprob_comparisons_check_identity_and_distinct_sources(dumps, capsys):
    code, out, err = _run(capsys, "logprobs", dumps["logprobs"], dumps["qwen_logprobs"])
    assert code == EXIT_UNUSABLE and out == "" and "architecture 'LlamaForCausalLM'" in err
    code, _, _ = _run(capsys, "logprobs", dumps["logprobs"], dumps["qwen_logprobs"], "--allow-model-mismatch")
    assert code == EXIT_DIVERGED
    code, _, err = _run(capsys, "logprobs", dumps["logprobs"], dumps["logprobs"])
    assert code == EXIT_UNUSABLE and "same directory" in err


def test_logprob_quiet_line_names_requests_on_one_side(dumps, capsys):
    code, out, _ = _run(capsys, "logprobs", dumps["logprobs"], dumps["one_prompt_logprobs"], "--quiet")
    assert code == EXIT_OK
    assert out.strip() == "PASS (not compared, only in the baseline: '1')"


def test_regress_cli_allow_missing(dumps, tmp_path):
    from tests.conftest import run_cli

    store = tmp_path / "store"
    assert regress(dumps["llama"], RunStore(store), bootstrap=True).exit_code == EXIT_OK
    r = run_cli("comparator", "regress", dumps["one_prompt"], "--store", store, "--quiet")
    assert r.returncode == EXIT_UNUSABLE and "--require-all" in r.stdout + r.stderr
    r = run_cli("comparator", "regress", dumps["one_prompt"], "--store", store, "--quiet", "--allow-missing")
    assert r.returncode == EXIT_OK, r.stderr


def test_logits_and_top_k_on_one_side_are_not_compared_and_said(tmp_path, capsys):
    """KL needs logits rows on both sides, top-k errors top-k lists: one side only is said, and --require-all refuses
    it."""
    full, plain = tmp_path / "full", tmp_path / "plain"
    run_dump(RunConfig(out=str(full), prompts=PROMPTS, layers="first", logprobs=LogprobSpec(top_k=5, save_logits=True)))
    run_dump(RunConfig(out=str(plain), prompts=PROMPTS, layers="first", logprobs=LogprobSpec()))
    code, out, _ = _run(capsys, full, plain, "--quiet")
    assert code == EXIT_OK and "2 tensors only in the baseline, 0 only in the target: not compared" in out
    assert set(compare_dumps(full, plain).unmatched_baseline) == {"logits", "logprobs.top_logprob"}
    code, _, err = _run(capsys, full, plain, "--require-all")
    assert code == EXIT_UNUSABLE and "logits" in err
    code, out, _ = _run(capsys, "logprobs", full, plain, "--quiet")
    assert code == EXIT_OK and "not compared, only in the baseline: 'logits', 'logprobs.top_logprob'" in out
