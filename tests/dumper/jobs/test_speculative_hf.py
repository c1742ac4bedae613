"""``dumper run --engine transformers --new-tokens N --speculative ngram:k=3``: transformers' own prompt lookup.

Real runs of the tiny HF Llama in fp32, eager: the CLI records every verify pass of ``model.generate``'s
prompt-lookup decoding and writes ``extra.speculative``; its steps are the accepted counts transformers
itself computed (a spy on the candidate generator's ``update_candidate_strategy``); the greedy tokens
are a plain ``--new-tokens`` decode's; the kept rows match the ``--tokens-from`` prefill. A bug seeded
in layer 2's attention that fires only on the rows of draft index 2 and more of a verify pass is named
at layer 3's input, at the first kept row of draft index 2; a plain decode with the same bug passes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from comparator import compare_dumps
from dumper.errors import UsageError
from dumper.format import LOGPROB_VALUE, load_manifest
from dumper.format.decode import GENERATED_IDS
from dumper.format.speculative import steps_of
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, dump_sequences, run_dump, tokens_from
from dumper.prefill.speculative import parse_speculative
from tests.conftest import run_cli, tiny_llama

PROMPTS = ([1] + [5, 9, 14, 22, 31] * 5, [1, 17, 33, 90, 5, 61, 7, 140, 9, 12, 44, 17, 33, 90, 5])
"""Prompts that repeat themselves, so that prompt lookup finds n-grams to copy from."""
NEW = 16
SETTING = "ngram:k=3"
LOGPROBS = LogprobSpec(top_k=5)
BUG_LAYER = 2
"""The seeded bug: layer 2's attention output, on the rows of draft index >= 2 of a verify pass."""


def _ids_args() -> list[str]:
    return [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]


def _cfg(out, **kw) -> RunConfig:
    return RunConfig(out=str(out), input_ids=PROMPTS, layers="all", logprobs=LOGPROBS, new_tokens=NEW, **kw)


def _spec_cfg(out) -> RunConfig:
    return _cfg(out, speculative=parse_speculative(SETTING))


def _prefill_of(dump, out) -> RunConfig:
    return tokens_from(RunConfig(out=str(out), layers="all", logprobs=LOGPROBS), str(dump))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The CLI's speculative dump (with --observer-check), its stdout, a plain decode and the spec dump's prefill."""
    root = tmp_path_factory.mktemp("spec")
    argv = ["--new-tokens", str(NEW), "--speculative", SETTING, "--layers", "all", "--logprobs", "--top-k", "5"]
    r = run_cli("dumper", "run", *_ids_args(), *argv, "--observer-check", "--out", root / "spec", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    run_dump(_cfg(root / "plain"))
    run_dump(_prefill_of(root / "spec", root / "prefill"))
    return root, r.stdout


def _decode_rows(manifest) -> dict[int, list[tuple[int, int]]]:
    """Per pass, the (sequence, position) decode rows of its first hidden record."""
    rows: dict[int, list[tuple[int, int]]] = {}
    for rec in manifest.tensors:
        if rec.layer != 0:
            continue
        for q, s in zip(rec.row_positions().tolist(), rec.row_sequence_ids().tolist(), strict=True):
            if q >= len(PROMPTS[s]):
                rows.setdefault(rec.forward_pass, []).append((s, q))
    return rows


@pytest.mark.slow
def test_the_cli_records_verify_passes_that_keep_and_reject_drafts(dumps):
    root, stdout = dumps
    m = load_manifest(root / "spec")
    spec = m.extra["speculative"]
    assert (spec["setting"], spec["method"], spec["num_speculative_tokens"]) == (SETTING, "prompt_lookup", 3)
    assert spec["config"] == {
        "method": "prompt_lookup",
        "num_speculative_tokens": 3,
        **parse_speculative(SETTING).hf_kwargs(),
    }
    assert m.extra["dtype"] == "float32" and m.extra["new_tokens"] == NEW
    steps = steps_of(m.extra)
    assert steps is not None and len(steps) == len(PROMPTS)
    every = [st for seq in steps for st in seq]
    assert any(st.accepted >= 1 and st.proposed > st.accepted for st in every)  # kept some drafts, rejected others
    assert any(st.proposed == 0 for st in every)  # prompt lookup found nothing: a plain decode step
    # each verify pass feeds one sequence's rows from its step's position on, none past the last token fed
    rows = _decode_rows(m)
    for s, seq in enumerate(steps):
        for st in seq:
            assert rows[st.forward_pass] == [(s, st.position + i) for i in range(st.proposed + 1)]
        assert max(q for f in rows for t, q in rows[f] if t == s) == len(PROMPTS[s]) + NEW - 2
    assert set(rows) == {st.forward_pass for st in every}  # the prompt passes hold no decode row
    assert not any(rec.meta.get("phase") or rec.meta.get("decode_step") is not None for rec in m.tensors)
    # every generated token's logprob at its own position, after the prompt's; the observer check is bit-exact
    lp = [r for r in m.tensors if r.name == LOGPROB_VALUE]
    for s, p in enumerate(PROMPTS):
        pos = sorted(int(x) for r in lp for x, q in zip(r.row_positions(), r.row_sequence_ids()) if q == s)
        assert pos == list(range(1, len(p) + NEW))
    assert stdout.startswith("observer check: bit-exact"), stdout


@pytest.mark.slow
def test_the_greedy_tokens_are_a_plain_decodes(dumps):
    root, _ = dumps
    spec, plain = load_manifest(root / "spec"), load_manifest(root / "plain")
    assert spec.extra[GENERATED_IDS] == plain.extra[GENERATED_IDS]
    assert [len(g) for g in spec.extra[GENERATED_IDS]] == [NEW] * len(PROMPTS)
    report = compare_dumps(root / "plain", root / "spec")  # one row per position each side: kept rows only
    assert report.passed, report.first_divergent
    assert report.logprobs is not None and report.logprobs.passed


@pytest.mark.slow
def test_the_kept_rows_match_the_tokens_from_prefill(dumps):
    root, _ = dumps
    r = run_cli("comparator", root / "prefill", root / "spec", "--quiet", "--json", root / "v.json")
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads((root / "v.json").read_text())
    assert v["decode"]["passed"] and v["decode"]["steps"] == len(PROMPTS) * (NEW - 1)
    report = compare_dumps(root / "prefill", root / "spec")
    assert {t.sequence: t.shape[0] for t in report.tensors} == {s: len(p) + NEW - 1 for s, p in enumerate(PROMPTS)}


@pytest.mark.slow
def test_the_steps_are_what_transformers_accepted(tmp_path, monkeypatch):
    """The steps derived from the recorded rows against transformers' own count of each verify pass's matches."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    seen: list[tuple[int, int, int]] = []  # (tokens after the pass, drafts verified, drafts matched)
    update = PromptLookupCandidateGenerator.update_candidate_strategy

    def spy(self, input_ids, scores, num_matches):
        seen.append((int(input_ids.shape[1]), int(scores.shape[1]) - 1, int(num_matches)))
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(PromptLookupCandidateGenerator, "update_candidate_strategy", spy)
    model, _ = tiny_llama()
    dump_sequences(model, [list(p) for p in PROMPTS], _spec_cfg(tmp_path / "spec"))
    steps = steps_of(load_manifest(tmp_path / "spec").extra)
    assert steps is not None
    for s, seq in enumerate(steps):
        calls, seen = seen[: len(seq) + 1], seen[len(seq) + 1 :]
        assert calls[0] == (len(PROMPTS[s]) + 1, 0, 0)  # the prompt pass: no drafts
        end = len(PROMPTS[s]) + NEW - 2  # the last position fed
        for st, (tokens, drafts, matches) in zip(seq, calls[1:], strict=True):
            assert st.accepted == matches and tokens == st.position + matches + 2
            assert st.proposed == min(drafts, end - st.position)  # drafts past the N tokens are not recorded
    assert not seen


def _seeded_attention(model):
    """Layer 2's attention adds to its output on the rows of draft index >= 2 of a verify pass: positions 2 or more past
    the pass's first, in a pass that does not start at 0 (a prompt pass); a one-row decode step never has one."""
    attn = model.model.layers[BUG_LAYER].self_attn
    forward = attn.forward

    def seeded(hidden_states, *args, **kwargs):
        out, weights = forward(hidden_states, *args, **kwargs)
        pos = kwargs["position_ids"]
        hit = ((pos - pos[..., :1]) >= 2) & (pos[..., :1] > 0)
        return out + 0.5 * hit[..., None].to(out.dtype) * out.abs().mean(), weights

    return attn, seeded


@pytest.mark.slow
def test_a_bug_in_verify_rows_of_draft_index_2_is_named_there_and_a_plain_decode_passes(tmp_path, monkeypatch):
    model, _ = tiny_llama()
    attn, seeded = _seeded_attention(model)
    monkeypatch.setattr(attn, "forward", seeded)
    dump_sequences(model, [list(p) for p in PROMPTS], _spec_cfg(tmp_path / "spec"))
    cfg = _prefill_of(tmp_path / "spec", tmp_path / "prefill")  # the same model: a prefill pass starts at 0
    dump_sequences(model, [list(s) for s in cfg.input_ids], cfg)
    dump_sequences(model, [list(p) for p in PROMPTS], _cfg(tmp_path / "plain"))
    cfg = _prefill_of(tmp_path / "plain", tmp_path / "plain-prefill")
    dump_sequences(model, [list(s) for s in cfg.input_ids], cfg)

    steps = steps_of(load_manifest(tmp_path / "spec").extra)
    assert steps is not None
    first_kept = {  # per sequence, the first kept row of draft index 2: the first the bug reaches
        s: next(st.position + 2 for st in seq if st.accepted >= 2)
        for s, seq in enumerate(steps)
        if any(st.accepted >= 2 for st in seq)
    }
    assert first_kept, steps
    report = compare_dumps(tmp_path / "prefill", tmp_path / "spec")
    fd = report.first_divergent
    assert not report.passed and fd is not None
    assert fd.layer == BUG_LAYER + 1 and fd.name == f"model.layers.{BUG_LAYER + 1}.self_attn.input", fd
    assert fd.token == first_kept[fd.sequence] and sorted(fd.failing_sequences) == sorted(first_kept)
    assert fd.phase == "decode" and fd.decode_step == fd.token - len(PROMPTS[fd.sequence])
    if "draft_index" in {f.name for f in dataclasses.fields(fd)}:  # the comparator names the verify step too
        index = next(i for i, st in enumerate(steps[fd.sequence]) if st.position + 2 == fd.token)
        assert (fd.draft_index, fd.verify_step) == (2, index)
    assert compare_dumps(tmp_path / "plain-prefill", tmp_path / "plain").passed  # one-row decode steps: no bug


@pytest.mark.slow
def test_the_cli_refuses_the_cache_points_in_one_line_and_a_min_ngram(tmp_path):
    r = run_cli(
        "dumper",
        "run",
        "--new-tokens",
        "4",
        "--speculative",
        SETTING,
        "--points",
        "input,k_cache,v_cache",
        "--out",
        tmp_path / "x",
    )
    words = "not recorded with transformers' prompt lookup yet"
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()
    with pytest.raises(UsageError, match="takes no min="):  # transformers matches n-grams down to one token
        RunConfig(out=str(tmp_path / "y"), new_tokens=4, speculative=parse_speculative("ngram:k=3,min=2"))


def test_the_seeded_bug_fires_only_on_verify_rows_of_draft_index_2_and_more():
    """The truth, by hand: the seed's mask over a prompt pass, a one-row decode step and a verify pass of 4 rows."""
    model, _ = tiny_llama()
    attn, seeded = _seeded_attention(model)
    hidden = torch.randn(1, 4, model.config.hidden_size)
    emb = model.model.rotary_emb
    for first, n, hit in ((0, 4, []), (30, 1, []), (30, 4, [2, 3])):
        pos = torch.arange(first, first + n)[None, :]
        x = hidden[:, :n]
        with torch.inference_mode():
            clean, _ = attn(x, position_embeddings=emb(x, pos), attention_mask=None, position_ids=pos)
            got, _ = seeded(x, position_embeddings=emb(x, pos), attention_mask=None, position_ids=pos)
        assert [i for i in range(n) if not torch.equal(clean[0, i], got[0, i])] == hit
