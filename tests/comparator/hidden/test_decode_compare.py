"""Comparing decode dumps (:mod:`comparator.hidden.decode`): forks between two decode runs, coverage, trust.

Real dumps of the tiny HF Llama decoding greedily. Two decode runs are compared while both fed the
same tokens; at the first step where their generated tokens differ the verdict names the fork with
both tokens and judges it against the logprob noise: a near-tie (the baseline's own gap between
the two tokens within 10x the noise) passes, a real divergence fails, and nothing after the fork
is compared or counted. A dump that claims decode steps and lacks one step's rows fails naming
the step; decode fields a hostile manifest gets wrong are refused in one line (exit 2).
"""

from __future__ import annotations

import json

import pytest
import torch

from comparator import compare_dumps
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.format.decode import DECODE, GENERATED_IDS, record_phase
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import run_cli, tiny_llama

PROMPTS = ([1] + [(7 * i) % 250 + 3 for i in range(39)], [1, 17, 33, 90, 5, 61, 7, 140, 9, 12, 44])
NEW = 10
FORK_STEP = 4
"""The decode step whose token the seeded logits make a (near-)tie: its row is at position len(prompt 0) + 3."""


def _logits_hook(*, tie: float, noise: float = 0.0):
    """A forward hook on the whole model that makes sequence 0's second-best token at the row choosing
    generated token FORK_STEP score ``tie`` above the best (negative: just below), and adds ``noise`` x N(0, 1)
    to every logit of every pass (a benign perturbation the logprobs measure)."""
    gen = torch.Generator().manual_seed(3)
    row = len(PROMPTS[0]) + FORK_STEP - 1

    def hook(module, args, kwargs, out):
        logits = out.logits
        if noise:
            logits.add_(noise * torch.randn(logits.shape, generator=gen))
        pos = kwargs["position_ids"]
        if logits.shape[1] == 1 and logits.shape[0] >= 1 and int(pos[0, -1]) == row:
            top = logits[0, -1].topk(2)
            logits[0, -1, top.indices[1]] = top.values[0] + tie
        return out

    return hook


def _run(out, hook=None):
    model, _ = tiny_llama()
    handle = model.register_forward_hook(hook, with_kwargs=True) if hook is not None else None
    try:
        dump_sequences(
            model,
            [list(p) for p in PROMPTS],
            RunConfig(out=str(out), layers="all", logprobs=LogprobSpec(top_k=3), new_tokens=NEW),
        )
    finally:
        if handle is not None:
            handle.remove()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("forks")
    return {
        "tie": _run(root / "tie", _logits_hook(tie=-2e-6)),  # baseline: its best by 2e-6
        "flipped": _run(root / "flipped", _logits_hook(tie=2e-6, noise=3e-6)),  # noise tips it the other way
        "clean": _run(root / "clean"),
        "jumped": _run(root / "jumped", _logits_hook(tie=1.0)),
    }  # a token the baseline ranks far lower


def _generated(path):
    return load_manifest(path).extra[GENERATED_IDS]


def test_a_benign_near_tie_fork_passes_and_is_named_with_both_tokens(runs):
    a, b = _generated(runs["tie"]), _generated(runs["flipped"])
    assert a[0][:FORK_STEP] == b[0][:FORK_STEP] and a[0][FORK_STEP] != b[0][FORK_STEP] and a[1] == b[1]
    report = compare_dumps(runs["tie"], runs["flipped"])
    assert report.passed, (report.first_divergent, report.decode)
    d = report.decode
    assert d is not None and len(d.forks) == 1
    f = d.forks[0]
    assert (f.sequence, f.step, f.position) == (0, FORK_STEP, len(PROMPTS[0]) + FORK_STEP)
    assert (f.baseline_token, f.target_token) == (a[0][FORK_STEP], b[0][FORK_STEP])
    assert f.near_tie is True and not f.gap_is_bound and 0 < f.gap <= 10 * f.noise
    # compared: sequence 0 up to the fork (steps 0..3), sequence 1 every step
    assert d.steps == FORK_STEP + (NEW - 1)
    lengths = {t.sequence: t.shape[0] for t in report.tensors}
    assert lengths == {0: len(PROMPTS[0]) + FORK_STEP, 1: len(PROMPTS[1]) + NEW - 1}
    assert report.logprobs is not None and report.logprobs.passed


def test_a_fork_the_noise_cannot_explain_fails_while_every_compared_row_passes(runs):
    report = compare_dumps(runs["clean"], runs["jumped"])
    assert not report.passed and all(t.passed for t in report.tensors) and report.logprobs.passed
    f = report.decode.forks[0]
    assert f.near_tie is False and (f.sequence, f.step) == (0, FORK_STEP) and f.noise == 0.0
    r = run_cli("comparator", runs["clean"], runs["jumped"], "--quiet", "--markdown", runs["jumped"].parent / "r.md")
    assert r.returncode == 1 and r.stdout.startswith(f"DIVERGED (decode fork: sequence 0 at step {FORK_STEP}"), r.stdout
    assert "a real divergence" in r.stdout
    md = (runs["jumped"].parent / "r.md").read_text()
    assert f"decode fork: sequence 0 at step {FORK_STEP}" in md and "decode steps compared over 2 sequences" in md


def test_rows_after_a_fork_differ_wildly_and_are_not_counted(runs):
    """The rows the fork fed different tokens are far apart, and the verdict leaves them out."""
    jumped, clean = load_manifest(runs["jumped"]), load_manifest(runs["clean"])
    assert _generated(runs["jumped"])[0][FORK_STEP + 1 :] != _generated(runs["clean"])[0][FORK_STEP + 1 :]
    late = [r for r in jumped.tensors if record_phase(r.meta) == (DECODE, FORK_STEP + 1)]
    assert late and all(r.row_sequence_ids().tolist() in ([0], [1]) for r in late) and clean.tensors
    report = compare_dumps(runs["clean"], runs["jumped"])
    assert all(t.first_failing_token is None for t in report.tensors)


def test_a_missing_decode_step_fails_naming_the_step_never_a_pass_on_fewer_rows(runs, tmp_path):
    import shutil

    dump = tmp_path / "holed"
    shutil.copytree(runs["clean"], dump)
    raw = json.loads((dump / MANIFEST_NAME).read_text())
    gone = [t for t in raw["tensors"] if t.get("meta", {}).get("decode_step") == 3 and t["layer"] == 5]
    assert len(gone) == 2  # one per sequence: one prompt per pass
    raw["tensors"] = [t for t in raw["tensors"] if t not in gone]
    (dump / MANIFEST_NAME).write_text(json.dumps(raw))
    report = compare_dumps(runs["clean"], dump)
    assert not report.passed and report.decode.missing
    assert report.decode.missing[0].endswith(
        f"decode step 3 of sequence 0 (position {len(PROMPTS[0]) + 3}) has no rows at model.layers.5.self_attn.input"
    )
    assert all(t.passed for t in report.tensors)  # what is there agrees: only the hole fails it
    r = run_cli("comparator", runs["clean"], dump, "--quiet")
    assert r.returncode == 1 and "decode coverage" in r.stdout and "decode step 3 of sequence 0" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda m: m["extra"].__setitem__("generated_ids", [[1, 2]] * 2), "extra.generated_ids[0]"),
        (lambda m: m["extra"].__setitem__("generated_ids", [[1] * NEW]), "extra.generated_ids"),
        (lambda m: m["extra"].__setitem__("new_tokens", -2), "extra.new_tokens"),
        (lambda m: m["extra"].__setitem__("prompt_lengths", [0, 1]), "extra.prompt_lengths[0]"),
        (lambda m: m["tensors"][0].__setitem__("meta", {"decode_step": 2}), "tensors[0].meta.decode_step"),
        (lambda m: m["tensors"][0].__setitem__("meta", {"phase": "verify"}), "tensors[0].meta.phase"),
    ],
)
def test_decode_fields_a_manifest_gets_wrong_are_refused_in_one_line(runs, tmp_path, edit, field):
    import shutil

    dump = tmp_path / "bad"
    shutil.copytree(runs["clean"], dump)
    raw = json.loads((dump / MANIFEST_NAME).read_text())
    edit(raw)
    (dump / MANIFEST_NAME).write_text(json.dumps(raw))
    r = run_cli("comparator", runs["clean"], dump)
    assert r.returncode == 2 and field in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_a_counterpart_made_from_other_tokens_is_not_comparable(runs, tmp_path):
    r = run_cli("dumper", "run", "--tokens-from", runs["clean"], "--layers", "all", "--out", tmp_path / "p", "--quiet")
    assert r.returncode == 0, r.stderr
    r = run_cli("comparator", tmp_path / "p", runs["jumped"])
    assert r.returncode == 2 and "it was not made with --tokens-from that dump" in r.stderr, r.stderr


def test_the_report_round_trips_its_decode_part(runs):
    from comparator.hidden.types import Report

    report = compare_dumps(runs["tie"], runs["flipped"])
    again = Report.from_json(json.loads(json.dumps(report.to_json())))
    assert again.decode == report.decode and again.first_divergent == report.first_divergent


@pytest.mark.slow
def test_a_prefill_of_the_prompts_alone_is_refused_with_the_command_that_makes_the_counterpart(runs, tmp_path):
    ids = [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]
    r = run_cli("dumper", "run", *ids, "--layers", "all", "--out", tmp_path / "prompts", "--quiet")
    assert r.returncode == 0, r.stderr
    for base, target in ((tmp_path / "prompts", runs["clean"]), (runs["clean"], tmp_path / "prompts")):
        r = run_cli("comparator", base, target)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"holds no rows of the decode steps of {runs['clean']}" in r.stderr
        assert f"python -m dumper run --tokens-from {runs['clean']}" in r.stderr
