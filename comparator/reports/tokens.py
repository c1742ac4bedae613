"""Token ids and texts of a dump's prompts, for reports: "position 57 is token 104 'e'".

A dump's manifest records each prompt's token ids (``extra["input_ids"]``, sequence ``s`` =
prompt ``s``). Texts need the tokenizer: the built-in presets use the byte-level
:class:`~dumper.tokenizers.ByteTokenizer` (no torch). A model directory's tokenizer is used only
when the caller passes it (``tokenizer=load_tokenizer(DIR)``, :func:`dumper.tokenizers.load_tokenizer`):
the directory a manifest names is not one the user named, so it is never read on the manifest's
word (nothing outside the dumps given is opened). Otherwise reports show ids only.

Example::

    from dumper.format import load_manifest
    tokens = TokenLookup.from_manifest(load_manifest("dumps/a"))
    tokens.token(0, 57)        # (104, 'e')
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from dumper.format import Manifest
from dumper.format.decode import scored_tokens
from dumper.tokenizers import PRESETS, ByteTokenizer, Tokenizer

__all__ = ["TokenLookup", "tokenizer_for", "show_text"]


def tokenizer_for(manifest: Manifest) -> Tokenizer | None:
    """The tokenizer a dump's manifest alone gives: the byte tokenizer for a preset, else None (no file read)."""
    name = manifest.model.get("name")
    return ByteTokenizer(256 + ByteTokenizer.offset) if type(name) is str and name in PRESETS else None


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
        ids = scored_tokens(manifest.extra)  # the prompts, and what a decode generated after them
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
            ids = [int(t) for t in self._ids[seq][max(0, position - before) : position]]
            return self.tokenizer.decode(ids)
        except (TypeError, ValueError, IndexError):
            return None
