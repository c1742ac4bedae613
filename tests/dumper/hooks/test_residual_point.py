"""The ``residual`` capture point: the hidden state entering each decoder layer, before its norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dumper
from dumper.errors import UsageError
from dumper.format import PAD_SEQUENCE, DumpReader, load_manifest
from dumper.hooks import families
from dumper.hooks.layers import parse_points
from dumper.prefill.forward import pad_batch
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import run_cli, tiny_llama

TEXT = "Inference engines change daily; each change can shift numerics without an error. "


def _by_name(out):
    reader = DumpReader(out)
    return reader, {(r.name, r.forward_pass): r for r in reader.manifest.tensors}


def _tensor(reader, rec):
    return torch.from_numpy(np.array(reader.array(rec)))


def test_residual_is_the_stream_before_each_norm_and_ends_at_the_final_norm(tmp_path):
    model, tok = tiny_llama()
    ids, mask = pad_batch([tok.encode(TEXT)[:30], tok.encode(TEXT[9:])[:21]], side="right")
    out = tmp_path / "d"
    with torch.inference_mode(), dumper.capture(model, out, layers="all", points=("input", "residual")):
        logits = model(input_ids=ids, attention_mask=mask).logits
    reader, recs = _by_name(out)
    m = reader.manifest
    n = model.config.num_hidden_layers
    assert m.capture_signature["points"] == ["input", "residual"]
    assert m.capture_signature["layers"] == list(range(n))
    residual = {r.layer: r for r in m.tensors if r.point == "residual"}
    assert {k: r.name for k, r in residual.items()} == {
        **{i: f"model.layers.{i}.residual" for i in range(n)},
        n: "model.norm.residual",
    }
    with torch.inference_mode():
        assert torch.equal(_tensor(reader, residual[0]), model.model.embed_tokens(ids))
        for i in range(n):
            attn_in = recs[(f"model.layers.{i}.self_attn.input", 0)]
            res = _tensor(reader, residual[i])
            assert torch.equal(_tensor(reader, attn_in), model.model.layers[i].input_layernorm(res))
            assert attn_in.positions == residual[i].positions
            assert attn_in.sequence_ids == residual[i].sequence_ids
        final = model.lm_head(model.model.norm(_tensor(reader, residual[n])))
    assert torch.equal(final, logits)
    assert PAD_SEQUENCE in residual[n].row_sequence_ids()  # padding rows are labelled as for the input point


def test_chunked_batched_residual_rows_carry_the_input_points_metadata(tmp_path):
    model, tok = tiny_llama()
    seqs = [tok.encode(TEXT)[:23], tok.encode(TEXT[5:])[:17], tok.encode(TEXT[11:])[:12]]
    cfg = RunConfig(
        out=str(tmp_path / "d"), layers="1,-1", points=parse_points("residual,input"), chunk_size=8, batch_size=2
    )
    m = dump_sequences(model, seqs, cfg)
    assert m.capture_signature["points"] == ["input", "residual"] and m.capture_signature["layers"] == [1, 7]
    for rec in m.tensors:
        if rec.point == "residual" and rec.layer < 8:
            twin = next(
                r
                for r in m.tensors
                if r.forward_pass == rec.forward_pass and r.name == f"model.layers.{rec.layer}.self_attn.input"
            )
            assert (rec.positions, rec.sequence_ids, rec.shape) == (twin.positions, twin.sequence_ids, twin.shape)
    final = [r for r in m.tensors if r.name == "model.norm.residual"]
    assert {r.layer for r in final} == {8} and len(final) == 3 + 2  # chunks of 8: batch [23, 17], batch [12]
    assert sorted(set(np.concatenate([r.row_sequence_ids() for r in final]).tolist()) - {PAD_SEQUENCE}) == [0, 1, 2]


def test_default_points_are_input_only(tmp_path):
    model, tok = tiny_llama()
    assert RunConfig(out="x").points == ("input",)
    with torch.inference_mode(), dumper.capture(model, tmp_path / "d", layers="last"):
        model(torch.tensor([tok.encode(TEXT)[:9]]))
    m = load_manifest(tmp_path / "d")
    assert [r.name for r in m.tensors] == ["model.layers.7.self_attn.input"]
    assert m.capture_signature["points"] == ["input"]
    with torch.inference_mode(), dumper.capture(model, tmp_path / "r", layers="0", points="residual"):
        model(torch.tensor([tok.encode(TEXT)[:9]]))
    assert [r.name for r in load_manifest(tmp_path / "r").tensors] == ["model.layers.0.residual"]  # last not selected


def test_bad_points_are_usage_errors(tmp_path):
    model, _ = tiny_llama()
    for bad in ("bogus", "input,resid", (), ""):
        with pytest.raises(UsageError, match="choose from input, residual"):
            dumper.capture(model, tmp_path / "d", points=bad)
    with pytest.raises(UsageError, match="modules"):
        dumper.capture(model, tmp_path / "d", points="residual", modules="model.layers.*.mlp")
    with pytest.raises(UsageError, match="engine"):
        RunConfig(out="x", points=("residual",), engine="vllm")

    class NoResidual(families.HFFamily):
        name = "noresidual"
        residual = False

        @classmethod
        def matches(cls, m):
            return m is model

    families.register(NoResidual)
    try:
        with pytest.raises(UsageError, match="noresidual model family does not say"):
            dumper.capture(model, tmp_path / "d", points=("input", "residual"))
    finally:
        families._REGISTRY.remove(NoResidual)
    r = run_cli("dumper", "run", "--out", tmp_path / "cli", "--points", "input,bogus", "--quiet")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'bogus'" in r.stderr and not (tmp_path / "cli").exists()
