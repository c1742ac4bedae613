"""How much one logprob source may hold: limits checked before anything is allocated.

Every source kind (engine JSONL, a dump's logprob rows, a llama.cpp base file) refuses input
over these limits with a UsageError or CorruptDumpError naming the file, so a corrupt or
hostile file cannot make the comparator allocate without bound.
"""

from __future__ import annotations

from typing import Final

__all__ = ["TOKEN_ID_LIMIT", "MAX_POSITIONS", "MAX_TOTAL_POSITIONS", "MAX_LINE_BYTES", "limit_text"]

TOKEN_ID_LIMIT: Final = 1 << 31
"""Token ids must lie in ``[0, TOKEN_ID_LIMIT)``: engines store them as int32, so anything else
(negative, or absurdly large) is a corrupt line, never a token."""
MAX_POSITIONS: Final = 1 << 22
"""Most positions one response may claim (SGLang's ``prompt_tokens``), checked before allocating."""
MAX_TOTAL_POSITIONS: Final = 1 << 22
"""Most positions all the sequences of one source (a JSONL file, a dump) may hold together, the
unscored prefix slots included, checked before allocating them: one longest response fits. An
unscored slot costs ~16 bytes kept (token id and logprob tuple slots) and ~40 while its sequence
is built; measured, comparing two sources at this limit peaks at 340 MiB RSS (2x the limit: 470)."""
MAX_LINE_BYTES: Final = 128 << 20
"""Longest JSONL line (one response) read; a longer one is refused before it is parsed (and a
shorter one too when building its JSON objects would take over
:func:`dumper.format.files.json_memory_budget`)."""


def limit_text(limit: int) -> str:
    """The end of a "... are over the limit" message: ``limit`` positions left, and both limits."""
    return (f"the limit: {limit} positions left for this response (at most {MAX_POSITIONS} per response "
            f"and {MAX_TOTAL_POSITIONS} in all of a file's responses)")
