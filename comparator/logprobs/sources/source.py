"""One side of a logprob comparison (:class:`LogprobSource`) and the checks that span both sides.

A source holds per-request sequences and, when recorded, full distributions (logits rows in
memory, or a llama.cpp base file read on demand). :func:`check_vocabulary` and
:func:`one_sided_parts` look at both sides before anything is compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from comparator.logprobs.kl_stream import Distributions
from comparator.logprobs.types import SequenceLogprobs
from dumper.errors import UsageError
from dumper.format import LOGITS, LOGPROB_TOP_VALUE, Manifest

__all__ = ["LogprobSource", "check_vocabulary", "one_sided_parts"]


@dataclass(frozen=True)
class LogprobSource:
    """Logprobs of one side: per-request sequences and, when recorded, logits rows per request.

    ``vocab_size`` is known for a dump that recorded logits rows (their width) or names it in
    its model identity; every token id of both sides is checked against it.
    """

    path: str
    model: str | None
    sequences: tuple[SequenceLogprobs, ...]
    logits: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None
    vocab_size: int | None = None
    manifest: Manifest | None = None
    """The dump's manifest (None for an engine file): its model identity is checked before comparing."""
    distributions: Distributions | None = None
    """Full distributions read on demand (a llama.cpp base file), instead of in-memory ``logits``."""
    dtype: str | None = None
    """The precision the logprobs carry, for the threshold rows: a dump's dtype; ``float16`` for a
    llama.cpp base file (16-bit log-probs, each within about 1.2e-4 of the exact one); None for JSONL."""


def _has_top(src: LogprobSource) -> bool:
    return any(seq.top is not None and any(t is not None for t in seq.top) for seq in src.sequences)


def one_sided_parts(base: LogprobSource, targ: LogprobSource) -> tuple[list[str], list[str]]:
    """The parts recorded on one side only, as (baseline-only, target-only) names: ``"logits"``
    (full rows, ``--save-logits``) and ``"logprobs.top_logprob"`` (top-k lists of any request,
    ``--top-k``). Their metrics (KL, top-1 agreement; top-k errors) need both sides, so a verdict
    without them must say what went uncompared rather than pass silently."""
    parts = ((LOGITS, lambda s: s.logits is not None or s.distributions is not None), (LOGPROB_TOP_VALUE, _has_top))
    b = [name for name, has in parts if has(base) and not has(targ)]
    t = [name for name, has in parts if has(targ) and not has(base)]
    return b, t


def check_vocabulary(*sources: LogprobSource) -> None:
    """Every token id of every source lies in the vocabulary of each source that knows its size.

    Raises UsageError naming the source, request, position and id (an id no model can emit means
    a corrupt or mismatched file, whatever its logprob says).
    """
    for known in sources:
        if known.vocab_size is not None:
            for src in sources:
                _check_vocab(src, known.vocab_size, f"the model of {known.path}")


def _check_vocab(src: LogprobSource, vocab: int, why: str) -> None:
    """Every token id of ``src`` (sequence and top-k) lies in ``[0, vocab)``."""
    for seq in src.sequences:
        bad = next(((p, t) for p, t in enumerate(seq.token_ids) if t >= vocab), None)
        if bad is None and seq.top is not None:
            bad = next(((p, t) for p, tk in enumerate(seq.top) if tk for t, _ in tk if t >= vocab), None)
        if bad is not None:
            raise UsageError(
                f"{src.path}: request {seq.request!r} position {bad[0]}: token id {bad[1]} is outside "
                f"the vocabulary [0, {vocab}) of {why}"
            )
