"""Fuzzing model directories: a real tiny checkpoint, damaged, run through ``dumper run`` in-process.

The base is a tiny Llama with a trained BPE tokenizer (``tests/engine_models.py``, fixed seed,
``save_pretrained``). Each case copies it, damages it one way (config.json fields, types and
bytes; tokenizer files; custom-code markers; FIFOs, directories and links where files were) and
runs ``python -m dumper run --model DIR --prompt ...`` through ``main``. Properties, on top of
:func:`tests.fuzzing.check_outcome` (exit 0 or 2 only here, one line, no control characters,
nothing under ``outside/`` opened, traced memory bounded):

* no code from the directory runs: every ``.py`` a case writes records a marker when imported,
  no module under the directory (or in transformers' dynamic-module package) is imported, and no
  process is spawned (an audit hook watches ``subprocess.Popen``, ``os.system``, ``os.exec*``...);
* the process's peak RSS (``VmHWM``, reset per case) grows by less than 512 MiB;
* nothing blocks: a watchdog opens every FIFO for writing after 60 s and fails the case;
* where the damage decides the answer it is that answer: custom code, a FIFO, a config.json
  that is no JSON object are exit 2 naming the file.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dumper.cli.main import main as dumper_main
from tests.engine_models import build_checkpoint
from tests.fuzzing import FUZZ, LIMIT, check_outcome, run_main

TINY = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
)
_SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty")
_SPAWNED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _SPAWNED is not None and event in _SPAWN_EVENTS:
        _SPAWNED.append(f"{event} {args!r:.200}")


sys.addaudithook(_audit)  # once per process; records only inside a case


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


class Sandbox:
    """The base checkpoint, a sentinel ``outside/`` holding valid copies of its files, and fresh copies to damage."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = build_checkpoint(root / "base", **TINY)
        self.outside = root / "outside"
        shutil.copytree(self.base, self.outside)  # a loader that followed a hostile path would find a model
        self.config = json.loads((self.base / "config.json").read_text())
        self.tokenizer_config = json.loads((self.base / "tokenizer_config.json").read_text())
        self._n = itertools.count()
        self.codes: list[int] = []
        platform.processor()  # cached after its one ``uname -p``: from here on no case may spawn a process

    def copy(self) -> Path:
        case = self.root / f"case{next(self._n)}"
        shutil.copytree(self.base, case / "model")
        return case

    def run(self, case: Path, expect: set[int] = frozenset({0, 2}), needle: str | None = None) -> str:
        """Run the dumper on ``case/model`` and check every property; the stderr."""
        global _SPAWNED
        model = case / "model"
        hung = _watchdog(model)
        before = set(sys.modules)
        _SPAWNED = spawned = []
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: this case's peak from here
        start = _rss("VmRSS")
        try:
            o = run_main(
                dumper_main,
                [
                    "run",
                    "--model",
                    model,
                    "--out",
                    case / "out",
                    "--prompt",
                    "The quick brown fox",
                    "--layers",
                    "all",
                    "--quiet",
                ],
            )
        finally:
            _SPAWNED = None
            hung.cancel()
        grew = _rss("VmHWM") - start
        code = check_outcome(o, outside=self.outside)
        assert not hung.fired, f"blocked on a FIFO in {model}"
        assert code in expect, (code, o.err)
        assert needle is None or needle in o.err, o.err
        assert grew < LIMIT, f"peak RSS grew by {grew >> 20} MiB"
        assert not spawned, spawned
        assert not list(case.glob("marker-*")), o.err
        new = [
            m
            for m in set(sys.modules) - before
            if m.startswith("transformers_modules")
            or str(getattr(sys.modules[m], "__file__", None) or "").startswith(str(model))
        ]
        assert not new, new
        self.codes.append(code)
        shutil.rmtree(case, ignore_errors=True)
        return o.err


class _Watchdog(threading.Timer):
    fired = False


def _watchdog(model: Path, after: float = 60) -> _Watchdog:
    """A timer that unblocks any reader of a FIFO in ``model`` (opening its write end) and marks the case hung."""

    def unblock() -> None:
        timer.fired = True
        for p in model.iterdir():
            if p.is_fifo():
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass

    timer = _Watchdog(after, unblock)
    timer.daemon = True
    timer.start()
    return timer


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("fuzz-model-dir"))


def _code_file(case: Path, name: str) -> None:
    """A Python file in the model directory that leaves ``case/marker-NAME`` when imported, and spawns a process."""
    marker = case / f"marker-{name}"
    (case / "model" / name).write_text(
        f"import pathlib, subprocess, sys\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        f"subprocess.Popen([sys.executable, '-c', 'open({str(marker) + '.spawn'!r}, \"w\")'])\n"
        "from transformers import LlamaConfig, PreTrainedTokenizer\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-x'\n"
        "class CustomTokenizer(PreTrainedTokenizer):\n    pass\n"
    )


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:  # a hole: no disk used
        f.truncate(size)


ODD = st.one_of(
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 255, 256, 1000, 2**31, 10**6, 10**9, 2**63, 10**30, -(2**63)]),
    st.integers(-(10**4), 10**4),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["llama", "qwen2", "custom-x", "\x1b[31m", "\ud800", "", "float16"]),
    st.lists(st.integers(-3, 300), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers(-3, 3), max_size=3),
)
"""Values for a config field: sizes small, huge and negative; other types; hostile text."""
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "model_type",
    "architectures",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "dtype",
    "pad_token_id",
    "hidden_act",
    "auto_map",
    "custom_pipelines",
    "text_config",
    "quantization_config",
    "_name_or_path",
    "use_cache",
)


@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), ODD), min_size=1, max_size=3))
@settings(FUZZ, max_examples=24)
def test_config_fields(box, edits):
    """config.json fields set to other values and types, or new ones added (custom code among them)."""
    case = box.copy()
    config = dict(box.config)
    for key, value in edits:
        config[key] = value
    _write_json(case / "model" / "config.json", config)
    code = any(config.get(k) for k in ("auto_map", "custom_pipelines"))
    bad = not isinstance(config["model_type"], str) or not config["model_type"] or code
    box.run(case, {2} if bad else {0, 2}, "names custom code" if code else None)


@given(
    op=st.sampled_from(["truncate", "flip", "insert", "replace"]),
    at=st.integers(0, 10**4),
    junk=st.binary(min_size=1, max_size=16),
)
@settings(FUZZ, max_examples=10)
def test_config_bytes(box, op, at, junk):
    """config.json's bytes truncated, flipped, spliced or replaced."""
    case = box.copy()
    path = case / "model" / "config.json"
    data = path.read_bytes()
    at %= len(data)
    data = {
        "truncate": data[:at],
        "flip": data[:at] + bytes([data[at] ^ junk[0]]) + data[at + 1 :],
        "insert": data[:at] + junk + data[at:],
        "replace": junk,
    }[op]
    path.write_bytes(data)
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    ok = isinstance(parsed, dict) and isinstance(parsed.get("model_type"), str) and parsed["model_type"]
    box.run(case, {0, 2} if ok else {2}, None if ok else str(path))


TOKENIZER_KEYS = (
    "tokenizer_class",
    "model_max_length",
    "bos_token",
    "unk_token",
    "chat_template",
    "auto_map",
    "tokenizer_file",
    "vocab_file",
    "added_tokens_decoder",
    "name_or_path",
    "backend",
)


@given(
    file=st.sampled_from(
        ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"]
    ),
    op=st.sampled_from(["truncate", "junk", "delete", "field", "outside"]),
    at=st.integers(0, 10**6),
    key=st.sampled_from(TOKENIZER_KEYS),
    value=ODD,
)
@settings(FUZZ, max_examples=16)
def test_tokenizer_files(box, file, op, at, key, value):
    """Tokenizer and generation files truncated, replaced, deleted, given odd fields or paths outside the directory."""
    case = box.copy()
    path = case / "model" / file
    data = path.read_bytes() if path.exists() else b"{}"
    if op == "truncate":
        path.write_bytes(data[: at % max(1, len(data))])
    elif op == "junk":
        path.write_bytes(b"\xff\x00 not json")
    elif op == "delete":
        path.unlink(missing_ok=True)
    else:
        obj = json.loads(data)
        obj[key if op == "field" else key if key.endswith("_file") else "tokenizer_file"] = (
            value if op == "field" else str(box.outside / "tokenizer.json")
        )
        _write_json(path, obj)
    code = file == "tokenizer_config.json" and op == "field" and key == "auto_map" and bool(value)
    box.run(case, {2} if code else {0, 2}, "names custom code" if code else None)


@pytest.mark.parametrize("where", ["config", "tokenizer", "nested", "unknown-type", "unused-file", "custom-generate"])
@given(name=st.sampled_from(["configuration_x", "modeling_x", "tokenization_x", "x"]))
@settings(FUZZ, max_examples=2)
def test_custom_code(box, where, name):
    """Custom code named from config.json or tokenizer_config.json, or merely present: never imported or run."""
    case = box.copy()
    model = case / "model"
    _code_file(case, f"{name}.py")
    ref = f"{name}.CustomConfig" if where != "tokenizer" else [f"{name}.CustomTokenizer", None]
    if where == "config":
        _write_json(model / "config.json", {**box.config, "model_type": "custom-x", "auto_map": {"AutoConfig": ref}})
    elif where == "tokenizer":
        _write_json(
            model / "tokenizer_config.json",
            {**box.tokenizer_config, "tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ref}},
        )
    elif where == "nested":
        _write_json(model / "config.json", {**box.config, "text_config": {"auto_map": {"AutoConfig": ref}}})
    elif where == "unknown-type":  # no auto_map: transformers must refuse the unknown type, not look for code
        _write_json(model / "config.json", {**box.config, "model_type": "custom-x"})
    elif where == "custom-generate":  # transformers runs custom_generate/generate.py only when trusted
        (model / "custom_generate").mkdir()
        shutil.move(model / f"{name}.py", model / "custom_generate" / "generate.py")
    named = where in ("config", "tokenizer", "nested")
    box.run(case, {2} if named or where == "unknown-type" else {0, 2}, "names custom code" if named else None)


KINDS = ("fifo", "dir", "dangling", "loop", "inner-link", "empty", "sparse")


@given(
    file=st.sampled_from(
        [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
            "generation_config.json",
            "chat_template.jinja",
        ]
    ),
    kind=st.sampled_from(KINDS),
)
@settings(FUZZ, max_examples=14)
def test_file_kinds(box, file, kind):
    """A FIFO, a directory, a dangling or looping link, a link inside, an empty or a huge sparse file in a file's
    place."""
    case = box.copy()
    path = case / "model" / file
    keep = path.read_bytes() if path.exists() else b"{}"
    path.unlink(missing_ok=True)
    make: dict[str, Callable[[], None]] = {
        "fifo": lambda: os.mkfifo(path),
        "dir": lambda: path.mkdir(),
        "dangling": lambda: path.symlink_to(case / "model" / "nowhere"),
        "loop": lambda: path.symlink_to(path),
        "inner-link": lambda: ((case / "model" / "kept").write_bytes(keep), path.symlink_to("kept")),
        "empty": lambda: path.write_bytes(b""),
        "sparse": lambda: _sparse(path, 1 << 30),
    }
    make[kind]()
    refused = kind in ("fifo", "sparse") or file == "config.json" and kind != "inner-link"
    box.run(case, {2} if refused else {0, 2}, None if kind != "fifo" else "a FIFO")


def test_the_suite_saw_both_outcomes(box):
    """Ran last in the module: the damage above both loads and fails (a suite that only refuses proves little)."""
    print(
        f"model-directory fuzz: {len(box.codes)} cases, {box.codes.count(0)} loaded and dumped, "
        f"{box.codes.count(2)} refused"
    )
    assert {0, 2} <= set(box.codes), box.codes
