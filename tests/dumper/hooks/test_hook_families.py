"""The hook API's family adapters on real models: chunked prefill and decoding align without extra calls,
a user-registered family hooks its own module names, and no engine is imported for an HF model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from transformers import DynamicCache

import dumper
from comparator import compare_dumps
from dumper.format import load_manifest
from dumper.hooks import families, rows
from dumper.prefill.presets import load_model
from tests.conftest import ROOT, run_cli

PROMPTS = [
    [1, 17, 43, 88, 9, 120, 77, 5, 64, 31, 200, 12, 150, 3, 99, 41],
    [1, 250, 8, 19, 71, 33, 140, 22, 6, 180, 90, 44, 13, 60, 101, 2],
]


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny-llama")
    return model


@pytest.fixture(scope="module")
def one_pass(tiny, tmp_path_factory):
    """The reference: both prompts in one [2, 16] pass without a cache."""
    out = tmp_path_factory.mktemp("ref") / "one"
    with torch.inference_mode(), dumper.capture(tiny, out, layers="all"):
        tiny(input_ids=torch.tensor(PROMPTS), use_cache=False)
    return out


def _chunked(model, out, cuts):
    """Prefill both prompts in chunks ending at ``cuts`` over one DynamicCache; no set_sequence_ids."""
    ids = torch.tensor(PROMPTS)
    cache = DynamicCache()
    with torch.inference_mode(), dumper.capture(model, out, layers="all"):
        start = 0
        for end in cuts:
            model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True)
            start = end
    return out


def test_chunked_prefill_over_one_cache_continues_its_sequences(tiny, one_pass, tmp_path):
    out = _chunked(tiny, tmp_path / "chunks", (5, 11, 16))
    m = load_manifest(out)
    assert {t.forward_pass for t in m.tensors} == {0, 1, 2}
    for t in m.tensors:
        assert sorted(set(t.row_sequence_ids().tolist())) == [0, 1], t
    report = compare_dumps(one_pass, out)
    assert report.passed and report.matched == 8 * 2 and not report.unmatched_target, report  # 8 layers
    assert max(t.rel_diff for t in report.tensors) < 1e-5


def test_chunked_prefill_compares_through_the_cli(one_pass, tiny, tmp_path):
    out = _chunked(tiny, tmp_path / "chunks", (8, 16))
    r = run_cli("comparator", one_pass, out, "--quiet", cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_pass_that_starts_over_gets_new_sequences(tiny, tmp_path):
    """Two prompts of one batch size, each from position 0: two sequences, not one of repeated positions."""
    ids = torch.tensor(PROMPTS)
    with torch.inference_mode(), dumper.capture(tiny, tmp_path / "d", layers="first"):
        tiny(input_ids=ids[:1], use_cache=False)
        tiny(input_ids=ids[1:], use_cache=False)
        cache = DynamicCache()
        tiny(input_ids=ids[:1, :4], past_key_values=cache, use_cache=True)  # a third prompt, then its next chunk
        tiny(input_ids=ids[:1, 4:9], past_key_values=cache, use_cache=True)
    seqs = [t.row_sequence_ids().tolist() for t in load_manifest(tmp_path / "d").tensors]
    assert seqs == [[0] * 16, [1] * 16, [2] * 4, [2] * 5]


def test_decode_steps_continue_the_prompt(tiny, tmp_path):
    """generate(): prefill and each decode step are one sequence, equal to one prefill of prompt + output."""
    ids = torch.tensor(PROMPTS[:1])
    with torch.inference_mode(), dumper.capture(tiny, tmp_path / "gen", layers="all"):
        full = tiny.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    m = load_manifest(tmp_path / "gen")
    assert {s for t in m.tensors for s in t.row_sequence_ids().tolist()} == {0}
    with torch.inference_mode(), dumper.capture(tiny, tmp_path / "pre", layers="all"):
        tiny(input_ids=full[:, :-1], use_cache=False)  # the last generated token is never fed back
    report = compare_dumps(tmp_path / "pre", tmp_path / "gen")
    assert report.passed and report.matched == 8, report


def test_padded_rows_that_end_early_still_continue(tiny, tmp_path):
    """Right padding: the short row has no real token in the last chunk, the long one continues."""
    from dumper.prefill.forward import pad_batch

    seqs = [PROMPTS[0], PROMPTS[1][:6]]
    ids, mask = pad_batch(seqs, side="right")
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.inference_mode(), dumper.capture(tiny, tmp_path / "pad", layers="last"):
        for a, b in ((0, 8), (8, 16)):
            tiny(
                input_ids=ids[:, a:b],
                attention_mask=mask[:, :b],
                position_ids=positions[:, a:b],
                past_key_values=cache,
                use_cache=True,
            )
    with torch.inference_mode(), dumper.capture(tiny, tmp_path / "ref", layers="last"):
        for s in seqs:
            tiny(input_ids=torch.tensor([s]), use_cache=False)
    report = compare_dumps(tmp_path / "ref", tmp_path / "pad")
    assert report.passed and report.matched == 2, report


class _Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        return self.proj(x)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mixer = _Mixer(d)

    def forward(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        return x + self.mixer(x=torch.tanh(x), offset=offset)


class _Flat(nn.Module):
    """A model of another codebase: tokens flattened to [n, d], attention child 'mixer' taking ``x=``."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, tokens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, 0)
        return x


class _FlatFamily(families.FamilyAdapter):
    name = "flat"
    attention_names = ("mixer",)

    @classmethod
    def matches(cls, model):
        return isinstance(model, _Flat)

    def hidden_input(self, args, kwargs):
        return kwargs["x"]

    def pass_rows(self, args, kwargs):
        tokens, starts = args  # starts: first row of each sequence; sequence i's positions count from 0
        n = tokens.shape[0]
        seq = np.searchsorted(starts.numpy(), np.arange(n), side="right") - 1
        pos = np.arange(n) - starts.numpy()[seq]
        return rows.PassRows(
            (n,), rows.Runs(rows.as_runs(pos, n, "positions")), rows.Runs(rows.as_runs(seq, n, "sequence_ids"))
        )


def test_a_registered_family_hooks_its_own_modules_and_rows(tmp_path):
    families.register(_FlatFamily)
    try:
        torch.manual_seed(0)
        model = _Flat()
        tokens = torch.tensor([3, 4, 5, 6, 7, 8, 9])
        with torch.no_grad(), dumper.capture(model, tmp_path / "d", layers="all"):
            model(tokens, torch.tensor([0, 4]))
    finally:
        families._REGISTRY.remove(_FlatFamily)
    m = load_manifest(tmp_path / "d")
    assert [t.name for t in m.tensors] == [f"blocks.{i}.mixer.input" for i in range(3)]
    for t in m.tensors:
        assert t.shape == (7, 8)
        assert t.row_positions().tolist() == [0, 1, 2, 3, 0, 1, 2]
        assert t.row_sequence_ids().tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert families.family_for(model) is families.HFFamily  # unregistered again


@pytest.mark.slow
def test_an_hf_capture_does_not_import_an_engine(tmp_path):
    code = (
        "import sys, torch, dumper\nfrom dumper.prefill.presets import load_model\n"
        "m, _ = load_model('tiny-llama')\n"
        f"with torch.no_grad(), dumper.capture(m, {str(tmp_path / 'd')!r}, layers='first'):\n"
        "    m(input_ids=torch.tensor([[1, 2, 3]]))\n"
        "print(sorted(k for k in sys.modules if k == 'vllm' or k.startswith('vllm.')))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
