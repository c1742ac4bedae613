"""driftscope dumper: capture hidden states from model code into a dump directory.

Example::

    import dumper
    from dumper.prefill.presets import load_model

    model, tokenizer = load_model("tiny-llama")
    with dumper.capture(model, "dumps/a", layers="all"):
        model(torch.tensor([tokenizer.encode("hello world")]))

Then ``python -m comparator dumps/a dumps/b`` compares two such dumps. Importing
``dumper.format`` alone (as the comparator does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from dumper.version import __version__

_EXPORTS = {
    "Capture": "hooks.capture",
    "capture": "hooks.api",
    "tap": "hooks.tap",
    "dump": "hooks.active",
    "step": "hooks.active",
    "active_capture": "hooks.active",
    "DriftscopeError": "errors",
    "DEFAULT_LAYERS": "hooks.layers",
    "parse_layer_spec": "hooks.layers",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    """Import the torch-dependent API on first use and cache it in the module."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dumper' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
