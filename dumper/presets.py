"""Models to run: built-in tiny presets (random weights, fixed seed, no network) and local HF dirs.

A preset is a HF config in ``configs/<name>.json``; its weights come from the model's own
initializer under ``torch.manual_seed(seed)`` in float32 (then cast), so every machine with
the same torch and transformers builds the same weights. Presets use :class:`ByteTokenizer`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .errors import UsageError

__all__ = ["PRESETS", "CONFIG_DIR", "ByteTokenizer", "Tokenizer", "load_model", "load_tokenizer", "DTYPES"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PRESETS = ("tiny-llama", "tiny-qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids (0 pad, 1 bos, 2 eos), with a leading bos."""

    offset = 3

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + self.offset:
            raise UsageError(f"a byte tokenizer needs vocab_size >= {256 + self.offset}, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [1] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset).decode("utf-8", "replace")


class _HFTokenizer:
    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def _preset_config(name: str, attn: str) -> Any:
    from transformers import AutoConfig

    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise UsageError(f"{path}: preset config not found (is driftscope installed with `pip install -e .`?)")
    raw = json.loads(path.read_text())
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = attn
    return config


def load_model(name_or_dir: str, *, dtype: str = "float32", attn: str = "eager", device: str = "cpu",
               seed: int = 0) -> tuple[nn.Module, Tokenizer | None]:
    """Load a preset or a local HF model directory (offline), in eval mode, on ``device``.

    Returns the model and a tokenizer (``None`` for a local dir without one).
    """
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if name_or_dir in PRESETS:
        config = _preset_config(name_or_dir, attn)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        model = model.to(torch_dtype)
        tokenizer: Tokenizer | None = ByteTokenizer(config.vocab_size)
    elif os.path.isdir(name_or_dir):
        if not os.path.isfile(os.path.join(name_or_dir, "config.json")):
            raise UsageError(f"{name_or_dir}: not a HF model directory (no config.json)")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_dir, dtype=torch_dtype, attn_implementation=attn, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UsageError(f"{name_or_dir}: cannot load model ({str(e).splitlines()[0]})") from None
        tokenizer = load_tokenizer(name_or_dir)
    else:
        raise UsageError(f"model {name_or_dir!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    try:
        model = model.to(device)
    except (RuntimeError, AssertionError) as e:
        raise UsageError(f"cannot move the model to device {device!r} ({e})") from None
    model.eval()
    return model, tokenizer


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a local HF model directory (offline), or None when it has none."""
    from transformers import AutoTokenizer

    try:
        return _HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, TypeError):
        return None
