"""The KV cache points on the tiny HF Llama: what each layer stored, the read-back check, and the verdicts.

The truth first, by hand: the ``k_cache`` rows are ``k_proj`` of the layer's recorded input with
RoPE at each token's position, and ``v_cache`` is ``v_proj``, both within fp32 rounding (a
plain computation from the model's own modules). Then:

- a cache entry corrupted between two passes (sequence 0, position 2, layer 1) is named by the
  read-back check: the sequence, the query's position and the position read;
- a bug in layer 1's key projection at token 5 is named at ``k_cache`` with the layer's input
  agreeing (a cache fault), a bug in layer 0's MLP at layer 1's input (upstream of its cache);
- fp8 rounding predicts the error of a real fp8 round trip, and a wrong scale is far beyond it;
- hostile ``extra.kv_cache`` fields are exit 2 naming the field.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from comparator import compare_dumps
from comparator.hidden.kv_cache import FP8_FACTOR, fp8_rounding
from dumper.format import load_manifest
from dumper.format.reader import DumpReader
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import forward_hook, prompt_ids, run_cli, tiny_llama

POINTS = "input,k_cache,v_cache"


def _rows(path, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, positions, sequences) of every record named ``name``, in record order."""
    reader, rows, pos, seq = DumpReader(path), [], [], []
    for t in load_manifest(path).tensors:
        if t.name == name:
            rows.append(reader.rows(t))
            pos.append(t.row_positions())
            seq.append(t.row_sequence_ids())
    return np.concatenate(rows), np.concatenate(pos), np.concatenate(seq)


def _run(model, tmp_path, name: str, seqs, **kw) -> str:
    out = str(tmp_path / name)
    dump_sequences(model, seqs, RunConfig(out=out, layers="all", points=POINTS, **kw))
    return out


def test_cache_rows_are_k_and_v_projections_with_rope(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 24)[0].tolist()
    out = _run(model, tmp_path, "d", [ids, ids[:17]], new_tokens=3, chunk_size=8)
    attn = model.model.layers[1].self_attn
    x, pos, seq = _rows(out, "model.layers.1.self_attn.input")
    k, kpos, kseq = _rows(out, "model.layers.1.self_attn.k_cache")
    v, _, _ = _rows(out, "model.layers.1.self_attn.v_cache")
    order_x = np.lexsort((pos, seq))
    order_k = np.lexsort((kpos, kseq))
    assert np.array_equal(pos[order_x], kpos[order_k]) and np.array_equal(seq[order_x], kseq[order_k])
    assert set(kpos[kseq == 0].tolist()) == set(range(24 + 2))  # the prompt, then the fed decode tokens
    with torch.no_grad():
        h = torch.from_numpy(x[order_x])
        p = torch.from_numpy(pos[order_x])[None]
        d = attn.head_dim
        key = attn.k_proj(h).view(1, -1, model.config.num_key_value_heads, d).transpose(1, 2)
        cos, sin = model.model.rotary_emb(key, p)
        _, want_k = apply_rotary_pos_emb(key, key, cos, sin)
        want_k = want_k.transpose(1, 2).reshape(len(p[0]), -1).numpy()
        want_v = attn.v_proj(h).numpy()
    assert np.allclose(k[order_k], want_k, rtol=1e-5, atol=1e-5)
    assert np.allclose(v[order_k], want_v, rtol=1e-5, atol=1e-5)
    kv = load_manifest(out).extra["kv_cache"]
    assert kv["num_kv_heads"] * kv["head_dim"] == k.shape[1] and kv["block_size"] is None
    assert kv["readback"]["checked"] > 0 and kv["readback"]["failed"] == 0


def test_read_back_names_a_corrupted_cache_entry(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 12)[0].tolist()

    def corrupt(module, args, kwargs):
        cache = kwargs.get("past_key_values") or kwargs.get("cache")
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if cache is not None and hidden is not None and hidden.shape[1] == 1:  # a decode step
            cache.layers[1].keys[0, :, 2, :] += 1.0  # batch row 0 (sequence 0, unpadded), position 2, layer 1

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(corrupt, with_kwargs=True)
    try:
        out = _run(model, tmp_path, "bad", [ids, ids[:10]], new_tokens=2, batch_size=2)
    finally:
        handle.remove()
    rb = load_manifest(out).extra["kv_cache"]["readback"]
    assert rb["failed"] > 0
    first = rb["failures"][0]
    assert (first["layer"], first["point"], first["sequence"], first["read_position"]) == (1, "k_cache", 0, 2)
    assert "written_by" not in first  # a row no recorded token wrote
    clean = _run(model, tmp_path, "clean", [ids, ids[:10]], new_tokens=2, batch_size=2)
    report = compare_dumps(clean, out)
    assert not report.passed and report.kv_cache is not None
    r = run_cli("comparator", clean, out)
    assert r.returncode == 1, r.stderr
    assert "KV cache read-back failed on the target: sequence 0's query at position 12" in r.stdout
    assert "as its position 2 (layer 1 k_cache)" in r.stdout


@pytest.mark.parametrize(
    ("module", "layer", "point", "finding"),
    [("self_attn.k_proj", 1, "k_cache", "cache"), ("mlp", 0, "input", "upstream")],
)
def test_verdict_orders_the_cache_by_data_flow(tmp_path, module, layer, point, finding):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 16)[0].tolist()
    base = _run(model, tmp_path, "base", [ids])

    def bug(m, args, out):
        out[:, 5] += 0.5 * out.abs().mean()  # token 5: an index, no branch on data
        return out

    with forward_hook(model.model.layers[layer].get_submodule(module), bug):
        target = _run(model, tmp_path, "target", [ids])
    report = compare_dumps(base, target)
    fd = report.first_divergent
    want_layer = layer if point == "k_cache" else layer + 1
    assert (fd.layer, fd.point, fd.token, fd.finding) == (want_layer, point, 5, finding)
    r = run_cli("comparator", base, target)
    assert r.returncode == 1
    words = "the cache write or read is wrong" if finding == "cache" else "the error came from upstream"
    assert words in " ".join(r.stdout.split())


def test_fp8_rounding_predicts_a_real_round_trip_and_not_a_wrong_scale():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64) * torch.rand(64, 1, generator=g, dtype=torch.float64) * 4
    fp8 = torch.float8_e4m3fn
    predicted = fp8_rounding(x, fp8)

    def measured(scale: torch.Tensor) -> torch.Tensor:
        q = (x / scale).to(torch.float32).to(fp8).to(torch.float64) * scale
        return (x - q).square().sum(1) / (x.square().sum(1) + q.square().sum(1))

    best = x.abs().amax(1, keepdim=True) / torch.finfo(fp8).max
    assert torch.allclose(measured(best), fp8_rounding(x, fp8, toward_zero=False))  # to nearest, as torch casts
    unit = measured(torch.ones(64, 1, dtype=torch.float64))  # vLLM's default scale: within the factor
    assert (unit / predicted).max() < FP8_FACTOR
    wrong = measured(best / 4)  # a scale 4x too small: the largest values saturate at the format's max
    assert (wrong / predicted).min() > 2 * FP8_FACTOR


@pytest.fixture(scope="module")
def cache_dump(tmp_path_factory):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 10)[0].tolist()
    root = tmp_path_factory.mktemp("kv-hostile")
    dump_sequences(model, [ids], RunConfig(out=str(root / "d"), layers=[0, 1], points=POINTS, new_tokens=2))
    return root / "d"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda kv: kv.update(num_kv_heads=kv["num_kv_heads"] + 1), "extra.kv_cache.num_kv_heads"),
        (lambda kv: kv.update(head_dim=0), "extra.kv_cache.head_dim"),
        (lambda kv: kv.update(block_size=-16), "extra.kv_cache.block_size"),
        (lambda kv: kv.update(dtype="fp9"), "extra.kv_cache.dtype"),
        (lambda kv: kv.update(stored_dtype="int8"), "extra.kv_cache.stored_dtype"),
        (lambda kv: kv.update(tensor_parallel_size=3), "extra.kv_cache.num_kv_heads"),
        (lambda kv: kv.update(scales={"0": [1.0, float("nan")]}), "extra.kv_cache.scales"),
        (lambda kv: kv["readback"].update(failed=kv["readback"]["checked"] + 1), "extra.kv_cache.readback.failed"),
        (
            lambda kv: kv["readback"].update(failed=1, failures=[{"layer": 0, "point": "q_cache"}]),
            "extra.kv_cache.readback.failures[0]",
        ),
        (lambda kv: kv.clear(), "extra.kv_cache.dtype"),
    ],
)
def test_hostile_kv_cache_fields_are_exit_2_naming_the_field(tmp_path, cache_dump, edit, field):
    bad = tmp_path / "bad"
    shutil.copytree(cache_dump, bad)
    raw = json.loads((bad / "manifest.json").read_text(), parse_constant=lambda c: float(c))
    edit(raw["extra"]["kv_cache"])
    (bad / "manifest.json").write_text(json.dumps(raw))
    r = run_cli("comparator", cache_dump, bad)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "manifest.json" in lines[0], r.stderr


def test_a_cache_record_without_its_layout_is_exit_2(tmp_path, cache_dump):
    bad = tmp_path / "bad"
    shutil.copytree(cache_dump, bad)
    raw = json.loads((bad / "manifest.json").read_text())
    del raw["extra"]["kv_cache"]
    (bad / "manifest.json").write_text(json.dumps(raw))
    r = run_cli("comparator", bad, cache_dump)
    assert r.returncode == 2 and "extra.kv_cache" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_decode_cache_rows_match_the_prefill_of_the_same_tokens(tmp_path):
    r = run_cli("dumper", "run", "--new-tokens", "4", "--points", POINTS, "--layers", "all", "--out", tmp_path / "dec")
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "dumper",
        "run",
        "--tokens-from",
        tmp_path / "dec",
        "--points",
        POINTS,
        "--layers",
        "all",
        "--out",
        tmp_path / "pre",
    )
    assert r.returncode == 0, r.stderr
    report = compare_dumps(tmp_path / "pre", tmp_path / "dec")
    cache = [t for t in report.tensors if t.point in ("k_cache", "v_cache")]
    assert report.passed and cache and all(t.passed for t in cache)
    assert report.decode is not None and report.decode.steps > 0
    assert report.kv_cache is not None and report.kv_cache.passed


def test_llama_cpp_says_in_one_line_why_it_has_no_cache_points(tmp_path):
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        "llama.cpp",
        "--model",
        tmp_path / "m.gguf",
        "--points",
        POINTS,
        "--out",
        tmp_path / "d",
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "llama.cpp's KV cache is not reachable through llama-cpp-python" in r.stderr
