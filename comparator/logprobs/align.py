"""Match the requests of two sides and keep the positions both score (teacher forcing: position i
of one run is directly comparable with position i of the other).

Token ids (else texts) must agree wherever both sides know the token, and matched requests must
cover the same positions: anything else raises NotComparableError naming the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from comparator.logprobs.types import UNKNOWN_TOKEN, AlignedSample, Alignment, SequenceLogprobs
from dumper.errors import NotComparableError, UsageError

__all__ = ["align_samples", "check_lengths"]


def _index(side: Sequence[SequenceLogprobs], name: str) -> dict[str, SequenceLogprobs]:
    out: dict[str, SequenceLogprobs] = {}
    for s in side:
        if s.request in out:
            raise UsageError(f"duplicate request id {s.request!r} in the {name} logprobs")
        out[s.request] = s
    return out


def _check_tokens(a: SequenceLogprobs, b: SequenceLogprobs) -> None:
    """Raise NotComparableError at the first position both cover whose tokens differ."""
    n = min(len(a), len(b))
    if a.token_ids and b.token_ids:
        x = np.asarray(a.token_ids[:n], dtype=np.int64)
        y = np.asarray(b.token_ids[:n], dtype=np.int64)
        bad = np.flatnonzero((x != y) & (x != UNKNOWN_TOKEN) & (y != UNKNOWN_TOKEN))
        if bad.size:
            i = int(bad[0])
            raise NotComparableError(
                f"request {a.request!r}: token mismatch at position {i}: baseline token id {int(x[i])}, "
                f"target token id {int(y[i])}"
            )
    elif a.token_texts is not None and b.token_texts is not None:
        for i, (s, t) in enumerate(zip(a.token_texts[:n], b.token_texts[:n], strict=True)):
            if s != t:
                raise NotComparableError(
                    f"request {a.request!r}: token mismatch at position {i}: baseline token {s!r}, target token {t!r}"
                )
    elif n:
        raise NotComparableError(
            f"request {a.request!r}: cannot check token agreement: one side has ids, the other only text"
        )


def align_samples(base: Sequence[SequenceLogprobs], target: Sequence[SequenceLogprobs]) -> Alignment:
    """Match requests by id and keep the positions where both sides have a logprob.

    Token ids (else texts) must agree wherever both sides know the token, or the logprobs score
    different things: a mismatch raises NotComparableError naming the request, position and both
    tokens. Requests on one side only are listed, not an error; no matched request or no compared
    position is a NotComparableError (an empty comparison must never pass).
    """
    b, t = _index(base, "baseline"), _index(target, "target")
    samples = []
    for rid, a in b.items():
        c = t.get(rid)
        if c is None:
            continue
        _check_tokens(a, c)
        n = min(len(a), len(c))
        pos = np.asarray(
            [i for i in range(n) if a.logprobs[i] is not None and c.logprobs[i] is not None], dtype=np.int64
        )
        samples.append(
            AlignedSample(
                request=rid,
                positions=pos,
                ref=np.asarray([a.logprobs[i] for i in pos], dtype=np.float64),
                tgt=np.asarray([c.logprobs[i] for i in pos], dtype=np.float64),
                ref_top=None if a.top is None else tuple(a.top[i] for i in pos),
                tgt_top=None if c.top is None else tuple(c.top[i] for i in pos),
            )
        )
    out = Alignment(tuple(samples), tuple(r for r in b if r not in t), tuple(r for r in t if r not in b))
    if not samples:
        raise NotComparableError(
            f"no request id in common ({len(b)} baseline, {len(t)} target requests): nothing to compare"
        )
    if out.compared_positions == 0:
        raise NotComparableError(f"{len(samples)} matched requests but no position where both sides have a logprob")
    return out


def check_lengths(base: Sequence[SequenceLogprobs], target: Sequence[SequenceLogprobs]) -> None:
    """Raise NotComparableError for a request whose two sides cover different numbers of positions.

    A shorter side is missing data (a truncated response, a prompt without its output): comparing
    only the common prefix would pass positions that were never compared.
    """
    lengths = {s.request: len(s) for s in target}
    for a in base:
        n = lengths.get(a.request)
        if n is not None and n != len(a):
            raise NotComparableError(
                f"request {a.request!r}: the baseline covers {len(a)} positions, the target {n}; both sides must "
                "score the same tokens (the same prompt, and the same output if any)"
            )
