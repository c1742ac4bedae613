"""Different execution layouts of the same tokens: chunked prefill and padded batches.

Baselines are one prompt per forward pass; targets chunk through the real HF KV cache or pad
prompts of different lengths into one batch. Benign layout changes must pass in float32;
injected bugs must be localized to their layer, sequence and first token.
"""

from __future__ import annotations

import json

import pytest
import torch

import dumper
from comparator import compare_dumps
from dumper.prefill.forward import cache_kwarg, pad_batch, prefill
from dumper.prefill.run import RunConfig, run_dump
from tests.conftest import tiny_llama

PROMPTS = (
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 3,
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Chunked prefill must not change a single number that the model computes, ever.",
)


@pytest.fixture(scope="module")
def one_pass(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "dump"
    run_dump(RunConfig(out=str(out), prompts=PROMPTS, layers="all"))
    return out


@pytest.mark.parametrize("chunk", [64, 50, 7])
def test_chunked_prefill_matches_one_pass(one_pass, tmp_path, chunk):
    run_dump(RunConfig(out=str(tmp_path / "chunked"), prompts=PROMPTS, layers="all", chunk_size=chunk))
    report = compare_dumps(one_pass, tmp_path / "chunked")
    assert report.passed, report.first_divergent
    assert report.matched == 8 * len(PROMPTS) and not report.unmatched_baseline and not report.unmatched_target
    lengths = {t.sequence: t.shape[0] for t in report.tensors}
    assert lengths == {i: len(p.encode()) + 1 for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("side,attn", [("right", "eager"), ("left", "eager"), ("right", "sdpa"), ("left", "sdpa")])
def test_padded_batch_matches_single_prompts(one_pass, tmp_path, side, attn):
    run_dump(RunConfig(out=str(tmp_path / "base"), prompts=PROMPTS, layers="all", attn=attn))
    run_dump(
        RunConfig(
            out=str(tmp_path / "batched"), prompts=PROMPTS, layers="all", batch_size=3, padding_side=side, attn=attn
        )
    )
    report = compare_dumps(tmp_path / "base", tmp_path / "batched")
    assert report.passed, report.first_divergent
    assert report.matched == 8 * len(PROMPTS)


def test_batched_and_chunked_together(one_pass, tmp_path):
    run_dump(RunConfig(out=str(tmp_path / "both"), prompts=PROMPTS, layers="all", batch_size=2, chunk_size=40))
    report = compare_dumps(one_pass, tmp_path / "both")
    assert report.passed and report.matched == 8 * len(PROMPTS)
    # and the other way round: the chunked dump is the baseline
    assert compare_dumps(tmp_path / "both", one_pass).passed


def test_chunked_prefill_really_uses_the_kv_cache(tmp_path):
    model, tok = tiny_llama()
    kw = cache_kwarg(model)
    assert kw in ("cache", "past_key_values")
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    lengths = []
    with torch.inference_mode():
        cache = None
        for start in range(0, 90, 30):
            out = model(input_ids=ids[:, start : start + 30], use_cache=True, **{kw: cache})
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            lengths.append(cache.get_seq_length())
    assert lengths == [30, 60, 90]


def test_kv_cache_corruption_at_a_chunk_boundary_is_localized(one_pass, tmp_path):
    """One KV-cache row of layer 3 corrupted after it is written: layer 4, token 64 = chunk 2's start."""
    model, tok = tiny_llama()
    kw = cache_kwarg(model)
    with torch.inference_mode(), dumper.capture(model, tmp_path / "bad", layers="all") as cap:
        for i, prompt in enumerate(PROMPTS):
            cap.set_sequence_ids([i])
            ids = torch.tensor([tok.encode(prompt)])
            cache = None
            for start in range(0, ids.shape[1], 64):
                out = model(input_ids=ids[:, start : start + 64], use_cache=True, **{kw: cache})
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                if i == 0 and start == 0:
                    cache.layers[3].values[:, :, 63, :] += 5.0  # the row of token 63, written by chunk 1
    report = compare_dumps(one_pass, tmp_path / "bad")
    fd = report.first_divergent
    assert fd is not None and fd.layer == 4 and fd.sequence == 0 and fd.token == 64
    assert fd.note == "token 64 = start of chunk 2/4 of the target (pass 1)"
    assert fd.failing_ranges[0][0] == 64 and fd.failing_sequences == [0]
    assert all(t.passed for t in report.tensors if t.layer <= 3 or t.sequence != 0)


def test_bug_in_one_sequence_of_a_batch_names_that_sequence(one_pass, tmp_path):
    model, tok = tiny_llama()
    gen = torch.Generator().manual_seed(0)

    def corrupt(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[1, 20] += 0.3 * torch.randn(hidden.shape[-1], generator=gen)  # batch row 1 = prompt 1, token 20
        return output

    handle = model.model.layers[2].register_forward_hook(corrupt)
    seqs = [tok.encode(p) for p in PROMPTS]
    with torch.inference_mode(), dumper.capture(model, tmp_path / "bad", layers="all") as cap:
        cap.set_sequence_ids([0, 1, 2])
        ids, mask = pad_batch(seqs, side="right")
        prefill(model, ids, mask, chunk_size=None)
    handle.remove()
    report = compare_dumps(one_pass, tmp_path / "bad")
    fd = report.first_divergent
    assert fd is not None and (fd.layer, fd.sequence, fd.token) == (3, 1, 20) and fd.failing_sequences == [1]
    assert fd.note is None  # not a chunked layout
    assert all(t.passed for t in report.tensors if t.sequence != 1)


@pytest.mark.slow
def test_cli_chunked_vs_one_pass_and_report(cli, one_pass, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    r = cli(
        "dumper",
        "run",
        "--out",
        tmp_path / "ch",
        "--prompts",
        prompts,
        "--layers",
        "all",
        "--chunk-size",
        "33",
        "--batch-size",
        "2",
    )
    assert r.returncode == 0, r.stderr
    r = cli("comparator", one_pass, tmp_path / "ch", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["matched"] == 24
    assert sorted({t["sequence"] for t in report["tensors"]}) == [0, 1, 2]
