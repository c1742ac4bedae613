"""Tokenizers without torch: the presets' names and their byte-level tokenizer, and the protocol
every tokenizer driftscope uses follows (a local HF directory's own one: :func:`load_tokenizer`, which imports transformers when called).

The comparator's reports read token texts through this module, so rendering a report of a
preset dump never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

from dumper.errors import ModelError, UsageError, error_reason

__all__ = ["PRESETS", "Tokenizer", "ByteTokenizer", "load_tokenizer", "held_transformers_logs"]

PRESETS = ("tiny-llama", "tiny-qwen2")
"""The built-in models (``configs/<name>.json``), built by :func:`dumper.jobs.presets.load_model`."""


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


@contextlib.contextmanager
def held_transformers_logs(held: list[logging.LogRecord]) -> Iterator[None]:
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
        with held_transformers_logs([]):
            return _HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - the load boundary, as for the model
        raise ModelError(f"{path}: cannot load its tokenizer ({error_reason(e)}); "
                         "fix or remove the tokenizer files") from None
