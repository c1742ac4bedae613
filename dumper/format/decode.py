"""The decode path in a dump: which rows a decode step wrote, what each sequence generated, what a counterpart fed.

A ``python -m dumper run --new-tokens N`` dump holds, per sequence, the prompt pass and then one
forward pass per decode step. Step ``s`` feeds the ``s``-th generated token at position
``len(prompt) + s``; its rows carry ``meta = {"phase": "decode", "decode_step": s}``. The
manifest's ``extra`` says what was generated:

- ``input_ids``: the prompts, as in every dump;
- ``new_tokens``: N; ``generated_ids``: per sequence the N greedy tokens (the last one is scored
  by ``--logprobs`` but never fed, so the rows stop at step N-2).

Its counterpart (``python -m dumper run --tokens-from DUMP``) is a prefill of each prompt plus
the tokens it fed back: ``input_ids`` are those, ``next_ids`` the one token after each (the last
generated token, whose logprob it records too) and ``prompt_lengths`` where the decode part
begins. Both dumps then hold the same positions, and their logprobs score the same tokens:
:func:`scored_tokens`.

The readers here take a manifest that :mod:`dumper.format.validate` has checked with
:func:`check_decode_extra` and :func:`check_decode_meta`, so nothing raises on a loaded dump.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dumper.format.files import bad_field

__all__ = [
    "PHASE_KEY",
    "DECODE_STEP_KEY",
    "PREFILL",
    "CACHE_HIT",
    "DECODE",
    "PHASES",
    "NEW_TOKENS",
    "GENERATED_IDS",
    "NEXT_IDS",
    "PROMPT_LENGTHS",
    "TOKENS_FROM",
    "check_decode_extra",
    "check_decode_meta",
    "scored_tokens",
    "generated_ids",
    "prompt_lengths",
    "record_phase",
]

PHASE_KEY = "phase"
"""Record meta key: the phase of the forward pass that wrote the rows (absent: ``prefill``)."""
DECODE_STEP_KEY = "decode_step"
"""Record meta key: the decode step (0 = the pass that fed the first generated token)."""
PREFILL, DECODE = "prefill", "decode"
CACHE_HIT = "cache hit"
"""The phase a comparison gives a ``k_cache``/``v_cache`` row the prefix cache served (not one the run wrote)."""
PHASES = (PREFILL, DECODE)
NEW_TOKENS = "new_tokens"
"""``extra`` key: tokens generated per sequence (``--new-tokens``)."""
GENERATED_IDS = "generated_ids"
"""``extra`` key: per sequence, the tokens the decode generated."""
NEXT_IDS = "next_ids"
"""``extra`` key of a ``--tokens-from`` dump: per sequence, the token after its input whose logprob it records."""
PROMPT_LENGTHS = "prompt_lengths"
"""``extra`` key of a ``--tokens-from`` dump: per sequence, where the decode dump's generated tokens begin."""
TOKENS_FROM = "tokens_from"
"""``extra`` key of a ``--tokens-from`` dump: the decode dump it took its tokens from."""


def _lists(extra: Mapping[str, Any], key: str) -> list[list[int]] | None:
    value = extra.get(key)
    return None if value is None else [list(s) for s in value]


def generated_ids(extra: Mapping[str, Any]) -> list[list[int]] | None:
    """Per sequence, the tokens a ``--new-tokens`` run generated (None: not a decode dump)."""
    return _lists(extra, GENERATED_IDS)


def prompt_lengths(extra: Mapping[str, Any]) -> list[int] | None:
    """Per sequence, where its generated tokens begin: the prompts' lengths in a decode dump, the recorded
    ``prompt_lengths`` in a ``--tokens-from`` dump; None for a dump with no decode part."""
    if extra.get(GENERATED_IDS) is not None:
        return [len(p) for p in extra.get("input_ids") or []]
    lengths = extra.get(PROMPT_LENGTHS)
    return None if lengths is None else [int(n) for n in lengths]


def scored_tokens(extra: Mapping[str, Any]) -> list[list[int]]:
    """Per sequence, the token at every position a run's logprobs may score: its input, then the
    generated tokens (a decode dump) or the next token (a ``--tokens-from`` dump)."""
    inputs = [list(s) for s in extra.get("input_ids") or []]
    after = _lists(extra, GENERATED_IDS) or _lists(extra, NEXT_IDS) or []
    return [s + (after[i] if i < len(after) else []) for i, s in enumerate(inputs)]


def record_phase(meta: Mapping[str, Any]) -> tuple[str, int | None]:
    """(phase, decode step) of a record from its ``meta``: ``("prefill", None)`` unless a decode step wrote it."""
    if meta.get(PHASE_KEY) == DECODE:
        step = meta.get(DECODE_STEP_KEY)
        return DECODE, step if type(step) is int else None
    return PREFILL, None


def check_decode_extra(extra: dict, where: str) -> None:
    """The decode fields of ``extra`` (:mod:`dumper.format.decode`): ``new_tokens`` an integer >= 0;
    ``generated_ids`` (``new_tokens`` tokens per prompt) and ``next_ids`` (one per prompt) token id lists, one
    per ``input_ids`` entry; ``prompt_lengths`` integers within each input."""
    inputs = extra.get("input_ids") or []
    new = extra.get(NEW_TOKENS)
    if new is not None and (type(new) is not int or new < 0):
        raise bad_field(where, "extra.new_tokens", "an integer >= 0", new)
    for key, size in ((GENERATED_IDS, new), (NEXT_IDS, 1)):
        lists = extra.get(key)
        if lists is None:
            continue
        if type(lists) is not list or len(lists) != len(inputs):
            raise bad_field(where, f"extra.{key}", f"a list of {len(inputs)} token id lists (one per input)", lists)
        for s, seq in enumerate(lists):
            if (
                type(seq) is not list
                or not all(type(t) is int and t >= 0 for t in seq)
                or size is not None
                and len(seq) != size
            ):
                want = "" if size is None else f"{size} "
                raise bad_field(where, f"extra.{key}[{s}]", f"a list of {want}integers >= 0", seq)
    lengths = extra.get(PROMPT_LENGTHS)
    if lengths is not None:
        if type(lengths) is not list or len(lengths) != len(inputs):
            raise bad_field(where, "extra.prompt_lengths", f"a list of {len(inputs)} integers", lengths)
        for s, n in enumerate(lengths):
            if type(n) is not int or not 1 <= n <= len(inputs[s]):
                raise bad_field(where, f"extra.prompt_lengths[{s}]", f"an integer in 1..{len(inputs[s])}", n)


def check_decode_meta(meta: Mapping[str, Any], where: str, field: str) -> None:
    """A record's decode meta: ``phase`` one of :data:`PHASES`, ``decode_step`` an integer >= 0 on a decode record."""
    phase, step = meta.get(PHASE_KEY), meta.get(DECODE_STEP_KEY)
    if phase is not None and phase not in PHASES:
        raise bad_field(where, f"{field}.phase", " or ".join(PHASES), phase)
    if step is not None and (type(step) is not int or step < 0 or phase != DECODE):
        raise bad_field(where, f"{field}.decode_step", "an integer >= 0 on a decode record", step)
