"""Input-token logprobs from logits, computed the way inference engines do it.

Row ``j`` of a prefill's logits is the distribution after seeing ``x_0..x_j``: it scores
``x_{j+1}``, not ``x_j``. So a prefill of N tokens yields N-1 logprobs and the list returned
to users is shifted right by one: ``[None] + logprobs[:-1]``, aligned with the input ids
(SGLang's ``input_token_logprobs``). Logprobs use the raw logits (model-native softcapping
or scaling only, no temperature), in float32, one row chunk at a time as
``logit[target] - logsumexp(row)``: a [rows, V] log_softmax is never materialized, only a
[chunk_rows, V] one.

Example::

    # vocab A, B, C, D; input [A, C, B]; logsumexp of rows 0 and 1: 2.50 and 3.21
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.5, 3.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
    out = input_token_logprobs(logits, [0, 2, 1], top_k=2)
    out.logprobs          # (None, -2.00, -0.21)
    out.top[1]            # ((0, -0.50), (1, -1.50)): top-2 of row 0, whatever the real token
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dumper.errors import UsageError

__all__ = ["RowLogprobs", "row_logprobs", "InputLogprobs", "input_token_logprobs", "LOGPROB_CHUNK_ROWS"]

LOGPROB_CHUNK_ROWS = 2048
"""Rows of logits upcast to float32 at a time (SGLang's SGLANG_LOGPROB_CHUNK_SIZE default)."""


@dataclass(frozen=True)
class RowLogprobs:
    """Per-row results: ``logprobs[r]`` of ``targets[r]``, and the row's top-k (ids, logprobs)."""

    logprobs: torch.Tensor  # [rows] float32
    top_ids: torch.Tensor  # [rows, k] int64 (k may be 0)
    top_logprobs: torch.Tensor  # [rows, k] float32


def row_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, top_k: int = 0, chunk_rows: int = LOGPROB_CHUNK_ROWS
) -> RowLogprobs:
    """``log p(targets[r] | row r)`` and the top-k of each row of ``logits`` ([rows, V], any float dtype).

    Works ``chunk_rows`` rows at a time in float32, so extra memory is a few
    ``chunk_rows x V x 4`` bytes whatever the number of rows.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise UsageError(
            f"row_logprobs needs logits [rows, V] and targets [rows], got {list(logits.shape)} "
            f"and {list(targets.shape)}"
        )
    rows, vocab = logits.shape
    if top_k < 0 or top_k > vocab:
        raise UsageError(f"top_k must be in [0, {vocab}], got {top_k}")
    lp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    top_ids = torch.empty((rows, top_k), dtype=torch.int64, device=logits.device)
    top_lp = torch.empty((rows, top_k), dtype=torch.float32, device=logits.device)
    targets = targets.to(device=logits.device, dtype=torch.int64)
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        # logit - logsumexp(row) for the whole chunk at once: [c, V] float32, bounded by
        # chunk_rows (log_softmax's fused kernel measured faster than logsumexp + gather on CPU)
        chunk = torch.log_softmax(logits[start:stop].float(), dim=-1)
        lp[start:stop] = chunk.gather(1, targets[start:stop, None])[:, 0]
        if top_k:
            values, ids = chunk.topk(top_k, dim=-1)
            top_ids[start:stop] = ids
            top_lp[start:stop] = values
        del chunk
    return RowLogprobs(lp, top_ids, top_lp)


@dataclass(frozen=True)
class InputLogprobs:
    """Logprobs aligned with ``input_ids[start_len:]``; the first entry is ``None``."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...] | None, ...]


def input_token_logprobs(
    logits: torch.Tensor,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    top_k: int = 0,
    logprob_start_len: int = 0,
    chunk_rows: int = LOGPROB_CHUNK_ROWS,
) -> InputLogprobs:
    """SGLang-style ``input_token_logprobs`` of one sequence from its prefill logits [N, V].

    Rows ``start .. N-2`` are scored against ``input_ids[start+1 .. N-1]``; the result is
    shifted right by one so that entry ``i`` belongs to ``input_ids[start + i]``. The top-k at
    entry ``i`` is the top of the distribution that predicted that token.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
    n = ids.numel()
    if logits.dim() != 2 or logits.shape[0] != n:
        raise UsageError(f"logits {list(logits.shape)} do not match {n} input ids")
    if not 0 <= logprob_start_len < n:
        raise UsageError(f"logprob_start_len {logprob_start_len} must be in [0, {n})")
    rows = row_logprobs(
        logits[logprob_start_len : n - 1], ids[logprob_start_len + 1 :], top_k=top_k, chunk_rows=chunk_rows
    )
    lps = [None] + [float(v) for v in rows.logprobs.cpu().tolist()]
    tops: list[tuple[tuple[int, float], ...] | None] = [None]
    if top_k:
        for r_ids, r_lp in zip(rows.top_ids.cpu().tolist(), rows.top_logprobs.cpu().tolist(), strict=True):
            tops.append(tuple(zip(r_ids, r_lp, strict=True)))
    else:
        tops.extend(None for _ in range(n - 1 - logprob_start_len))
    return InputLogprobs(tuple(ids[logprob_start_len:].tolist()), tuple(lps), tuple(tops))
