"""Models to run: built-in tiny presets (random weights, fixed seed, no network) and local HF dirs.

A preset is a HF config in ``configs/<name>.json``; its weights come from the model's own
initializer under ``torch.manual_seed(seed)`` in float32 (then cast), so every machine with
the same torch and transformers builds the same weights. Presets use :class:`ByteTokenizer`.

Loading is a trust boundary: a local directory whose config is broken, names an architecture
transformers cannot build, or whose weights do not fit it raises :class:`UsageError` (exit 2)
with one line naming the directory and the reason, never a transformers traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch
from torch import nn

from dumper.errors import ModelError, UsageError, error_reason
from dumper.format import dtypes
from dumper.format.dtypes import MODEL_DTYPES
from dumper.resources import config_path
from dumper.tokenizers import (
    PRESETS,
    ByteTokenizer,
    Tokenizer,
    held_transformers_logs,
    load_tokenizer,
)

__all__ = ["PRESETS", "ByteTokenizer", "Tokenizer", "load_model", "model_label", "check_config_file"]


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

    if dtype not in MODEL_DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(MODEL_DTYPES)}")
    torch_dtype = dtypes.torch_dtype(dtype)
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
            with held_transformers_logs(held):
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
