"""The dumper's trust boundary: bad models, prompts and layer specs exit 2 with one line; bugs stay exit 3.

Broken model directories are real ones: a tiny Llama saved with ``save_pretrained`` under a
fixed seed, then broken the way a user's checkout breaks (a config edited by hand, weights
that do not fit, an architecture this transformers cannot build).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import dumper
from dumper.cli.main import join_dash_values, main
from dumper.errors import DumpError, InternalError, ModelError, UsageError
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.hooks.layers import parse_layer_spec
from dumper.jobs.selfcheck import selfcheck
from dumper.prefill.forward import pad_batch, prefill
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import run_cli, subprocess_env, tiny_llama

LLAMA = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
)


def _save_llama(path: Path, **overrides: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA, **overrides})
    config.save_pretrained(path)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _save_llama(tmp_path_factory.mktemp("models") / "llama")


def _broken(llama_dir: Path, tmp_path: Path, edit: Callable[[dict], dict | str]) -> Path:
    """A copy of the good model directory whose config.json is ``edit(config)`` (a dict, or raw text)."""
    d = tmp_path / "broken"
    shutil.copytree(llama_dir, d)
    cfg = edit(json.loads((d / "config.json").read_text()))
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d


def _one_line(capsys, rc: int, expected_rc: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert rc == expected_rc, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _run(*args: str | Path) -> int:
    return main(["run", *map(str, args), "--quiet"])


# ---------------------------------------------------------------------------------- model loading


def test_a_good_local_model_directory_loads_quietly(llama_dir, tmp_path, capsys):
    assert _run("--model", llama_dir, "--out", tmp_path / "d", "--input-ids", "1,5,9") == 0
    assert capsys.readouterr().err == ""  # no transformers progress bar or load report
    assert [t.shape for t in load_manifest(tmp_path / "d").tensors] == [(1, 3, 32), (1, 3, 32)]


def test_unsupported_architecture_exits_2_naming_the_model(llama_dir, tmp_path, capsys):
    d = _broken(
        llama_dir, tmp_path, lambda c: {**c, "model_type": "no-such-arch", "architectures": ["NoSuchForCausalLM"]}
    )
    rc = _run("--model", d, "--out", tmp_path / "o", "--input-ids", "1,2")
    _one_line(capsys, rc, 2, str(d), "cannot load model", "no-such-arch")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: "{not json", "config.json: unreadable model config (Expecting property name"),
        (lambda c: "[1, 2]", "expected a JSON object, got list"),
        (lambda c: {k: v for k, v in c.items() if k != "model_type"}, 'no "model_type"'),
        (lambda c: {**c, "hidden_size": -32}, "hidden_size is -32"),
        (lambda c: {**c, "num_hidden_layers": -1}, "num_hidden_layers is -1"),
        (lambda c: {**c, "num_attention_heads": 3}, "not a multiple of the number of attention heads"),
        (lambda c: {**c, "vocab_size": 200}, "MISMATCH: Reinit due to size mismatch - ckpt: torch.Size([300, 32])"),
    ],
    ids=[
        "bad-json",
        "not-an-object",
        "no-model-type",
        "negative-hidden",
        "negative-layers",
        "bad-heads",
        "weights-mismatch",
    ],
)
def test_invalid_config_exits_2_naming_the_file_and_problem(llama_dir, tmp_path, capsys, edit, needle):
    d = _broken(llama_dir, tmp_path, edit)
    rc = _run("--model", d, "--out", tmp_path / "o", "--input-ids", "1,2")
    _one_line(capsys, rc, 2, str(d), needle)


def test_missing_model_directory_exits_2(tmp_path, capsys):
    rc = _run("--model", tmp_path / "nowhere", "--out", tmp_path / "o")
    _one_line(capsys, rc, 2, "nowhere", "neither a preset")


def test_broken_tokenizer_exits_2(llama_dir, tmp_path, capsys):
    d = tmp_path / "tok"
    shutil.copytree(llama_dir, d)
    (d / "tokenizer.json").write_text('{"garbage": 1}')
    _one_line(capsys, _run("--model", d, "--out", tmp_path / "o"), 2, str(d), "cannot load its tokenizer")


# ---------------------------------------------------------------------------------- forward failures


@pytest.mark.slow
def test_config_that_builds_but_fails_in_forward_exits_2_through_the_cli(tmp_path):
    d = _save_llama(tmp_path / "kv3", num_attention_heads=4, num_key_value_heads=3, head_dim=8)
    r = run_cli("dumper", "run", "--model", d, "--out", tmp_path / "o", "--input-ids", "1,5,9", "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {d}: the forward pass failed (RuntimeError"), r.stderr
    assert not (tmp_path / "o" / MANIFEST_NAME).exists()


def test_ids_beyond_the_vocabulary_at_the_prefill_boundary():
    model, _ = tiny_llama()
    ids, mask = pad_batch([[1, 2, 10_000]], side="right")
    with pytest.raises(ModelError, match=r"^tiny-llama: the forward pass failed \(IndexError"):
        prefill(model, ids, mask, chunk_size=None)


def test_a_bug_in_a_driftscope_hook_stays_an_internal_error(tmp_path, monkeypatch, capsys):
    def broken_rows(self, args, kwargs):
        raise ZeroDivisionError("driftscope bug")

    monkeypatch.setattr(dumper.hooks.capture.Capture, "_pass_rows", broken_rows)
    model, _ = tiny_llama()
    with pytest.raises(InternalError, match="_on_model_start failed"):
        dump_sequences(model, [[1, 2, 3]], RunConfig(out=str(tmp_path / "a")))
    rc = _run("--out", tmp_path / "b", "--input-ids", "1,2,3")
    assert "internal error: InternalError" in _one_line(capsys, rc, 3)


class _CacheDropping(nn.Module):
    """A model that takes a KV cache argument but never returns a cache (as some custom model code does)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_input_embeddings(self) -> nn.Module:
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None):
        return self.inner(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )


def test_a_cache_that_does_not_grow_is_a_user_error_naming_the_model(tmp_path):
    model = _CacheDropping(tiny_llama()[0])
    with pytest.raises(
        ModelError,
        match="tiny-llama: --chunk-size needs a KV cache that grows by each chunk; "
        "after the chunk ending at token 2 the model returned no KV cache",
    ):
        dump_sequences(model, [[1, 2, 3, 4]], RunConfig(out=str(tmp_path / "a"), chunk_size=2))
    with pytest.raises(ModelError, match="tiny-llama: selfcheck needs a KV cache that keeps every token"):
        selfcheck(model, [1, 2, 3], new_tokens=2)


def test_a_state_space_cache_with_chunk_size_exits_2(tmp_path, capsys):
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    d = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, state_size=4)).save_pretrained(d)
    capsys.readouterr()
    rc = _run(
        "--model",
        d,
        "--out",
        tmp_path / "o",
        "--input-ids",
        "5,6,7",
        "--modules",
        "backbone.layers.*.mixer",
        "--chunk-size",
        "2",
    )
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    # transformers' own lines about its slow reference kernels may precede ours: ours is the one error line
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    # transformers 5.19 names Mamba's cache cache_params (no KV cache argument); later versions take cache=
    assert errors == [err.strip().splitlines()[-1]] and errors[0].startswith(f"error: {d}: "), err
    assert "--chunk-size needs a KV cache" in errors[0] or "takes no KV cache argument" in errors[0], err


# ---------------------------------------------------------------------------------- selfcheck inputs


@pytest.mark.slow
def test_selfcheck_two_token_prompt_runs_every_mode_through_the_cli(tmp_path):
    r = run_cli("dumper", "selfcheck", "--input-ids", "5,6", "--new-tokens", "2")  # InternalError before
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("PASS") == 4 and "cache hit 1 tokens" in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--input-ids", "5"], "prompt 0: prefill-hit needs a prompt of at least 2 tokens, got 1"),
        (["--input-ids", "5,6", "--new-tokens", "1"], "prompt 0: decode-hit needs --new-tokens >= 2, got 1"),
        (["--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
        (["--input-ids", "5,6", "--input-ids", "999"], "prompt 1: token id 999 is outside the vocabulary [0, 384)"),
        (["--input-ids", "-1,2"], "token id -1 is outside the vocabulary"),
        (["--input-ids", ""], "--input-ids '': expected comma-separated integers"),
    ],
)
def test_selfcheck_inputs_that_cannot_run_exit_2(capsys, args, needle):
    _one_line(capsys, main(["selfcheck", *args]), 2, needle)


def test_selfcheck_one_token_prompt_runs_in_modes_that_allow_it(capsys):
    assert main(["selfcheck", "--input-ids", "5", "--mode", "no-cache", "--new-tokens", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- layer specs, empty runs


@pytest.mark.slow
def test_reversed_layer_range_exits_2_before_writing_anything(tmp_path):
    r = run_cli("dumper", "run", "--out", tmp_path / "d", "--layers", "7..4", "--quiet")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: layer spec '7..4': range '7..4' is empty (layer 7 comes after layer 4); write it as 4..7"
    ], r.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("form", [["--layers", "-3..-1"], ["--layers=-3..-1"]])
def test_negative_layer_range_parses_both_ways(tmp_path, form):
    assert main(["run", "--out", str(tmp_path / "d"), *form, "--input-ids", "1,2", "--quiet"]) == 0
    m = load_manifest(tmp_path / "d")
    assert m.capture_signature["layers"] == [5, 6, 7] and sorted(t.layer for t in m.tensors) == [5, 6, 7]


def test_dash_values_are_joined_only_for_options_that_take_them():
    assert join_dash_values(["run", "--layers", "-1,-2", "--seed", "-3"]) == ["run", "--layers=-1,-2", "--seed", "-3"]
    assert join_dash_values(["run", "--layers", "--quiet"]) == ["run", "--layers", "--quiet"]
    assert join_dash_values(["ls", "--", "--layers", "-1"]) == ["ls", "--", "--layers", "-1"]


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("3..x", "'3..x' is not all, first, last"),
        ("every:0", "every:N needs a positive integer N, got 'every:0'"),
        ("every:-1", "every:N needs a positive integer N, got 'every:-1'"),
        ("99", "layer 99 is out of range for a model with 8 layers"),
        ("-9", "layer -9 is out of range"),
        ("-1..-3", "range '-1..-3' is empty"),
        ("1_0", "'1_0' is not all"),
        ("first,..2", "'..2' is not all"),
        ("", "empty layer spec"),
    ],
)
def test_malformed_layer_specs_name_the_spec(spec, needle):
    with pytest.raises(UsageError) as e:
        parse_layer_spec(spec, 8)
    assert needle in str(e.value) and (repr(spec) in str(e.value))


def test_malformed_layer_spec_through_the_cli(tmp_path, capsys):
    _one_line(capsys, _run("--out", tmp_path / "d", "--layers", "every:-1"), 2, "layer spec 'every:-1'")
    assert not (tmp_path / "d").exists()


def test_modules_and_layers_that_select_nothing_exit_2_up_front(tmp_path, capsys):
    rc = _run("--out", tmp_path / "d", "--modules", "model.layers.0.mlp", "--layers", "5")
    _one_line(capsys, rc, 2, "'model.layers.0.mlp' matches modules only in layers [0], none of layer spec '5'")
    assert not (tmp_path / "d").exists()


def test_a_capture_that_records_nothing_leaves_no_dump(tmp_path):
    model, _ = tiny_llama()
    with pytest.raises(DumpError, match="recorded no tensors .*model.layers.0.self_attn.* never ran"):
        with dumper.capture(model, tmp_path / "new", layers="all"):
            pass  # the model never runs
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made stays, empty and without a manifest
    with pytest.raises(DumpError, match="no dump was written"):
        with dumper.capture(None, tmp_path / "mine"):
            pass
    assert list((tmp_path / "mine").iterdir()) == []


# ---------------------------------------------------------------------------------- DRIFTSCOPE_DUMP_DIR

_ENV_SCRIPT = textwrap.dedent("""
    import torch, dumper
    from dumper.prefill.presets import load_model

    model, tok = load_model("tiny-llama")

    def hook_point(module, args, output):  # model code with an explicit dumper.dump() hook point
        dumper.dump("layer2.out", output[0] if isinstance(output, tuple) else output, layer=2)

    model.model.layers[2].register_forward_hook(hook_point)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("hello")])).logits
    print("forward ok", tuple(logits.shape))
""")


@pytest.mark.slow
def test_dump_dir_env_var_starts_a_numbered_dump_beside_an_existing_one(tmp_path):
    env = subprocess_env(DRIFTSCOPE_DUMP_DIR=str(tmp_path / "env"))
    runs = [
        subprocess.run([sys.executable, "-c", _ENV_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0 and "forward ok (1, 6, 384)" in r.stdout, r.stderr
    assert runs[0].stderr == ""
    assert runs[1].stderr.strip().splitlines() == [
        f"driftscope: DRIFTSCOPE_DUMP_DIR={tmp_path / 'env'} already holds a dump; recording to {tmp_path / 'env.1'}"
    ]
    first, second = load_manifest(tmp_path / "env"), load_manifest(tmp_path / "env.1")
    assert [(t.name, t.layer, t.shape) for t in first.tensors] == [("layer2.out", 2, (1, 6, 64))]
    assert [(t.name, t.layer, t.shape) for t in second.tensors] == [("layer2.out", 2, (1, 6, 64))]
    a, b = (
        load_file(d / m.tensors[0].file)[m.tensors[0].key]
        for d, m in ((tmp_path / "env", first), (tmp_path / "env.1", second))
    )
    assert torch.equal(a, b)  # the same deterministic forward, recorded twice


def _empty_rank_worker(rank: int, port: int, out: str, recording_ranks: tuple[int, ...]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        outcome = "ok"
        try:
            with dumper.capture(None, out):
                if rank in recording_ranks:
                    dumper.dump("x", torch.arange(4.0).reshape(2, 2))
        except DumpError as e:
            outcome = f"DumpError: {e}"
        Path(f"{out}-rank{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("recording_ranks", [(), (1,)])
def test_multi_rank_capture_is_empty_only_when_every_rank_is(tmp_path, recording_ranks):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "d"
    mp.start_processes(
        _empty_rank_worker, args=(port, str(out), recording_ranks), nprocs=2, start_method="spawn", join=True
    )
    outcomes = [Path(f"{out}-rank{r}.txt").read_text() for r in range(2)]
    if recording_ranks:  # one rank's tensors make a dump; the other rank is not an error
        assert outcomes == ["ok", "ok"] and [t.rank for t in load_manifest(out).tensors] == [1]
    else:  # every rank says so (none waits forever at a barrier) and nothing complete-looking is left
        assert all(o.startswith("DumpError: ") and "recorded no tensors" in o for o in outcomes), outcomes
        assert not (out / MANIFEST_NAME).exists() and not list(out.glob("index-r*.json"))


@pytest.mark.parametrize("spec", ["1,,2", "1,2,", ","])
def test_input_ids_with_an_empty_item_are_a_typo(spec, capsys):
    assert main(["run", "--out", "unused", "--input-ids", spec, "--quiet"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_logprobs_with_nothing_to_score_are_refused_and_leave_no_dump(tmp_path, capsys):
    out = tmp_path / "o"
    code = main(["run", "--out", str(out), "--logprobs", "--logprob-start-len", "100000", "--quiet"])
    assert code == 2 and "no prompt has a position to score" in capsys.readouterr().err
    assert not out.exists()


# -- what the writer writes, the reader reads ---------------------------------------------------
@pytest.mark.parametrize(
    "name, tensor, kw, match",
    [
        ("t", torch.zeros(5000, 0), {}, "shape [5000, 0] has rows but a last dim of 0"),
        ("t", torch.zeros(2, 3, 0), {}, "shape [2, 3, 0] has rows"),
        ("", torch.zeros(2, 2), {}, "non-empty string"),
        ("\ud800", torch.zeros(2, 2), {}, "valid Unicode"),
        ("a\x1b[31mb", torch.zeros(2, 2), {}, "printable"),
        ("t", torch.zeros(2, 2), {"layer": "3"}, "layer must be an integer"),
        ("t", torch.zeros(2, 2), {"layer": True}, "layer must be an integer"),
        ("t", torch.zeros(2, 2), {"layer": 2.0}, "layer must be an integer"),
        ("t", torch.zeros(2, 2), {"point": 5}, "point must be a string"),
        ("t", torch.zeros(2, 2), {"shard_dim": "1"}, "shard_dim must be an integer"),
        ("t", torch.zeros(2, 2), {"scale": float("nan")}, "meta 'scale'"),
        ("t", torch.zeros(2, 2), {"tag": "\ud800"}, "meta 'tag'"),
    ],
)
def test_dump_refuses_what_the_reader_would_refuse(tmp_path, name, tensor, kw, match):
    out = tmp_path / "d"
    with pytest.raises(UsageError, match=re.escape(match)):
        with dumper.capture(None, out):
            dumper.dump("ok", torch.ones(2, 2))
            dumper.dump(name, tensor, **kw)
    assert not (out / MANIFEST_NAME).exists()


def test_dump_stores_integer_scalars_and_empty_tensors_readably(tmp_path):
    import numpy as np

    from dumper.format import DumpReader

    out = tmp_path / "d"
    with dumper.capture(None, out):
        dumper.dump("a", torch.ones(2, 4), layer=np.int64(3), shard_dim=np.int32(-1))
        dumper.dump("b", torch.ones(2, 4), layer=torch.tensor(5), point="input")
        dumper.dump("rows0", torch.zeros(0, 8))
        dumper.dump("empty1d", torch.zeros(0))
    m = load_manifest(out)
    by = {t.name: t for t in m.tensors}
    assert (by["a"].layer, by["a"].shard_dim, by["b"].layer) == (3, 1, 5)
    assert type(by["a"].layer) is int and type(by["b"].layer) is int
    reader = DumpReader(out, m)
    assert reader.rows(by["rows0"]).shape == (0, 8) and reader.rows(by["empty1d"]).shape == (1, 0)


def test_capture_refuses_an_extra_the_reader_would_refuse(tmp_path):
    for extra, match in [
        ({"input_ids": [1, 2]}, "extra.input_ids[0]"),
        ({"p": "\ud800"}, "extra.p"),
        ({"x": float("inf")}, "not storable as JSON"),
        ({"x": object()}, "not storable"),
    ]:
        with pytest.raises(UsageError, match=re.escape(match)):
            dumper.capture(None, tmp_path / "d", extra=extra)
    with dumper.capture(None, tmp_path / "ok", extra={"input_ids": [(1, 2)]}):
        dumper.dump("t", torch.ones(1, 2))
    assert load_manifest(tmp_path / "ok").extra["input_ids"] == [[1, 2]]


@pytest.mark.parametrize("cmd", ["run", "selfcheck"])
@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1", str(1 << 63)])
def test_out_of_range_seed_is_a_usage_error(tmp_path, capsys, cmd, seed):
    args = [cmd, f"--seed={seed}"] + (["--out", str(tmp_path / "d")] if cmd == "run" else [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--seed" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "d").exists()
    with pytest.raises(UsageError, match="--seed"):
        RunConfig(out=str(tmp_path / "d"), seed=int(seed))
