"""Comparing speculative decode dumps (:mod:`comparator.hidden.speculative`): verify step and draft index, acceptance.

Real dumps of the tiny HF Llama decoding greedily with n-gram prompt-lookup drafts, made by driving
the capture through real verify passes (:mod:`tests.comparator.hidden.speculative_runs`): the prompt
pass, then passes that feed the last token and up to 3 drafts through the KV cache, greedy
acceptance, the cache cropped back to the kept rows. Their counterparts are real: a ``--tokens-from``
prefill of the tokens the speculative run fed, a plain ``--new-tokens`` decode. What is checked:

- a clean speculative decode passes against its prefill, and the per-draft-index table holds every
  index 0..3 with as many rows as the steps kept there, all at fp32 rounding;
- a bug seeded in layer 6's output at draft index >= 2 of every verify pass is named at layer 7 with
  ``draft_index`` 2 and its verify step, and the table shows indices 0 and 1 at rounding, 2 far above;
- a build whose proposer is off by one (worse drafts, the same model) fails on acceptance alone,
  naming the first (sequence, verify step, position, draft index) where it rejected a draft the
  baseline kept; the other way round, or within ``--acceptance-tolerance``, it passes; two
  speculative runs that fork compare acceptance over the steps before the fork only;
- a speculative decode against a plain decode of the same prompts passes (the same tokens, every
  decode step covered) and reports the speculative side's acceptance; so does a dump of the dumper's
  own ``--speculative`` path (transformers' prompt lookup) against its prefill and the plain decode; a
  kept row that is missing is a coverage failure even where a rejected draft's row holds its position;
- hostile ``extra.speculative`` fields and records are one line naming the field (exit 2) through the CLI.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from comparator import CompareConfig, compare_dumps
from comparator.hidden.types import Report
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.format.decode import GENERATED_IDS
from dumper.format.speculative import steps_of
from dumper.prefill.run import RunConfig, dump_sequences, tokens_from
from dumper.prefill.speculative import parse_speculative
from tests.comparator.hidden.speculative_runs import LOGPROBS, PROMPTS, draft_bug, ngram, spec_decode
from tests.conftest import run_cli, tiny_llama

NEW, K = 16, 3
BUG_LAYER = 6
"""The seeded verify bug sits in decoder layer 6's output, so it is first seen in layer 7's input: the last
captured layer, where no later captured row can read the bad rows back through the KV cache."""


def _counterpart(model, decode, out):
    cfg = tokens_from(RunConfig(out=str(out), layers="all", logprobs=LOGPROBS), str(decode))
    dump_sequences(model, [list(s) for s in cfg.input_ids], cfg)
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    model, _ = tiny_llama()
    spec_decode(model, root / "spec", k=K, new_tokens=NEW)
    spec_decode(model, root / "worse", k=K, new_tokens=NEW, propose=ngram(shift=1))
    handle = draft_bug(model.model.layers[BUG_LAYER], first_index=2)
    try:
        spec_decode(model, root / "bug", k=K, new_tokens=NEW)
    finally:
        handle.remove()
    dump_sequences(
        model,
        [list(p) for p in PROMPTS],
        RunConfig(out=str(root / "plain"), layers="all", logprobs=LOGPROBS, new_tokens=NEW),
    )
    dump_sequences(  # transformers' own prompt lookup, as python -m dumper run --speculative ngram:k=3 runs it
        model,
        [list(p) for p in PROMPTS],
        RunConfig(
            out=str(root / "real"),
            layers="all",
            logprobs=LOGPROBS,
            new_tokens=NEW,
            speculative=parse_speculative(f"ngram:k={K}"),
        ),
    )
    _counterpart(model, root / "spec", root / "prefill")
    _counterpart(model, root / "real", root / "real-prefill")
    _counterpart(model, root / "bug", root / "bug-prefill")
    return root


def _steps(path):
    return steps_of(load_manifest(path).extra)


def _kept_at(steps):
    """{draft index: {(sequence, position)}} of the rows each step kept, counted here from the steps alone."""
    out: dict[int, set] = {}
    for s, seq in enumerate(steps):
        for st in seq:
            for i in range(st.accepted + 1):
                out.setdefault(i, set()).add((s, st.position + i))
    return out


def _length(steps):
    flat = [st for seq in steps for st in seq]
    return sum(st.accepted + 1 for st in flat) / len(flat)


def test_a_clean_speculative_decode_passes_against_its_prefill_and_shows_every_draft_index(dumps):
    steps = _steps(dumps / "spec")
    assert any(st.proposed > st.accepted for seq in steps for st in seq)  # rejected rows are in the dump
    assert max(st.accepted for seq in steps for st in seq) == K  # a step kept every draft: rows at every index
    report = compare_dumps(dumps / "prefill", dumps / "spec")
    assert report.passed, report.first_divergent
    sp = report.speculative
    assert sp is not None and sp.draft_side == "target" and sp.comparison is None and sp.passed
    kept = _kept_at(steps)
    assert [r.draft_index for r in sp.draft_index] == list(range(K + 1))
    assert [r.rows for r in sp.draft_index] == [len(kept[i]) for i in range(K + 1)]
    for r in sp.draft_index:
        assert r.values == 8 * r.rows and r.max_token_rel_diff < 1e-12, r  # 8 layers, fp32 rounding
        assert (r.sequence, r.position) in kept[r.draft_index] and r.tensor.startswith("model.layers.")
        assert r.tokens == r.rows and r.max_abs_logprob_diff < 1e-5  # each kept row predicted one token
    a = sp.acceptance["target"]
    assert a.steps == sum(map(len, steps)) and a.acceptance_length == pytest.approx(_length(steps))
    assert a.per_sequence == tuple(tuple(st.accepted for st in seq) for seq in steps)
    flat = [st for seq in steps for st in seq]
    for i, n, k, rate in a.rates:
        assert n == sum(st.proposed >= i for st in flat) and k == sum(st.accepted >= i for st in flat)
        assert rate == (k / n if n else None)
    assert Report.from_json(report.to_json()).speculative == sp  # the JSON reads back equal
    r = run_cli("comparator", dumps / "prefill", dumps / "spec", "--json", dumps / "clean.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rows by draft index of the target's verify steps" in r.stdout
    verdict = " ".join(r.stdout[r.stdout.index("PASS: matched") :].split())  # rich wraps at 160 columns
    assert f"speculative: target ngram:k={K}: acceptance length {_length(steps):.2f}" in verdict, verdict
    d = json.loads((dumps / "clean.json").read_text())["speculative"]
    assert d["passed"] and [row["draft_index"] for row in d["draft_index"]] == list(range(K + 1))
    assert d["acceptance"]["target"]["acceptance_length"] == pytest.approx(_length(steps))


def test_a_bug_at_draft_index_two_is_named_with_its_verify_step_and_draft_index(dumps, tmp_path):
    steps = _steps(dumps / "bug")
    kept = _kept_at(steps)
    assert kept[2], "the buggy run kept no draft at index 2: nothing to find"
    report = compare_dumps(dumps / "bug-prefill", dumps / "bug")
    fd = report.first_divergent
    assert not report.passed and fd is not None
    assert (fd.layer, fd.phase, fd.draft_index) == (BUG_LAYER + 1, "decode", 2)
    st = steps[fd.sequence][fd.verify_step]
    assert fd.token == st.position + 2 and st.accepted >= 2 and fd.forward_pass == st.forward_pass
    assert (fd.sequence, fd.token) in kept[2]
    table = {r.draft_index: r for r in report.speculative.draft_index}
    assert table[0].max_token_rel_diff < 1e-12 and table[1].max_token_rel_diff < 1e-12  # fp32 rounding
    assert table[2].max_token_rel_diff > 1e-3 and table[2].tensor == f"model.layers.{BUG_LAYER + 1}.self_attn.input"
    # the tokens predicted from draft index 2 rows carry the error; later rows read those rows' layer-7 keys
    # and values back through the cache, so indices 0 and 1 move too, far less
    assert table[2].max_abs_logprob_diff > 10 * max(table[0].max_abs_logprob_diff, table[1].max_abs_logprob_diff)
    md = tmp_path / "r.md"
    r = run_cli("comparator", dumps / "bug-prefill", dumps / "bug", "--json", tmp_path / "r.json", "--markdown", md)
    assert r.returncode == 1, r.stdout + r.stderr
    flat = " ".join(r.stdout.split())
    assert (
        f"DIVERGED at layer {BUG_LAYER + 1} (model.layers.{BUG_LAYER + 1}.self_attn.input, pass {st.forward_pass}, "
        f"rank 0), decode step {fd.token - len(PROMPTS[fd.sequence])}, verify step {fd.verify_step}, draft index 2, "
        f"first failing token {fd.token} of sequence {fd.sequence}" in flat
    ), r.stdout
    d = json.loads((tmp_path / "r.json").read_text())
    assert (d["first_divergent"]["draft_index"], d["first_divergent"]["verify_step"]) == (2, fd.verify_step)
    text = md.read_text()
    assert f"verify step {fd.verify_step}, draft index 2" in text and "| draft index | rows |" in text


def _first_draft_only_baseline_kept(a, b):
    """(sequence, target step index, position, draft index, rejected?) of the first position where the baseline
    kept a draft and the target's step before that position kept none, by walking both step lists."""
    for s in range(len(a)):
        for st in a[s]:
            for q in range(st.position + 1, st.kept_end):
                before = [j for j, t in enumerate(b[s]) if t.kept_end == q]
                if before:
                    t = b[s][before[0]]
                    return s, before[0], q, q - t.position, t.proposed > t.accepted
    return None


def test_worse_drafts_fail_on_acceptance_naming_the_first_rejected_draft(dumps):
    a, b = _steps(dumps / "spec"), _steps(dumps / "worse")
    ga, gb = (load_manifest(dumps / n).extra[GENERATED_IDS] for n in ("spec", "worse"))
    assert ga == gb  # the same model chose the same tokens: only the drafts differ
    assert _length(b) < 0.9 * _length(a)
    report = compare_dumps(dumps / "spec", dumps / "worse")
    assert not report.passed and report.first_divergent is None and all(t.passed for t in report.tensors)
    c = report.speculative.comparison
    assert c is not None and not c.passed and c.layer is None and c.forked == ()
    assert c.baseline.acceptance_length == pytest.approx(_length(a))
    assert c.target.acceptance_length == pytest.approx(_length(b))
    assert c.drop == pytest.approx(1 - _length(b) / _length(a))
    s, step, q, index, rejected = _first_draft_only_baseline_kept(a, b)
    assert (c.first.sequence, c.first.step, c.first.position, c.first.draft_index) == (s, step, q, index)
    assert c.first.rejected is rejected is True
    r = run_cli("comparator", dumps / "spec", dumps / "worse", "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith(
        f"DIVERGED (speculative acceptance: target acceptance length {_length(b):.2f} vs baseline {_length(a):.2f} "
        f"({-c.drop:+.1%}, tolerance 2%) over the steps both fed alike"
    ), r.stdout
    assert (
        f"first at sequence {s}, verify step {step} (position {q}, draft index {index}): the target rejected a "
        "draft the baseline accepted" in r.stdout
    )
    assert "the hidden states agree at every compared layer" in r.stdout
    # better drafts in the target, a looser tolerance (flag or environment): passes
    assert compare_dumps(dumps / "worse", dumps / "spec").passed
    assert compare_dumps(dumps / "spec", dumps / "worse", CompareConfig(acceptance_tolerance=0.5)).passed
    r = run_cli("comparator", dumps / "spec", dumps / "worse", "--quiet", "--acceptance-tolerance", "0.5")
    assert r.returncode == 0 and "speculative acceptance: target" in r.stdout, r.stdout + r.stderr
    r = run_cli(
        "comparator", dumps / "spec", dumps / "worse", "--quiet", env={"DRIFTSCOPE_ACCEPTANCE_TOLERANCE": "0.5"}
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("comparator", dumps / "spec", dumps / "worse", "--acceptance-tolerance", "1.5")
    assert r.returncode == 2 and "acceptance_tolerance" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_two_speculative_runs_that_fork_compare_acceptance_before_the_fork_only(dumps):
    """The buggy build chose other tokens from some step on: the fork is judged as for any decode, and the
    acceptance of each side counts only its steps whose chosen tokens all lie before the fork."""
    report = compare_dumps(dumps / "spec", dumps / "bug")
    forks = {f.sequence: f.position for f in report.decode.forks}
    assert forks and all(f.near_tie is False for f in report.decode.forks)  # real divergences
    c = report.speculative.comparison
    assert c.forked == tuple(sorted(forks))
    for side, path in (("baseline", "spec"), ("target", "bug")):
        steps = _steps(dumps / path)
        window = [[st for st in seq if st.kept_end < forks.get(s, 10**9)] for s, seq in enumerate(steps)]
        got = getattr(c, side)
        assert got.per_sequence == tuple(tuple(st.accepted for st in seq) for seq in window)
        assert got.steps == sum(map(len, window)) < sum(map(len, steps))


def test_a_speculative_decode_against_a_plain_decode_passes_and_reports_its_acceptance(dumps):
    spec, plain = load_manifest(dumps / "spec"), load_manifest(dumps / "plain")
    assert spec.extra[GENERATED_IDS] == plain.extra[GENERATED_IDS]
    for base, target in (("plain", "spec"), ("spec", "plain")):
        report = compare_dumps(dumps / base, dumps / target)
        assert report.passed, (report.first_divergent, report.decode)
        d = report.decode
        assert d.forks == () and d.missing == () and d.steps == sum(NEW - 1 for _ in PROMPTS)
        side = "target" if target == "spec" else "baseline"
        assert list(report.speculative.acceptance) == [side] and report.speculative.comparison is None
        assert {t.sequence: t.shape[0] for t in report.tensors} == {s: len(p) + NEW - 1 for s, p in enumerate(PROMPTS)}


def test_transformers_own_prompt_lookup_compares_against_its_prefill_and_a_plain_decode(dumps):
    """The same checks on a dump of the dumper's real ``--speculative`` path (transformers' generate)."""
    steps = _steps(dumps / "real")
    kept = _kept_at(steps)
    report = compare_dumps(dumps / "real-prefill", dumps / "real")
    assert report.passed, report.first_divergent
    sp = report.speculative
    assert [r.rows for r in sp.draft_index] == [len(kept.get(i, ())) for i in range(K + 1)] and kept[K]
    assert all(r.max_token_rel_diff < 1e-12 for r in sp.draft_index if r.rows)
    assert sp.acceptance["target"].acceptance_length == pytest.approx(_length(steps))
    plain = load_manifest(dumps / "plain").extra[GENERATED_IDS]
    assert load_manifest(dumps / "real").extra[GENERATED_IDS] == plain
    report = compare_dumps(dumps / "plain", dumps / "real")
    assert report.passed and report.decode.forks == () and report.decode.missing == ()
    assert list(report.speculative.acceptance) == ["target"]


def test_a_missing_kept_row_is_a_coverage_failure_though_a_rejected_row_holds_its_position(dumps, tmp_path):
    steps = _steps(dumps / "spec")
    s, t = next((s, t) for s, seq in enumerate(steps) for t in range(1, len(seq)) if seq[t - 1].proposed > 0)
    st, prev = steps[s][t], steps[s][t - 1]
    assert prev.accepted < prev.proposed  # the previous pass fed st.position as a draft it rejected
    dump = tmp_path / "holed"
    shutil.copytree(dumps / "spec", dump)
    raw = json.loads((dump / MANIFEST_NAME).read_text())
    name = "model.layers.3.self_attn.input"
    raw["tensors"] = [d for d in raw["tensors"] if not (d["name"] == name and d["forward_pass"] == st.forward_pass)]
    (dump / MANIFEST_NAME).write_text(json.dumps(raw))
    report = compare_dumps(dumps / "plain", dump)
    assert not report.passed and report.decode.missing
    step = st.position - len(PROMPTS[s])
    assert (
        f"decode step {step} of sequence {s} (position {st.position}) has no rows at {name}"
        in (report.decode.missing[0])
    )


def _set(path, value):
    """A mutation of the manifest that sets ``raw[...path...] = value``."""

    def mutate(raw):
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    return mutate


def _unlisted_pass(raw):
    """Moves one hidden record of sequence 0's first verify pass into a pass the steps do not list (a pass that
    recorded only logprobs). Returns the record's index."""
    spec = raw["extra"]["speculative"]
    listed = {e[0] for seq in spec["steps"] for e in seq}
    first = spec["steps"][0][0][0]
    i = next(i for i, d in enumerate(raw["tensors"]) if d["forward_pass"] == first and d.get("layer") == 0)
    raw["tensors"][i]["forward_pass"] = min(f for f in range(first + 1, first + 100) if f not in listed)
    return i


HOSTILE = {
    "draft counts that do not add up": (
        lambda raw: _set(["extra", "speculative", "steps", 0, 1, 1], lambda p: p + 1)(raw),
        "extra.speculative.steps[0][1]",
    ),
    "an accepted count above the proposed count": (
        lambda raw: _set(
            ["extra", "speculative", "steps", 0, 0, 3], lambda a: raw["extra"]["speculative"]["steps"][0][0][2] + 1
        )(raw),
        "extra.speculative.steps[0][0]",
    ),
    "a row both kept and rejected": (
        lambda raw: _set(["extra", "speculative", "rejected", 0, 0], lambda e: [e[0], e[1] - 1, e[2] + 1])(raw),
        "extra.speculative.rejected[0][0]",
    ),
}


@pytest.mark.parametrize("case", [*HOSTILE, "a decode record in a pass the steps do not list"])
def test_hostile_speculative_fields_are_one_line_naming_the_field(dumps, tmp_path, case):
    dump = tmp_path / "hostile"
    shutil.copytree(dumps / "spec", dump)
    raw = json.loads((dump / MANIFEST_NAME).read_text())
    if case in HOSTILE:
        mutate, field = HOSTILE[case]
        mutate(raw)
    else:
        field = f"tensors[{_unlisted_pass(raw)}].forward_pass"
    (dump / MANIFEST_NAME).write_text(json.dumps(raw))
    r = run_cli("comparator", dumps / "prefill", dump)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and field in lines[0], (r.returncode, r.stderr)
    assert r.stdout == ""


def test_draft_indices_of_rows_follow_the_steps():
    """Rows of kept positions get their step's draft index and index; prompt rows and positions past the steps -1."""
    from comparator.hidden.speculative import draft_indices
    from dumper.format.speculative import Step

    steps = [[Step(2, 5, 3, 2), Step(4, 8, 2, 0), Step(6, 9, 0, 0)], []]
    seqs = np.array([0, 0, 0, 0, 0, 0, 0, 1])
    pos = np.array([4, 5, 7, 8, 9, 10, 11, 5])
    draft, step = draft_indices(steps, seqs, pos)
    assert draft.tolist() == [-1, 0, 2, 0, 0, -1, -1, -1]
    assert step.tolist() == [-1, 0, 0, 1, 2, -1, -1, -1]
