"""The decode path of ``python -m dumper run``: greedy steps after the prompt pass, and their counterpart.

``--new-tokens N`` runs, after each batch's prompt pass, N-1 greedy decode steps of one token per
sequence through the model's KV cache (temperature 0, no stop at EOS; the N-th token is chosen
but never fed). Step ``s`` feeds the ``s``-th generated token at position ``len(prompt) + s``;
the capture labels its rows ``{"phase": "decode", "decode_step": s}`` and the manifest lists
each sequence's generated tokens (:mod:`dumper.format.decode`). With ``--logprobs`` the logprob
(and top-k, and logits row) of every generated token is recorded from the pass that chose it.

``--tokens-from DUMP`` (:func:`dumper.prefill.run.tokens_from`) is the counterpart: a prefill of each prompt plus the
tokens the decode fed back, so that the two dumps hold the same positions and a comparison
matches them row by row.

Example::

    cfg = RunConfig(out="dumps/decode", new_tokens=32, logprobs=LogprobSpec(top_k=5))
    run_dump(cfg)
    run_dump(tokens_from(RunConfig(out="dumps/prefill", logprobs=LogprobSpec(top_k=5)), "dumps/decode"))  # run.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dumper.format.decode import DECODE, DECODE_STEP_KEY, PHASE_KEY
from dumper.prefill.forward import cache_kwarg, cache_length, call_model
from dumper.prefill.logprob_records import LogprobSpec, record_next_logprobs

if TYPE_CHECKING:
    from dumper.prefill.observer import LogprobSink

__all__ = ["LastLogits", "greedy_loop", "greedy_steps", "decode_meta"]


def decode_meta(step: int) -> dict[str, Any]:
    """The meta of the records decode step ``step`` writes."""
    return {PHASE_KEY: DECODE, DECODE_STEP_KEY: step}


class LastLogits:
    """Collects, from a prefill's passes, the logits row of each batch row's last real token (the row
    that chooses the first generated token): an ``on_logits(logits, first_column, positions)`` callback."""

    def __init__(self, mask: torch.Tensor) -> None:
        cols = torch.arange(mask.shape[1], device=mask.device)
        self.columns = torch.where(mask == 1, cols, -1).amax(dim=1)  # [B]
        self.logits: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, start: int, positions: torch.Tensor) -> None:
        rel = self.columns - start
        here = (rel >= 0) & (rel < logits.shape[1])
        if not bool(here.any()):
            return
        if self.logits is None:
            self.logits = torch.zeros(logits.shape[0], logits.shape[-1], dtype=logits.dtype, device=logits.device)
            self.positions = positions.gather(1, self.columns.clamp(min=0)[:, None])[:, 0]
        rows = here.nonzero(as_tuple=True)[0]
        self.logits[rows] = logits[rows, rel[rows]]


Scored = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``score(logits, tokens, positions)``: the rows of ``logits`` chose ``tokens``, which sit at ``positions``."""
Feed = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``feed(step, tokens, positions)``: run decode step ``step`` on one token per row; its logits [rows, V]."""


def greedy_loop(
    logits: torch.Tensor, last_positions: torch.Tensor, new_tokens: int, score: Scored, feed: Feed
) -> list[list[int]]:
    """The decode rule, whatever runs the model: ``new_tokens`` times each row's argmax of ``logits``
    (temperature 0; the first of equal maxima) is chosen and scored at the position after the row's
    last one; all but the last choice are fed back as decode steps 0, 1, ... Returns each row's tokens."""
    positions, chosen = last_positions, []
    for step in range(new_tokens):
        token = logits.argmax(dim=-1)
        positions = positions + 1
        chosen.append(token)
        score(logits, token, positions)
        if step + 1 < new_tokens:
            logits = feed(step, token, positions)
    return torch.stack(chosen, dim=1).tolist() if chosen else [[] for _ in range(logits.shape[0])]


def greedy_steps(
    run_model: torch.nn.Module,
    sink: LogprobSink,
    cache: Any,
    last: LastLogits,
    mask: torch.Tensor,
    seq_ids: Sequence[int],
    new_tokens: int,
    spec: LogprobSpec | None,
) -> list[list[int]]:
    """Greedy-decode ``new_tokens`` tokens per batch row after a prefill that left ``cache`` and ``last``
    (:func:`greedy_loop`); each step is one forward pass of one token per row through the KV cache,
    its rows labelled with :func:`decode_meta`. Returns each row's generated tokens."""
    assert last.logits is not None and last.positions is not None
    kw = cache_kwarg(run_model)
    padded = bool((mask == 0).any())

    def score(logits: torch.Tensor, token: torch.Tensor, positions: torch.Tensor) -> None:
        if spec is not None:
            record_next_logprobs(sink, logits, token, positions, seq_ids, spec)

    def feed(step: int, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        nonlocal mask, cache
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        sink.set_pass_meta(decode_meta(step))
        try:
            out = call_model(
                run_model,
                input_ids=token[:, None],
                attention_mask=mask if padded else None,
                position_ids=positions[:, None],
                use_cache=True,
                **{kw: cache},
            )
        finally:
            sink.set_pass_meta(None)
        cache, _ = cache_length(out)
        return out.logits[:, -1]

    return greedy_loop(last.logits, last.positions, new_tokens, score, feed)
