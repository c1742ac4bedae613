"""Model directories are a trust boundary: the dumper never runs code from one, never hangs on one.

Every directory here is a real tiny Llama saved with ``save_pretrained`` under a fixed seed, then
made hostile the way a downloaded checkpoint can be: custom code that transformers would run
once asked (``auto_map`` and a Python file that writes a marker and spawns a process when
imported), a 1 GiB ``config.json``, a FIFO where a file should be, a config that describes far
more than its weights hold.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dumper.cli.main import main
from dumper.errors import ModelError, UsageError
from dumper.modeldir import check_model_dir
from tests.fuzzing import LIMIT, run_child

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

_HOSTILE = """import pathlib, subprocess, sys
pathlib.Path({marker!r}).write_text("ran")
subprocess.Popen([sys.executable, "-c", "import pathlib; pathlib.Path({spawned!r}).write_text('spawned')"])
"""
"""The head of every custom-code file: proof that it ran (a marker) and that it spawned a process."""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("models") / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(path)
    return path


def _copy(llama_dir: Path, tmp_path: Path, name: str = "model") -> Path:
    d = tmp_path / name
    shutil.copytree(llama_dir, d)
    return d


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text()) if path.exists() else {}
    edit(obj)
    path.write_text(json.dumps(obj))


def _custom_code(d: Path, tmp_path: Path, where: str) -> tuple[Path, Path]:
    """Make ``d`` need custom code named in ``where`` (config.json or tokenizer_config.json); its markers."""
    marker, spawned = tmp_path / "code-ran", tmp_path / "process-spawned"
    head = _HOSTILE.format(marker=str(marker), spawned=str(spawned))
    if where == "config.json":  # a model_type transformers does not know: it would ask, then import this
        (d / "configuration_custom.py").write_text(
            head + "from transformers import LlamaConfig\n\nclass CustomConfig(LlamaConfig):\n"
            "    model_type = 'driftscope-custom'\n"
        )
        (d / "modeling_custom.py").write_text(head)
        _edit_json(
            d / "config.json",
            lambda c: c.update(
                model_type="driftscope-custom",
                auto_map={
                    "AutoConfig": "configuration_custom.CustomConfig",
                    "AutoModelForCausalLM": "modeling_custom.CustomLM",
                },
            ),
        )
    else:  # a tokenizer class transformers does not know: the same question, then tokenization_custom.py
        (d / "tokenization_custom.py").write_text(
            head + "from transformers import PreTrainedTokenizer\n\nclass CustomTokenizer(PreTrainedTokenizer):\n"
            "    pass\n"
        )
        _edit_json(
            d / "tokenizer_config.json",
            lambda c: c.update(
                tokenizer_class="CustomTokenizer",
                auto_map={"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]},
            ),
        )
    return marker, spawned


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_custom_code_is_refused_and_never_runs_even_when_stdin_says_yes(llama_dir, tmp_path, where):
    d = _copy(llama_dir, tmp_path)
    marker, spawned = _custom_code(d, tmp_path, where)
    modules = tmp_path / "hf-modules"  # where transformers would copy the code before importing it
    rc, err, _ = run_child(
        "dumper",
        "run",
        "--model",
        d,
        "--out",
        tmp_path / "out",
        "--input-ids",
        "1,2,3",
        "--quiet",
        env={"HF_MODULES_CACHE": str(modules), "HF_HUB_OFFLINE": "1"},
        stdin="y\n" * 10,
    )
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {d / where}: names custom code (auto_map: "), lines[0]
    assert "driftscope never runs code from a model directory" in lines[0]
    assert not marker.exists() and not spawned.exists() and not modules.exists()
    assert not (tmp_path / "out").exists()


def test_a_1gib_config_is_refused_by_its_size_before_it_is_read(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    with open(d / "config.json", "wb") as f:  # sparse: 1 GiB on paper, no disk
        f.truncate(1 << 30)
    rc, err, peak = run_child("dumper", "run", "--model", d, "--out", tmp_path / "out", "--input-ids", "1,2", "--quiet")
    print(f"peak RSS refusing a 1 GiB config.json: {peak >> 20} MiB")
    assert rc == 2 and err.strip().splitlines() == [
        f"error: {d / 'config.json'}: model config of {1 << 30} bytes exceeds the 16 MiB limit"
    ], err
    assert peak < LIMIT // 2, peak  # the torch import, not the file (it was 2.3 GB before)


def _unblocking(fifo: Path, call: Callable[[], object], timeout: float = 60) -> object:
    """``call()`` in a thread; if it is still blocked on ``fifo`` after ``timeout``, open the other end and fail."""
    result: list[object] = []

    def target() -> None:
        try:
            result.append(call())
        except Exception as e:  # noqa: BLE001 - handed to the test thread
            result.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer unblocks the reader's open
        thread.join(10)
        pytest.fail(f"blocked on the FIFO {fifo} for {timeout} s")
    return result[0]


def test_a_fifo_config_is_refused_without_opening_it_for_a_read(llama_dir, tmp_path, capsys):
    d = _copy(llama_dir, tmp_path)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    argv = ["run", "--model", str(d), "--out", str(tmp_path / "out"), "--input-ids", "1,2", "--quiet"]
    assert _unblocking(d / "config.json", lambda: main(argv)) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {d / 'config.json'}: a FIFO, not a regular file; refusing to read it"
    ]


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors", "generation_config.json"])
def test_a_fifo_anywhere_in_the_directory_is_refused_before_transformers_opens_it(llama_dir, tmp_path, name):
    d = _copy(llama_dir, tmp_path)
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    e = _unblocking(d / name, lambda: check_model_dir(d))
    assert isinstance(e, ModelError) and str(e) == (
        f"{d / name}: a FIFO in the model directory; refusing to load it (only regular files are read)"
    )


def test_a_fifo_gguf_is_refused_promptly(tmp_path):
    from dumper.engines.llama_cpp_ggml import check_gguf_file

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    e = _unblocking(fifo, lambda: check_gguf_file(str(fifo)))
    assert isinstance(e, UsageError) and str(e) == (
        f"{fifo}: a FIFO, not a regular file; --engine llama.cpp loads one .gguf file"
    )
    (tmp_path / "d.gguf").mkdir()
    with pytest.raises(UsageError, match="a directory; --engine llama.cpp loads one .gguf file"):
        check_gguf_file(str(tmp_path / "d.gguf"))
    (tmp_path / "x.gguf").write_bytes(b"GGML....")
    with pytest.raises(UsageError, match="not a GGUF file"):
        check_gguf_file(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("vocab_size", 10**8, "values, but the weight files hold 37,792; refusing to allocate it"),
        ("hidden_size", 1 << 16, "but the weight files hold 37,792; refusing to allocate it"),
        ("num_hidden_layers", 10**6, "num_hidden_layers is 1000000, but the weight files hold 21 tensors"),
    ],
)
def test_a_config_that_describes_far_more_than_its_weights_is_refused_before_allocating(
    llama_dir, tmp_path, capsys, key, value, needle
):
    d = _copy(llama_dir, tmp_path)
    _edit_json(d / "config.json", lambda c: c.update({key: value}))
    rc = main(["run", "--model", str(d), "--out", str(tmp_path / "out"), "--input-ids", "1,2", "--quiet"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {d / 'config.json'}: "), lines
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: (d / "config.json").write_bytes(b'{"model_type": "llama", "x": ' + b"[" * 100_000), "unreadable"),
        (
            lambda d: _edit_json(
                d / "config.json", lambda c: c.update(text_config={"auto_map": {"AutoConfig": "a.B"}})
            ),
            "names custom code (text_config.auto_map: ",
        ),
        (
            lambda d: _edit_json(d / "config.json", lambda c: c.update(custom_pipelines={"x": {"impl": "p.P"}})),
            "names custom code (custom_pipelines: ",
        ),
        (
            lambda d: _edit_json(d / "config.json", lambda c: c.update(num_attention_heads=-2)),
            "num_attention_heads is -2",
        ),
        (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "tokenizer_config.json: expected a JSON object"),
        (lambda d: (d / "config.json").unlink() or (d / "config.json").mkdir(), "a directory, not a regular file"),
        (lambda d: (d / "config.json").unlink(), "not a HF model directory (no config.json)"),
    ],
)
def test_model_directory_checks_name_the_file(llama_dir, tmp_path, edit, needle):
    d = _copy(llama_dir, tmp_path)
    edit(d)
    with pytest.raises(ModelError) as e:
        check_model_dir(d)
    assert needle in str(e.value) and str(d) in str(e.value)


def test_auto_map_null_and_an_unused_python_file_are_not_custom_code(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    _edit_json(d / "config.json", lambda c: c.update(auto_map=None))
    (d / "notes.py").write_text("raise SystemExit('never imported')\n")
    assert check_model_dir(d)["model_type"] == "llama"


@pytest.mark.parametrize("where", ["special_tokens_map.json", "tokenizer_config.json"])
def test_a_tokenizer_file_outside_the_directory_is_refused_and_never_read(llama_dir, tmp_path, where):
    """``tokenizer_file`` of ``special_tokens_map.json`` goes straight into the tokenizer's arguments (transformers
    5 opens it); found by the model-directory fuzz suite. A stale path that exists nowhere is left alone."""
    d = _copy(llama_dir, tmp_path)
    outside = tmp_path / "elsewhere" / "tokenizer.json"
    outside.parent.mkdir()
    outside.write_text("{}")
    _edit_json(d / where, lambda c: c.update(tokenizer_file=str(outside)))
    with pytest.raises(ModelError) as e:
        check_model_dir(d)
    assert f"{d / where}: tokenizer_file names" in str(e.value) and "outside the model directory" in str(e.value)
    _edit_json(d / where, lambda c: c.update(tokenizer_file="/home/someone/.cache/tokenizer.json"))
    assert check_model_dir(d)["model_type"] == "llama"
