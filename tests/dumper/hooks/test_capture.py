"""The hook API on real HF models: discovery, positions, copies, scoping, the dump() fast path."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import timeit

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import dumper
from dumper.errors import DumpError, UsageError
from dumper.format import MANIFEST_NAME, load_manifest, open_tensor, to_float64
from dumper.hooks.layers import parse_layer_spec
from tests.conftest import prompt_ids, subprocess_env, tiny_llama

SMALL = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _model(model_type: str):
    if model_type == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=300, n_embd=32, n_layer=5, n_head=4, n_positions=512)
    else:
        config = AutoConfig.for_model(model_type, **SMALL)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "model_type,prefix",
    [
        ("llama", "model.layers"),
        ("qwen2", "model.layers"),
        ("mistral", "model.layers"),
        ("gpt2", "transformer.h"),
    ],
)
def test_finds_decoder_layers_of_hf_models(tmp_path, model_type, prefix):
    model = _model(model_type)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), dumper.capture(model, tmp_path / "d", layers="first,last,-2"):
        model(input_ids=ids)
    m = load_manifest(tmp_path / "d")
    attn = "attn" if model_type == "gpt2" else "self_attn"
    assert [t.name for t in m.tensors] == [f"{prefix}.{i}.{attn}.input" for i in (0, 3, 4)]
    assert [t.layer for t in m.tensors] == [0, 3, 4]
    assert m.capture_signature["layers"] == [0, 3, 4] and m.capture_signature["num_layers"] == 5
    for t in m.tensors:
        assert t.shape == (2, 20, 32) and t.forward_pass == 0 and t.rank == 0
        assert t.row_positions().tolist() == list(range(20)) * 2
        assert t.row_sequence_ids().tolist() == [0] * 20 + [1] * 20
    # the captured tensor is exactly what the attention module received
    seen = {}

    def spy(mod, args, kwargs):
        seen["x"] = kwargs.get("hidden_states", args[0] if args else None).clone()

    layer0 = (model.transformer.h if model_type == "gpt2" else model.model.layers)[0]
    getattr(layer0, attn).register_forward_pre_hook(spy, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
    np.testing.assert_array_equal(open_tensor(tmp_path / "d", m.tensors[0]), seen["x"].numpy())


def test_positions_follow_position_ids_and_cache(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 40)
    with torch.no_grad(), dumper.capture(model, tmp_path / "d", layers="first") as cap:
        cap.set_sequence_ids([7])
        out = model(input_ids=ids[:, :24], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(input_ids=ids[:, 24:], use_cache=True, **{kw: cache})
        model(input_ids=ids[:, :5], position_ids=torch.arange(100, 105)[None])
    m = load_manifest(tmp_path / "d")
    pos = [t.row_positions().tolist() for t in m.tensors]
    assert pos == [list(range(24)), list(range(24, 40)), list(range(100, 105))]
    assert [t.forward_pass for t in m.tensors] == [0, 1, 2]
    assert all(set(t.row_sequence_ids().tolist()) == {7} for t in m.tensors)


def test_capture_is_a_copy_not_a_view(tmp_path):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with dumper.capture(None, tmp_path / "d"):
        dumper.dump("x", x, layer=1)
        x.mul_(100)  # a later in-place op in the model must not change the dump
    m = load_manifest(tmp_path / "d")
    np.testing.assert_array_equal(open_tensor(tmp_path / "d", m.tensors[0]), np.arange(12).reshape(3, 4))


def test_dump_records_bf16_exactly_and_steps_passes(tmp_path):
    x = torch.randn(5, 6).to(torch.bfloat16)
    with dumper.capture(None, tmp_path / "d"):
        dumper.dump("a", x, layer=0, positions=range(10, 15), sequence_ids=[3] * 5, note="hi")
        dumper.dump("a", x)
        dumper.step()
        dumper.dump("a", x)
    m = load_manifest(tmp_path / "d")
    a0, a1, a2 = m.tensors
    assert (a0.forward_pass, a0.call, a1.forward_pass, a1.call, a2.forward_pass, a2.call) == (0, 0, 0, 1, 1, 0)
    assert a0.positions == [[10, 5]] and a0.sequence_ids == [[3, 5]] and a0.meta == {"note": "hi"}
    np.testing.assert_array_equal(to_float64(open_tensor(tmp_path / "d", a1), "BF16"), x.double().numpy())


def test_hooks_removed_after_capture_and_after_exception(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 16)

    def hook_count():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    before = hook_count()
    with dumper.capture(model, tmp_path / "ok", layers="all"):
        assert hook_count() == before + 2 + 8
        model(input_ids=ids)
    assert hook_count() == before and dumper.active_capture() is None
    with pytest.raises(RuntimeError, match="boom"):
        with dumper.capture(model, tmp_path / "bad", layers="all"):
            model(input_ids=ids)
            raise RuntimeError("boom")
    assert hook_count() == before and dumper.active_capture() is None
    # an interrupted run keeps its data files but never looks complete
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    assert list((tmp_path / "bad").glob("*.safetensors"))
    with pytest.raises(DumpError, match="incomplete dump"):
        load_manifest(tmp_path / "bad")


def test_refuses_to_overwrite_a_dump(tmp_path):
    with dumper.capture(None, tmp_path / "d"):
        dumper.dump("x", torch.ones(2))
    before = (tmp_path / "d" / MANIFEST_NAME).read_bytes()
    with pytest.raises(DumpError, match="already holds a complete dump"):
        with dumper.capture(None, tmp_path / "d"):
            dumper.dump("x", torch.zeros(2))
    assert (tmp_path / "d" / MANIFEST_NAME).read_bytes() == before


def test_dump_is_a_cheap_noop_when_disabled():
    assert dumper.active_capture() is None
    x = torch.ones(3)
    dumper.dump("x", x)  # nothing active: returns at once, records nothing
    n = 200_000
    per_call = min(timeit.repeat(lambda: dumper.dump("x", x), number=n, repeat=5)) / n
    assert per_call < 1e-6, f"disabled dump() costs {per_call * 1e9:.0f} ns"


@pytest.mark.slow
def test_dump_dir_env_var_records_without_a_capture(tmp_path):
    script = textwrap.dedent("""
        import torch, dumper
        dumper.dump("hidden", torch.arange(6.).reshape(2, 3), layer=4)
        dumper.step()
        dumper.dump("hidden", torch.ones(2, 3), layer=4)
    """)
    env = subprocess_env(DRIFTSCOPE_DUMP_DIR=str(tmp_path / "env"))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    m = load_manifest(tmp_path / "env")
    assert [(t.name, t.layer, t.forward_pass) for t in m.tensors] == [("hidden", 4, 0), ("hidden", 4, 1)]


def test_module_pattern_selects_modules(tmp_path):
    model, tok = tiny_llama()
    with torch.no_grad(), dumper.capture(model, tmp_path / "d", modules="model.layers.*.mlp", layers="1..2"):
        model(input_ids=prompt_ids(tok, 8))
    m = load_manifest(tmp_path / "d")
    assert [(t.name, t.layer) for t in m.tensors] == [("model.layers.1.mlp.input", 1), ("model.layers.2.mlp.input", 2)]
    with pytest.raises(UsageError, match="matches no module"):
        dumper.capture(model, tmp_path / "e", modules="nothing.*")


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("first,last,every:8", [0, 8, 16, 19]),
        (None, [0, 8, 16, 19]),
        ("all", list(range(20))),
        ("-1,-2", [18, 19]),
        ("3..5,every:10", [0, 3, 4, 5, 10]),
        ([1, -1], [1, 19]),
    ],
)
def test_layer_specs(spec, expected):
    assert parse_layer_spec(spec, 20) == expected


@pytest.mark.parametrize("spec", ["20", "-21", "every:0", "every:x", "a..b", "middle", ""])
def test_bad_layer_specs(spec):
    with pytest.raises(UsageError):
        parse_layer_spec(spec, 20)
