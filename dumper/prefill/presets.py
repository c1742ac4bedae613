"""Models to run: built-in tiny presets (random weights, fixed seed, no network) and local HF dirs.

A preset is a HF config in ``configs/<name>.json``; its weights come from the model's own
initializer under ``torch.manual_seed(seed)`` in float32 (then cast), so every machine with
the same torch and transformers builds the same weights. Presets use :class:`ByteTokenizer`.

Loading a local directory is a trust boundary, crossed only through :mod:`dumper.modeldir`:
a directory whose config is broken or names custom code, names an architecture transformers
cannot build, or whose weights do not fit it raises :class:`ModelError` (exit 2) with one line
naming the directory and the reason, never a transformers traceback, and never runs its code.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from dumper.errors import ModelError, UsageError, error_reason
from dumper.format import dtypes
from dumper.format.dtypes import MODEL_DTYPES
from dumper.modeldir import load_causal_lm
from dumper.resources import config_path
from dumper.tokenizers import PRESETS, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["load_model", "model_label"]


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


def load_model(
    name_or_dir: str, *, dtype: str = "float32", attn: str = "eager", device: str = "cpu", seed: int = 0
) -> tuple[nn.Module, Tokenizer | None]:
    """Load a preset or a local HF model directory (offline), in eval mode, on ``device``.

    Returns the model and a tokenizer (``None`` for a local dir without one). A model that
    cannot be loaded raises :class:`UsageError` naming it and the reason.
    """
    if dtype not in MODEL_DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(MODEL_DTYPES)}")
    torch_dtype = dtypes.torch_dtype(dtype)
    if name_or_dir in PRESETS:
        from transformers import AutoModelForCausalLM

        config = _preset_config(name_or_dir, attn)
        config._name_or_path = name_or_dir  # names the model in errors and manifests; not hashed
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, trust_remote_code=False)
        model = model.to(torch_dtype)
        tokenizer: Tokenizer | None = ByteTokenizer(config.vocab_size)
    elif os.path.isdir(name_or_dir):
        model = load_causal_lm(name_or_dir, dtype=torch_dtype, attn=attn)
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
