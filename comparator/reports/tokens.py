"""Token ids and texts of a dump's prompts, for reports: "position 57 is token 104 'e'".

A dump's manifest records each prompt's token ids (``extra["input_ids"]``, sequence ``s`` =
prompt ``s``). Texts need the tokenizer: the built-in presets use the byte-level
:class:`~dumper.tokenizers.ByteTokenizer` (no torch); a local HF model directory's own tokenizer
is loaded offline when it is still there. Otherwise texts are unknown and reports show ids only.

Nothing here imports torch for a preset; a local HF directory's tokenizer imports transformers
(:func:`dumper.tokenizers.load_tokenizer`), only when such a dump is shown.

Example::

    from dumper.format import load_manifest
    tokens = TokenLookup.from_manifest(load_manifest("dumps/a"))
    tokens.token(0, 57)        # (104, 'e')
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from dumper.errors import DriftscopeError
from dumper.format import Manifest
from dumper.tokenizers import PRESETS, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["TokenLookup", "tokenizer_for", "show_text"]


def tokenizer_for(manifest: Manifest) -> Tokenizer | None:
    """The tokenizer of the dump's model: the byte tokenizer for presets, a local HF dir's own, else None."""
    name = str(manifest.model.get("name") or "")
    if not name:
        return None
    if name in PRESETS:
        return ByteTokenizer(256 + ByteTokenizer.offset)
    if os.path.isfile(os.path.join(name, "tokenizer_config.json")):
        try:
            return load_tokenizer(name)
        except (ImportError, DriftscopeError):  # token text is a nicety: never fail a comparison over it
            return None
    return None


def show_text(text: str | None) -> str:
    """A token's text quoted with escapes, so spaces and newlines are visible: ``" fox"``, ``"\\n"``."""
    return "?" if text is None else json.dumps(text, ensure_ascii=False)


class TokenLookup:
    """Token id and text at (sequence, position) of one dump's prompts."""

    def __init__(self, input_ids: Sequence[Sequence[int]], tokenizer: Tokenizer | None = None) -> None:
        self._ids = input_ids
        self.tokenizer = tokenizer

    @classmethod
    def from_manifest(cls, manifest: Manifest | None, tokenizer: Tokenizer | None = None) -> TokenLookup:
        """Ids from ``manifest.extra["input_ids"]``; ``tokenizer`` default: :func:`tokenizer_for`."""
        if manifest is None:
            return cls([], tokenizer)
        ids = manifest.extra.get("input_ids") or []
        return cls(ids, tokenizer if tokenizer is not None else tokenizer_for(manifest))

    def token(self, sequence: int | str | None, position: int) -> tuple[int | None, str | None]:
        """(token id, text) at ``position`` of ``sequence``; None for what is unknown."""
        try:
            seq = int(sequence)  # a dump's request ids are its sequence numbers
        except (TypeError, ValueError):
            return None, None
        if not 0 <= seq < len(self._ids) or not 0 <= position < len(self._ids[seq]):
            return None, None
        tid = int(self._ids[seq][position])
        if self.tokenizer is None:
            return tid, None
        try:
            return tid, self.tokenizer.decode([tid])
        except (KeyError, IndexError, ValueError, TypeError, OverflowError):  # an id it cannot decode
            return tid, None

    def context(self, sequence: int | str | None, position: int, before: int = 12) -> str | None:
        """The text of the ``before`` tokens ahead of ``position`` (None when texts are unknown)."""
        if self.tokenizer is None:
            return None
        try:
            seq = int(sequence)
            ids = [int(t) for t in self._ids[seq][max(0, position - before):position]]
            return self.tokenizer.decode(ids)
        except (TypeError, ValueError, IndexError):
            return None
