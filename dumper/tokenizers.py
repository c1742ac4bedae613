"""Tokenizers without torch: the presets' names and their byte-level tokenizer, and the protocol
every tokenizer driftscope uses follows (a local HF directory's own one: :func:`load_tokenizer`,
which imports transformers when called).

The comparator's reports read token texts through this module, so rendering a report of a
preset dump never imports torch.
"""

from __future__ import annotations

from typing import Any, Protocol

from dumper.errors import UsageError

__all__ = ["PRESETS", "Tokenizer", "ByteTokenizer", "load_tokenizer"]

PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-mixtral")
"""The built-in models (``configs/<name>.json``), built by :func:`dumper.prefill.presets.load_model`."""


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


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a local HF model directory (offline), or None when it has no tokenizer files.

    The directory is checked first (:func:`dumper.modeldir.load_hf_tokenizer`: no custom code,
    regular files only); one that fails, or tokenizer files transformers cannot load, raise
    :class:`ModelError` naming the directory.
    """
    from dumper.modeldir import load_hf_tokenizer

    tok = load_hf_tokenizer(path)
    return None if tok is None else _HFTokenizer(tok)
