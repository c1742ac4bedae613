"""``python -m dumper run --new-tokens N`` and its counterpart ``--tokens-from``, on the tiny HF Llama.

Real runs only: greedy decode through the model's own KV cache (eager, padded batches on either
side, chunked prompt passes, ``--compile`` through the tap), the rows each decode step writes
(position, sequence, phase, step), the generated ids and decode logprobs in the manifest, and the
prefill counterpart that holds the same positions. A bug seeded only in decode steps (layer 1's
output at position 45 when a pass feeds one token) is named at layer 2, token 45, decode step 5,
and is invisible to a prefill of the same tokens; the truth is checked first with plain hooks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from comparator import compare_dumps
from dumper.format import LOGPROB_VALUE, load_manifest
from dumper.format.decode import DECODE, GENERATED_IDS, NEXT_IDS, PROMPT_LENGTHS, TOKENS_FROM, record_phase
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, dump_sequences, run_dump, tokens_from
from tests.conftest import run_cli, tiny_llama

PROMPTS = ([1] + [(7 * i) % 250 + 3 for i in range(39)], [1, 17, 33, 90, 5, 61, 7, 140, 9, 12, 44])
"""A 40-token and an 11-token prompt: a padded batch holds both."""
NEW = 12
SPEC = LogprobSpec(top_k=3)
BUG_LAYER, BUG_AT = 1, 45
"""The seeded decode-only bug: decoder layer 1's output at position 45, in a pass that feeds one token."""


def _decode_bug(module, args, kwargs, output):
    """Adds to the hidden state at position BUG_AT only in one-token passes (a shape, not a data branch)."""
    hidden = output[0] if isinstance(output, tuple) else output
    if hidden.shape[1] == 1:
        at = (kwargs["position_ids"] == BUG_AT).to(hidden.dtype)[..., None]
        hidden.add_(0.5 * at * hidden.abs().mean())
    return output


def _decode(out, **kw) -> RunConfig:
    return RunConfig(out=str(out), input_ids=PROMPTS, layers="all", logprobs=SPEC, new_tokens=NEW, **kw)


def _counterpart(decode, out, **kw) -> RunConfig:
    return tokens_from(RunConfig(out=str(out), layers="all", logprobs=SPEC, **kw), str(decode))


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """(decode dump, its --tokens-from prefill): one prompt per pass, eager."""
    root = tmp_path_factory.mktemp("decode")
    run_dump(_decode(root / "decode"))
    run_dump(_counterpart(root / "decode", root / "prefill"))
    return root / "decode", root / "prefill"


def test_every_decode_step_writes_its_rows_at_its_position_with_its_step(eager):
    decode, _ = eager
    m = load_manifest(decode)
    generated = m.extra[GENERATED_IDS]
    assert m.extra["job"] == "decode" and m.extra["new_tokens"] == NEW
    assert [len(g) for g in generated] == [NEW, NEW] and m.extra["input_ids"] == [list(p) for p in PROMPTS]
    steps: dict[tuple[int, int], set[int]] = {}
    for rec in m.tensors:
        phase, step = record_phase(rec.meta)
        if rec.layer is None or phase != DECODE:
            continue
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        assert rec.shape[:-1] == (1, 1) and pos[0] == len(PROMPTS[seq[0]]) + step
        steps.setdefault((int(seq[0]), rec.layer), set()).add(step)
    assert set(steps) == {(s, layer) for s in (0, 1) for layer in range(8)}
    assert all(v == set(range(NEW - 1)) for v in steps.values())  # the last token is chosen, never fed
    # logprobs: every prompt position from 1, then each generated token at its own position
    lp = [r for r in m.tensors if r.name == LOGPROB_VALUE]
    for s, p in enumerate(PROMPTS):
        pos = sorted(int(x) for r in lp for x, q in zip(r.row_positions(), r.row_sequence_ids()) if q == s)
        assert pos == list(range(1, len(p) + NEW))


def test_the_counterpart_feeds_the_prompt_and_the_tokens_fed_back(eager):
    decode, prefill = eager
    d, p = load_manifest(decode), load_manifest(prefill)
    gen = d.extra[GENERATED_IDS]
    assert p.extra["input_ids"] == [list(q) + g[:-1] for q, g in zip(PROMPTS, gen)]
    assert p.extra[NEXT_IDS] == [[g[-1]] for g in gen] and p.extra[PROMPT_LENGTHS] == [len(q) for q in PROMPTS]
    assert p.extra[TOKENS_FROM] == str(decode)
    assert not any(r.meta for r in p.tensors)  # a prefill: no row says decode


def test_decode_matches_a_prefill_of_the_same_tokens_in_fp32(eager):
    decode, prefill = eager
    report = compare_dumps(prefill, decode)
    assert report.passed, report.first_divergent
    assert report.matched == 8 * len(PROMPTS) and not report.unmatched_baseline and not report.unmatched_target
    assert {t.sequence: t.shape[0] for t in report.tensors} == {s: len(p) + NEW - 1 for s, p in enumerate(PROMPTS)}
    assert report.decode is not None and report.decode.steps == 2 * (NEW - 1) and report.decode.passed
    assert report.logprobs is not None and report.logprobs.passed
    assert report.logprobs.compared_positions == sum(len(p) + NEW - 1 for p in PROMPTS)  # the last generated token too
    assert compare_dumps(decode, prefill).passed  # either side may be the baseline


@pytest.mark.parametrize("side,chunk", [("right", None), ("left", None), ("right", 16)])
def test_padded_and_chunked_decode_batches_match_one_prompt_at_a_time(eager, tmp_path, side, chunk):
    decode, prefill = eager
    run_dump(_decode(tmp_path / "batched", batch_size=2, padding_side=side, chunk_size=chunk))
    m = load_manifest(tmp_path / "batched")
    assert m.extra[GENERATED_IDS] == load_manifest(decode).extra[GENERATED_IDS]
    for base in (decode, prefill):
        report = compare_dumps(base, tmp_path / "batched")
        assert report.passed and report.matched == 8 * len(PROMPTS), report.first_divergent


def test_the_plain_hooks_see_the_decode_only_bug_where_the_test_expects_it():
    """The truth, by hand: layer 2's input differs from a prefill of the same tokens at position 45 of the
    decode steps only; layer 1's input and every earlier position agree within fp32 rounding."""
    model, _ = tiny_llama()
    seen: dict[tuple[str, int], dict[int, torch.Tensor]] = {}

    def keep(layer):
        def hook(module, args, kwargs):
            x, pos = kwargs.get("hidden_states", args[0] if args else None), kwargs["position_ids"]
            kind = "decode" if x.shape[1] == 1 else "prefill"
            for j, p in enumerate(pos[0].tolist()):
                seen.setdefault((kind, layer), {})[p] = x[0, j].detach().clone()

        return hook

    handles = [model.model.layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in (1, 2)]
    handles.append(model.model.layers[BUG_LAYER].register_forward_hook(_decode_bug, with_kwargs=True))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache, tokens = out.past_key_values, []
        for step in range(NEW - 1):
            tok = out.logits[:, -1].argmax(-1)
            tokens.append(int(tok))
            pos = torch.tensor([[len(PROMPTS[0]) + step]])
            out = model(input_ids=tok[:, None], position_ids=pos, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        seen.pop(("prefill", 1)), seen.pop(("prefill", 2))
        model(input_ids=torch.tensor([PROMPTS[0] + tokens]), use_cache=False)
    for h in handles:
        h.remove()

    def rel(a, b):
        return float((a - b).pow(2).sum() / (a.pow(2).sum() + b.pow(2).sum()))

    for layer in (1, 2):
        diffs = {p: rel(x, seen["prefill", layer][p]) for p, x in seen["decode", layer].items()}
        big = [p for p, d in diffs.items() if d > 1e-9]
        assert big == ([BUG_AT] if layer == BUG_LAYER + 1 else []), (layer, diffs)


def test_a_decode_only_bug_is_named_at_its_layer_token_and_step_and_a_prefill_cannot_see_it(tmp_path):
    model, _ = tiny_llama()
    handle = model.model.layers[BUG_LAYER].register_forward_hook(_decode_bug, with_kwargs=True)
    try:
        dump_sequences(model, [list(p) for p in PROMPTS], _decode(tmp_path / "buggy"))
        cfg = _counterpart(tmp_path / "buggy", tmp_path / "buggy-prefill")  # the same model, prefill only
        dump_sequences(model, [list(s) for s in cfg.input_ids], cfg)
    finally:
        handle.remove()
    cfg = _counterpart(tmp_path / "buggy", tmp_path / "prefill")
    dump_sequences(model, [list(s) for s in cfg.input_ids], cfg)
    report = compare_dumps(tmp_path / "prefill", tmp_path / "buggy")
    fd = report.first_divergent
    assert not report.passed and fd is not None
    assert (fd.layer, fd.token, fd.sequence) == (BUG_LAYER + 1, BUG_AT, 0)
    assert fd.phase == DECODE and fd.decode_step == BUG_AT - len(PROMPTS[0])
    # bit-identical prompt rows, then decode rows at fp32 rounding: no step before the bug (issue 34's onset)
    assert (fd.onset, fd.onset_layer) == (BUG_AT, BUG_LAYER + 1), (fd.onset, fd.onset_method, fd.onset_layer)
    assert fd.failing_sequences == [0]  # the short prompt never reaches position 45 in a decode step
    wrote = [
        r
        for r in load_manifest(tmp_path / "buggy").tensors
        if r.name == fd.name and record_phase(r.meta) == (DECODE, fd.decode_step) and 0 in r.row_sequence_ids().tolist()
    ]
    assert [r.forward_pass for r in wrote] == [fd.forward_pass]  # the decode pass that wrote the row
    assert fd.note == f"token {BUG_AT} = decode step {fd.decode_step} of the target"
    assert compare_dumps(tmp_path / "prefill", tmp_path / "buggy-prefill").passed  # two prefills agree
    data = report.to_json()["first_divergent"]
    assert data["phase"] == "decode" and data["decode_step"] == 5
    r = run_cli("comparator", tmp_path / "prefill", tmp_path / "buggy", "--html", tmp_path / "r.html", "--quiet")
    assert r.returncode == 1 and ", decode step 5," in r.stdout, r.stdout
    html = (tmp_path / "r.html").read_text()  # the heatmap sets the prompt part and the decode part apart
    assert 'id="heatmap-decode"' in html and f"decode steps from position {len(PROMPTS[0])}" in html


@pytest.mark.slow
def test_the_cli_decodes_and_its_counterpart_passes_and_names_the_phase(tmp_path):
    ids = [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]
    r = run_cli(
        "dumper",
        "run",
        *ids,
        "--new-tokens",
        "4",
        "--layers",
        "first,last",
        "--logprobs",
        "--top-k",
        "2",
        "--observer-check",
        "--out",
        tmp_path / "d",
        "--quiet",
    )
    assert r.returncode == 0 and r.stdout.startswith("observer check: bit-exact"), r.stdout + r.stderr
    values = sum(len(p) - 1 + 4 for p in PROMPTS) * 3  # each scored token's logprob and its top-2
    assert f"({values} values: logprobs)" in r.stdout
    r = run_cli(
        "dumper",
        "run",
        "--tokens-from",
        tmp_path / "d",
        "--layers",
        "first,last",
        "--logprobs",
        "--top-k",
        "2",
        "--out",
        tmp_path / "p",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("comparator", tmp_path / "p", tmp_path / "d", "--quiet", "--json", tmp_path / "v.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode: 6 decode steps compared over 2 sequences" in r.stdout
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["decode"] == {"passed": True, "sequences": 2, "steps": 6, "forks": [], "missing": []}


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,words",
    [
        (("--tokens-from", "{d}", "--input-ids", "1,2,3"), "--tokens-from takes its prompts from the dump"),
        (("--tokens-from", "{p}"), "not a decode dump"),
        (("--tokens-from", "{d}", "--new-tokens", "2"), "drop --new-tokens"),
        (("--new-tokens", "-1"), "--new-tokens must be >= 0"),
        (("--new-tokens", "2", "--engine", "onnxruntime-genai", "--model", "{d}"), "records prompt passes only so far"),
    ],
)
def test_the_cli_refuses_what_it_cannot_decode_in_one_line(eager, tmp_path, args, words):
    decode, prefill = eager
    argv = [a.format(d=decode, p=prefill) for a in args]
    r = run_cli("dumper", "run", *argv, "--out", tmp_path / "x")
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_compiled_decode_through_the_tap_matches_eager_decode(eager, tmp_path):
    decode, _ = eager
    ids = [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]
    r = run_cli(
        "dumper",
        "run",
        "--compile",
        *ids,
        "--new-tokens",
        str(NEW),
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "3",
        "--batch-size",
        "2",
        "--out",
        tmp_path / "c",
        "--quiet",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_manifest(tmp_path / "c")
    assert m.extra["compiled"] and m.extra[GENERATED_IDS] == load_manifest(decode).extra[GENERATED_IDS]
    report = compare_dumps(decode, tmp_path / "c")
    assert report.passed and report.decode is not None and report.decode.steps == 2 * (NEW - 1)
    steps = sorted({record_phase(r.meta)[1] for r in m.tensors if record_phase(r.meta)[0] == DECODE})
    assert steps == list(range(NEW - 1))


def test_generated_ids_are_the_greedy_choices_of_the_recorded_logprobs(eager):
    """Temperature 0: each generated token is the top-1 of the distribution that chose it."""
    decode, _ = eager
    m = load_manifest(decode)
    from comparator.logprobs.sources.dump import dump_logprobs
    from dumper.format import DumpReader

    src = dump_logprobs(DumpReader(decode))
    for s, seq in enumerate(src.sequences):
        start = len(PROMPTS[s])
        for i, tok in enumerate(m.extra[GENERATED_IDS][s]):
            top = seq.top[start + i]
            assert seq.token_ids[start + i] == tok and top[0][0] == tok
            assert np.isclose(seq.logprobs[start + i], top[0][1])
