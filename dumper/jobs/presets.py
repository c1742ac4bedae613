"""Models to run: built-in tiny presets (random weights, fixed seed, no network) and local HF dirs.

A preset is a HF config in ``configs/<name>.json``; its weights come from the model's own
initializer under ``torch.manual_seed(seed)`` in float32 (then cast), so every machine with
the same torch and transformers builds the same weights. Presets use :class:`ByteTokenizer`.

Loading is a trust boundary: a local directory whose config is broken, names an architecture
transformers cannot build, or whose weights do not fit it raises :class:`UsageError` (exit 2)
with one line naming the directory and the reason, never a transformers traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dumper.errors import ModelError, UsageError
from dumper.resources import config_path
from dumper.tokenizers import PRESETS, ByteTokenizer, Tokenizer

__all__ = ["PRESETS", "ByteTokenizer", "Tokenizer", "load_model", "load_tokenizer", "model_label", "error_reason",
           "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _HFTokenizer:
    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def _preset_config(name: str, attn: str) -> Any:
    from transformers import AutoConfig

    path = config_path(f"{name}.json")
    if not path.is_file():
        raise UsageError(f"{path}: preset config not found; the driftscope install is incomplete, reinstall it")
    raw = json.loads(path.read_text())
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = attn
    return config


def load_model(name_or_dir: str, *, dtype: str = "float32", attn: str = "eager", device: str = "cpu",
               seed: int = 0) -> tuple[nn.Module, Tokenizer | None]:
    """Load a preset or a local HF model directory (offline), in eval mode, on ``device``.

    Returns the model and a tokenizer (``None`` for a local dir without one). A model that
    cannot be loaded raises :class:`UsageError` naming it and the reason.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if name_or_dir in PRESETS:
        config = _preset_config(name_or_dir, attn)
        config._name_or_path = name_or_dir  # names the model in errors and manifests; not hashed
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        model = model.to(torch_dtype)
        tokenizer: Tokenizer | None = ByteTokenizer(config.vocab_size)
    elif os.path.isdir(name_or_dir):
        check_config_file(os.path.join(name_or_dir, "config.json"))
        held: list[logging.LogRecord] = []
        try:  # anything transformers raises while building this directory's model is about the model
            with _held_transformers_logs(held):
                model = AutoModelForCausalLM.from_pretrained(
                    name_or_dir, dtype=torch_dtype, attn_implementation=attn, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - the load boundary: no driftscope code runs inside
            detail = _load_report_row(held)
            raise ModelError(f"{name_or_dir}: cannot load model ({error_reason(e)}"
                             f"{'; ' + detail if detail else ''})") from None
        tokenizer = load_tokenizer(name_or_dir)
    else:
        raise UsageError(f"model {name_or_dir!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    try:
        if torch.device(device).type == "meta":
            raise UsageError(f"device {device!r} holds no data; choose cpu or cuda")
        model = model.to(device)
    except (RuntimeError, AssertionError) as e:
        raise ModelError(f"cannot move the model to device {device!r} ({error_reason(e)})") from None
    model.eval()
    return model, tokenizer


def model_label(model: nn.Module) -> str:
    """How errors name a model: its HF name or path (a preset's name), else its class."""
    return getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__


def error_reason(e: BaseException) -> str:
    """One line for an exception raised by model code: its type and its message, joined and cut to 300 characters."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REPORT_ROW = re.compile(r"^(\S+)\s*\|\s*(MISMATCH|MISSING|UNEXPECTED)\s*\|\s*(.*?)\s*$")


def _load_report_row(held: list[logging.LogRecord]) -> str | None:
    """The first weight row of transformers' load report (its errors say "look at the above report")."""
    for record in held:
        for line in _ANSI.sub("", record.getMessage()).splitlines():
            m = _REPORT_ROW.match(line.strip())
            if m:
                return f"{m[1]} {m[2]}{': ' + m[3] if m[3] else ''}"
    return None


_SIZE_KEY = re.compile(r"^(num|n)_|_(size|dim|layers|heads|embeddings|positions)$")
"""Config keys that hold a count or a size (``hidden_size``, ``num_hidden_layers``, ``n_embd``, ...)."""


def check_config_file(path: str) -> dict[str, Any]:
    """Parse a model directory's ``config.json`` and check what transformers would misreport.

    It must be a JSON object with a ``model_type`` string, and no size or count may be
    negative (transformers reports a missing ``model_type`` as invalid JSON, and a negative
    size as a tensor error deep in a layer).
    """
    if not os.path.isfile(path):
        raise ModelError(f"{os.path.dirname(path) or '.'}: not a HF model directory (no config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, RecursionError) as e:
        raise ModelError(f"{path}: not a readable JSON config ({type(e).__name__})") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    if not isinstance(raw.get("model_type"), str) or not raw["model_type"]:
        raise ModelError(f"{path}: no \"model_type\" string (the architecture family, e.g. \"llama\")")
    _check_sizes(path, raw, "")
    return raw


def _check_sizes(path: str, obj: dict[str, Any], prefix: str) -> None:
    for key, value in obj.items():
        if isinstance(value, dict):
            _check_sizes(path, value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool) and value < 0 and _SIZE_KEY.search(key):
            raise ModelError(f"{path}: {prefix}{key} is {value}; a size or count must be >= 0")


@contextlib.contextmanager
def _held_transformers_logs(held: list[logging.LogRecord]) -> Iterator[None]:
    """Hold transformers' log lines and progress bars while loading: replayed on success, dropped on failure.

    A failed load is then one line (its reason is in the error), while a loaded model still
    shows transformers' warnings (say, weights that were missing and got initialized).
    """
    from transformers.utils import logging as hf_logging

    root = hf_logging.get_logger()
    handler = logging.Handler()
    handler.emit = held.append  # type: ignore[method-assign]
    handlers, bars = root.handlers[:], hf_logging.is_progress_bar_enabled()
    for h in handlers:
        root.removeHandler(h)
    root.addHandler(handler)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        root.removeHandler(handler)
        for h in handlers:
            root.addHandler(h)
        if bars:
            hf_logging.enable_progress_bar()
    for record in held:  # only after a successful load
        root.handle(record)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "spiece.model", "special_tokens_map.json")


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a local HF model directory (offline), or None when it has no tokenizer files.

    Tokenizer files that transformers cannot load raise :class:`UsageError` naming the directory.
    """
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    try:
        with _held_transformers_logs([]):
            return _HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - the load boundary, as for the model
        raise ModelError(f"{path}: cannot load its tokenizer ({error_reason(e)}); "
                         "fix or remove the tokenizer files") from None
