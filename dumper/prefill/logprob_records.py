"""Recording a job's logprobs into its sink (a capture, or the observer check's reference run).

What is scored where: row (b, c) of a pass's logits scores the token in column c+1
(:func:`record_logprobs`), and a logits row chosen by hand scores a given next token
(:func:`record_next_logprobs`: a decode step's choice, a ``--tokens-from`` prefill's last token).
:func:`record_token_logprobs` is the one writer of the ``LOGPROB_*`` records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dumper.format import (
    LOGITS,
    LOGITS_POINT,
    LOGPROB_POINT,
    LOGPROB_TOKEN_ID,
    LOGPROB_TOP_ID,
    LOGPROB_TOP_VALUE,
    LOGPROB_VALUE,
)
from dumper.prefill.logprobs import LOGPROB_CHUNK_ROWS, row_logprobs

if TYPE_CHECKING:
    from dumper.prefill.observer import LogprobSink

__all__ = ["LogprobSpec", "record_logprobs", "record_token_logprobs", "record_next_logprobs"]


@dataclass(frozen=True)
class LogprobSpec:
    """What a run records besides hidden states: input-token logprobs, top-k, full logits rows."""

    top_k: int = 0
    start_len: int = 0
    save_logits: bool = False
    chunk_rows: int = LOGPROB_CHUNK_ROWS


def record_logprobs(
    cap: LogprobSink,
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    start: int,
    seq_ids: Sequence[int],
    spec: LogprobSpec,
) -> None:
    """Record the logprobs of a pass whose logits [B, s, V] cover columns ``start .. start+s-1``.

    Row (b, c) scores the token in column c+1 when that column is a real token past
    ``spec.start_len``: across chunk boundaries too, since ``ids`` holds the whole batch.
    """
    batch, s, _ = logits.shape
    length = ids.shape[1]
    cols = torch.arange(start, start + s, device=ids.device)
    nxt = (cols + 1).clamp(max=length - 1)
    valid = (
        (cols + 1 < length)[None, :]
        & (mask[:, cols] == 1)
        & (mask[:, nxt] == 1)
        & (positions[:, cols] + 1 > spec.start_len)
    )
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    rows = logits[b_idx, t_idx]  # [n, V]
    targets = ids[b_idx, start + t_idx + 1]
    meta = {
        "positions": positions[b_idx, start + t_idx] + 1,
        "sequence_ids": torch.as_tensor(list(seq_ids), device=ids.device)[b_idx],
    }
    r = row_logprobs(rows, targets, top_k=spec.top_k, chunk_rows=spec.chunk_rows)
    record_token_logprobs(
        cap,
        meta["positions"],
        meta["sequence_ids"],
        targets,
        r.logprobs,
        r.top_ids if spec.top_k else None,
        r.top_logprobs if spec.top_k else None,
    )
    if spec.save_logits:
        cap.record(LOGITS, rows, point=LOGITS_POINT, **meta)


def record_token_logprobs(
    cap: LogprobSink,
    positions: Any,
    sequence_ids: Any,
    token_ids: Any,
    logprobs: Any,
    top_ids: Any = None,
    top_logprobs: Any = None,
) -> None:
    """Record ``logprobs[r]`` of ``token_ids[r]`` at ``positions[r]`` of sequence ``sequence_ids[r]`` into ``cap``.

    ``top_ids`` / ``top_logprobs`` [rows, k] are the top-k of the distribution that predicted
    that position's token. The one writer of the ``LOGPROB_*`` records, for the HF job and for
    engines that compute logprobs themselves (vLLM's ``prompt_logprobs``).
    """
    meta = {
        "positions": torch.as_tensor(positions, dtype=torch.int64).reshape(-1),
        "sequence_ids": torch.as_tensor(sequence_ids, dtype=torch.int64).reshape(-1),
    }
    cap.record(
        LOGPROB_TOKEN_ID, torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1, 1), point=LOGPROB_POINT, **meta
    )
    cap.record(
        LOGPROB_VALUE, torch.as_tensor(logprobs, dtype=torch.float32).reshape(-1, 1), point=LOGPROB_POINT, **meta
    )
    if top_ids is not None and top_logprobs is not None:
        cap.record(LOGPROB_TOP_ID, torch.as_tensor(top_ids, dtype=torch.int64), point=LOGPROB_POINT, **meta)
        cap.record(LOGPROB_TOP_VALUE, torch.as_tensor(top_logprobs, dtype=torch.float32), point=LOGPROB_POINT, **meta)


def record_next_logprobs(
    sink: LogprobSink,
    logits: torch.Tensor,
    targets: torch.Tensor,
    positions: torch.Tensor,
    seq_ids: Sequence[int],
    spec: LogprobSpec,
) -> None:
    """Record the logprob of ``targets[b]`` at ``positions[b]`` from ``logits[b]`` (the row of the position before):
    the token a decode step chose, or the token a ``--tokens-from`` prefill scores after its input."""
    keep = (positions > spec.start_len).nonzero(as_tuple=True)[0]
    if keep.numel() == 0:
        return
    rows, targets, positions = logits[keep], targets[keep], positions[keep]
    seqs = torch.as_tensor(list(seq_ids), device=keep.device)[keep]
    r = row_logprobs(rows, targets, top_k=spec.top_k, chunk_rows=spec.chunk_rows)
    record_token_logprobs(
        sink,
        positions,
        seqs,
        targets,
        r.logprobs,
        r.top_ids if spec.top_k else None,
        r.top_logprobs if spec.top_k else None,
    )
    if spec.save_logits:
        sink.record(LOGITS, rows, point=LOGITS_POINT, positions=positions, sequence_ids=seqs)
