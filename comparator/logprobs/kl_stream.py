"""Full-distribution KL read block by block from sources that do not fit in memory.

A :class:`Distributions` hands out float64 log-probability rows of one side on demand: a
llama.cpp base file (:class:`comparator.logprobs.sources.llama_kld.KldFile`) reads them from disk, a dump's logits
(:class:`LogitsDistributions`) log-softmaxes its (memory-mapped) rows. :func:`stream_kl` walks
the positions both sides have, ``block_elements // V`` rows at a time, and keeps only one KL
value and one top-token flag per position, so its memory is a few blocks whatever the sizes.

Example::

    from comparator.logprobs.kl_stream import stream_kl
    from comparator.logprobs.sources.llama_kld import KldFile
    result = stream_kl(KldFile("f32.kld"), KldFile("q8_0.kld"), aligned_samples)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Final

import numpy as np

from comparator.logprobs.kl import log_softmax_inplace
from comparator.logprobs.types import AlignedSample, KlResult
from dumper.errors import CorruptDumpError, NotComparableError

__all__ = ["Distributions", "LogitsDistributions", "kl_from_logprobs", "stream_kl", "BLOCK_ELEMENTS"]

BLOCK_ELEMENTS: Final = 1 << 19
"""Rows are reduced this many vocabulary entries at a time (float64 temporaries of 4 MiB each)."""


class Distributions:
    """Full distributions of one side, per request, read on demand as float64 log-probability rows."""

    floor: float | None = None
    """As the KL baseline, entries at or below this log-prob are left out (stored values clamped
    there); None: only entries of probability 0 are."""
    vocab_size: int

    def positions(self, request: str) -> np.ndarray | None:
        """Increasing positions of ``request`` that have a distribution (None: the request has none)."""
        raise NotImplementedError

    def rows(self, request: str, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """float64 log-probability rows [len(index), V] at ``positions(request)[index]`` (index
        increasing), written into ``out`` (float64 [len(index), V]) when given."""
        raise NotImplementedError

    def open(self) -> AbstractContextManager[object]:
        """Held around every :meth:`rows` call of a pass (a file stays open once, not per block)."""
        return nullcontext()


class LogitsDistributions(Distributions):
    """A dump's logits rows (``--save-logits``), log-softmaxed block by block."""

    def __init__(self, logits: Mapping[str, tuple[np.ndarray, np.ndarray]], where: str) -> None:
        self._logits, self._where = logits, where
        widths = {np.shape(r)[-1] for _, r in logits.values()}
        if len(widths) != 1:
            raise CorruptDumpError(f"{where}: logits rows of different widths {sorted(widths)}")
        self.vocab_size = int(widths.pop())

    def positions(self, request: str) -> np.ndarray | None:
        if request not in self._logits:
            return None
        pos, rows = self._logits[request]
        p = np.asarray(pos, dtype=np.int64).reshape(-1)
        if np.ndim(rows) != 2 or p.size != np.shape(rows)[0] or (p.size > 1 and bool(np.any(np.diff(p) <= 0))):
            raise CorruptDumpError(
                f"{self._where}: logits of request {request!r}: {p.size} positions, not one "
                f"increasing position per row of {list(np.shape(rows))}"
            )
        return p

    def rows(self, request: str, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        rows = self._logits[request][1]
        lo, hi = int(index[0]), int(index[-1]) + 1
        block = rows[lo:hi] if hi - lo == index.size else rows[index]
        if out is None:
            out = np.empty((index.size, self.vocab_size), dtype=np.float64)
        out[:] = block
        return log_softmax_inplace(out)


def kl_from_logprobs(
    lp: np.ndarray, lq: np.ndarray, *, floor: float | None = None, work: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(KL(P || Q) per row, whether the top tokens agree)`` of two [n, V] log-probability arrays.

    ``sum_i p_i (log p_i - log q_i)`` without renormalizing either side, as llama-perplexity
    computes it from its stored baseline: with ``floor`` the terms whose ``log p_i <= floor`` are
    left out, else those with ``p_i == 0``. Rounded stored values can make the KL of two near-equal
    rows slightly negative, as in llama.cpp; it is not clipped. A row with NaN is 0 when both rows
    are the same, else inf. Top tokens: the first argmax of each row. ``work``: two float64
    arrays of ``lp``'s shape used as scratch (a pass reuses them instead of allocating per block).
    """
    d, p = work if work is not None else (np.empty_like(lp), np.empty_like(lp))
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(lp, lq, out=d)
        np.exp(lp, out=p)
        if floor is not None:
            np.copyto(p, 0.0, where=lp <= floor)
        np.multiply(d, p, out=d)
        np.copyto(d, 0.0, where=p == 0.0)  # 0 * inf (a token the target gives 0) is no term
        kl = np.sum(d, axis=1)
    for r in np.flatnonzero(np.isnan(kl)):
        kl[r] = 0.0 if np.array_equal(lp[r], lq[r], equal_nan=True) else np.inf
    return kl, np.argmax(lp, axis=1) == np.argmax(lq, axis=1)


def _pair(
    ref: Distributions, tgt: Distributions, request: str, block: int, bufs: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, int]:
    """(common positions, KL there, agreeing top tokens) of one request, ``block`` rows at a time
    through the four [block, V] float64 buffers ``bufs``."""
    pa, pb = ref.positions(request), tgt.positions(request)
    if pa is None or pb is None:
        return np.empty(0, np.int64), np.empty(0), 0
    common, ia, ib = np.intersect1d(pa, pb, assume_unique=True, return_indices=True)
    kl = np.empty(common.size, dtype=np.float64)
    agree = 0
    for lo in range(0, common.size, block):
        hi = min(lo + block, common.size)
        n = hi - lo
        lp, lq = ref.rows(request, ia[lo:hi], out=bufs[0][:n]), tgt.rows(request, ib[lo:hi], out=bufs[1][:n])
        kl[lo:hi], same = kl_from_logprobs(lp, lq, floor=ref.floor, work=(bufs[2][:n], bufs[3][:n]))
        agree += int(np.count_nonzero(same))
    return common, kl, agree


def stream_kl(
    ref: Distributions, tgt: Distributions, samples: Sequence[AlignedSample], *, block_elements: int = BLOCK_ELEMENTS
) -> KlResult:
    """KL(P_ref || P_target) and top-token agreement at every position of the matched requests
    that both sides have a distribution for (a :data:`comparator.logprobs.KlPass`)."""
    if ref.vocab_size != tgt.vocab_size:
        raise NotComparableError(
            f"the distributions have different vocabularies: baseline {ref.vocab_size} tokens, target {tgt.vocab_size}"
        )
    block = max(1, block_elements // ref.vocab_size)
    per: list[tuple[str, np.ndarray, np.ndarray]] = []
    agree = total = 0
    bufs = [np.empty((block, ref.vocab_size), dtype=np.float64) for _ in range(4)]  # 4 x block_elements x 8 B
    with ref.open(), tgt.open():
        for s in samples:
            pos, kl, a = _pair(ref, tgt, s.request, block, bufs)
            if pos.size:
                per.append((s.request, pos, kl))
                agree, total = agree + a, total + int(pos.size)
    return KlResult(tuple(per), agree, total)
