"""How much one logprob source may hold: limits checked before anything is allocated.

Every source kind (engine JSONL, a dump's logprob rows, a llama.cpp base file) refuses input
over these limits with a UsageError or CorruptDumpError naming the file, so a corrupt or
hostile file cannot make the comparator allocate without bound.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "TOKEN_ID_LIMIT",
    "MAX_VOCAB",
    "MAX_POSITIONS",
    "MAX_TOTAL_POSITIONS",
    "MAX_KLD_POSITIONS",
    "MAX_LINE_BYTES",
    "limit_text",
]

TOKEN_ID_LIMIT: Final = 1 << 31
"""Token ids must lie in ``[0, TOKEN_ID_LIMIT)``: engines store them as int32, so anything else
(negative, or absurdly large) is a corrupt line, never a token."""
MAX_VOCAB: Final = 1 << 21
"""Largest vocabulary a source may declare (a llama.cpp base file's ``n_vocab``), checked before any
row is sized: 2,097,152, 8x Gemma 3's 262,144 and above every released tokenizer (XLM-V's 901,629
is the largest known). A float64 row of it is 16 MiB, so a KL pass's four row buffers stay at 64 MiB."""
MAX_POSITIONS: Final = 1 << 22
"""Most positions one response may claim (SGLang's ``prompt_tokens``), checked before allocating."""
MAX_TOTAL_POSITIONS: Final = 1 << 22
"""Most positions all the sequences of one source (a JSONL file, a dump) may hold together, the
unscored prefix slots included, checked before allocating them: one longest response fits. An
unscored slot costs ~16 bytes kept (token id and logprob tuple slots) and ~40 while its sequence
is built; measured, comparing two sources at this limit peaks at 340 MiB RSS (2x the limit: 470)."""
MAX_KLD_POSITIONS: Final = MAX_TOTAL_POSITIONS // 2
"""Most positions (``n_ctx * n_chunk``) a llama.cpp base file may hold (2,097,152: 4096 chunks of
512): every position carries a token id and every other one a scored logprob, so a position
costs more than a JSONL file's (at MAX_TOTAL_POSITIONS two base files peaked at 625 MiB RSS).
Measured, comparing two base files at this limit peaks at 330 MiB RSS; the KL pass's row buffers
add at most ~70 MiB (two files of :data:`MAX_VOCAB`: 112 MiB in all)."""
MAX_LINE_BYTES: Final = 128 << 20
"""Longest JSONL line (one response) read; a longer one is refused before it is parsed (and a
shorter one too when building its JSON objects would take over
:func:`dumper.format.files.json_memory_budget`)."""


def limit_text(limit: int) -> str:
    """The end of a "... are over the limit" message: ``limit`` positions left, and both limits."""
    return (
        f"the limit: {limit} positions left for this response (at most {MAX_POSITIONS} per response "
        f"and {MAX_TOTAL_POSITIONS} in all of a file's responses)"
    )
