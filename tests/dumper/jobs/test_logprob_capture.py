"""Input-token logprobs as the dumper computes them, and decode <-> prefill self-consistency."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dumper.format import LOGITS, LOGPROB_TOKEN_ID, LOGPROB_TOP_ID, LOGPROB_VALUE, DumpReader, load_manifest
from dumper.jobs.selfcheck import MODES, selfcheck
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.logprobs import input_token_logprobs, row_logprobs
from dumper.prefill.run import RunConfig, run_dump
from tests.conftest import tiny_llama

# The design note's hand-computed example: vocab A, B, C, D; input [A, C, B].
SEED_LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.5, 3.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
A, B, C = 0, 1, 2


def test_seed_worked_example():
    assert torch.logsumexp(SEED_LOGITS[0], 0).item() == pytest.approx(2.50, abs=0.005)
    assert torch.logsumexp(SEED_LOGITS[1], 0).item() == pytest.approx(3.21, abs=0.005)
    out = input_token_logprobs(SEED_LOGITS, [A, C, B], top_k=2)
    assert out.token_ids == (A, C, B)
    assert out.logprobs[0] is None  # the first token has no context
    assert round(out.logprobs[1], 2) == -2.00 and round(out.logprobs[2], 2) == -0.21
    # top-2 at position 1 is the top of row 0, whatever the real token (C) is
    (id1, lp1), (id2, lp2) = out.top[1]
    assert (id1, round(lp1, 2), id2, round(lp2, 2)) == (A, -0.50, B, -1.50)


def test_logprob_start_len():
    out = input_token_logprobs(SEED_LOGITS, [A, C, B], logprob_start_len=1)
    assert out.token_ids == (C, B) and out.logprobs[0] is None and round(out.logprobs[1], 2) == -0.21


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_rows_equal_naive_log_softmax(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(300, 1000, generator=gen)).to(dtype)
    targets = torch.randint(0, 1000, (300,), generator=gen)
    got = row_logprobs(logits, targets, top_k=5, chunk_rows=64)
    naive = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(got.logprobs, naive.gather(1, targets[:, None])[:, 0], rtol=0, atol=1e-5)
    values, ids = naive.topk(5, dim=-1)
    torch.testing.assert_close(got.top_logprobs, values, rtol=0, atol=1e-5)
    assert torch.equal(got.top_ids, ids)


def _logprob_rows(path):
    """sequence -> {position: (token_id, logprob)} read back from a dump."""
    m = load_manifest(path)
    reader = DumpReader(path, m)
    out: dict[int, dict[int, tuple[int, float]]] = {}
    ids = {(r.forward_pass, r.call): r for r in m.tensors if r.name == LOGPROB_TOKEN_ID}
    for rec in (r for r in m.tensors if r.name == LOGPROB_VALUE):
        idr = ids[(rec.forward_pass, rec.call)]
        for p, s, t, v in zip(
            rec.row_positions(), rec.row_sequence_ids(), reader.array(idr)[:, 0], reader.array(rec)[:, 0], strict=True
        ):
            out.setdefault(int(s), {})[int(p)] = (int(t), float(v))
    return out


def test_dumped_logprobs_match_the_model_in_every_layout(tmp_path):
    prompts = ("The quick brown fox jumps over the lazy dog.", "Chunked prefill, batched prefill, same numbers.")
    spec = LogprobSpec(top_k=3, save_logits=True)
    for name, kw in (
        ("one", {}),
        ("chunked", {"chunk_size": 7}),
        ("batched", {"batch_size": 2, "padding_side": "left"}),
    ):
        run_dump(RunConfig(out=str(tmp_path / name), prompts=prompts, layers="last", logprobs=spec, **kw))
    model, tok = tiny_llama()
    expected = {}
    for i, p in enumerate(prompts):
        ids = tok.encode(p)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        ref = input_token_logprobs(logits, ids)
        expected[i] = {pos: (ids[pos], lp) for pos, lp in enumerate(ref.logprobs) if lp is not None}
    for name in ("one", "chunked", "batched"):
        got = _logprob_rows(tmp_path / name)
        assert got.keys() == expected.keys()
        for s in expected:
            assert got[s].keys() == expected[s].keys(), name
            for pos, (tid, lp) in expected[s].items():
                assert got[s][pos][0] == tid and got[s][pos][1] == pytest.approx(lp, abs=1e-5), (name, s, pos)
    m = load_manifest(tmp_path / "one")
    top = next(r for r in m.tensors if r.name == LOGPROB_TOP_ID)
    logits_rec = next(r for r in m.tensors if r.name == LOGITS)
    assert top.shape[1] == 3 and logits_rec.shape[1] == 384 and logits_rec.point == "logits"


def test_logprob_start_len_in_a_run(tmp_path):
    run_dump(
        RunConfig(out=str(tmp_path / "d"), prompts=("hello world",), layers="last", logprobs=LogprobSpec(start_len=5))
    )
    got = _logprob_rows(tmp_path / "d")
    assert sorted(got[0]) == list(range(6, 12))  # position 5 itself is None, as in SGLang


@pytest.fixture(scope="module")
def fp32_model():
    return tiny_llama()


@pytest.mark.parametrize("mode", MODES)
def test_selfcheck_passes_on_a_healthy_model(fp32_model, mode):
    model, tok = fp32_model
    r = selfcheck(model, tok.encode("The quick brown fox jumps over the lazy dog."), new_tokens=12, mode=mode)
    assert r.passed and r.k3_mean < 1e-9 and len(r.output_ids) == 12
    assert (r.cache_hit_tokens > r.prompt_tokens // 2) if mode != "no-cache" else r.cache_hit_tokens == 0


@pytest.mark.parametrize("mode", MODES)
def test_selfcheck_fails_when_only_the_decode_path_is_broken(mode):
    model, tok = tiny_llama()
    gen = torch.Generator().manual_seed(0)

    def decode_only_bug(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] == 1:  # one new token: a decode step, never a prefill
            hidden.add_(0.05 * torch.randn(hidden.shape, generator=gen))
        return output

    model.model.layers[3].register_forward_hook(decode_only_bug)
    r = selfcheck(model, tok.encode("The quick brown fox jumps over the lazy dog."), new_tokens=12, mode=mode)
    assert not r.passed and r.k3_mean > 1e-3
    assert np.all(np.isfinite(r.decode_logprobs))


def test_selfcheck_k3_is_stable_for_tiny_differences():
    """selfcheck scores with the comparator's k3 (``k3_summary``): d^2/2 to 1e-6 for |d| from 1e-9
    down to 1e-17, where the cancelling ``expm1(d) - d`` is off by 5e-5 (1e-12), 1% (1e-14), 100% (1e-17)."""
    from dumper.jobs import selfcheck as sc

    prefill = [-2.0, -1e-3, -1e-3, -1e-3, -1e-15, -0.5]
    decode = [-2.0 + 1e-9, -1e-3 + 1e-12, -1e-3 - 1e-14, -1e-3 + 3e-15, -1e-15 + 1e-17, -0.5]
    d = np.asarray(decode) - np.asarray(prefill)  # exact differences of nearby floats
    s = sc.k3_summary(prefill, decode)
    np.testing.assert_array_equal(s.delta, d)
    np.testing.assert_allclose(s.values[:5], d[:5] ** 2 / 2, rtol=1e-6)
    assert s.values[5] == 0.0 and s.argmax == 0 and s.max_abs_err == pytest.approx(1e-9, rel=1e-6)
    assert s.mean == pytest.approx(float(np.mean(d**2 / 2)), rel=1e-6)
    naive = np.expm1(d[1:5]) - d[1:5]
    assert np.all(np.abs(naive / (d[1:5] ** 2 / 2) - 1) > 1e-5)  # what the old form gave instead


def test_selfcheck_k3_matches_its_logprobs(fp32_model):
    """The k3 a real selfcheck reports is the comparator's k3 of its own decode and prefill logprobs."""
    from comparator.logprobs import k3

    model, tok = fp32_model
    r = selfcheck(model, tok.encode("The quick brown fox jumps over the lazy dog."), new_tokens=8, mode="no-cache")
    vals = k3(np.asarray(r.decode_logprobs) - np.asarray(r.prefill_logprobs))
    assert r.k3_mean == pytest.approx(float(vals.mean()), rel=1e-12, abs=0.0)
    assert r.k3_max == float(vals.max()) and r.k3_max_position == r.prompt_tokens + int(np.argmax(vals))


@pytest.mark.slow
def test_selfcheck_cli(cli, tmp_path):
    r = cli(
        "dumper",
        "selfcheck",
        "--new-tokens",
        "6",
        "--prompt",
        "hello there, decode path",
        "--json",
        tmp_path / "s.json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["passed"] and [run["mode"] for run in data["runs"]] == list(MODES)
    r = cli("dumper", "selfcheck", "--new-tokens", "1", "--mode", "decode-hit")
    assert r.returncode == 2 and "decode-hit needs --new-tokens >= 2" in r.stderr
