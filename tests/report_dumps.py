"""Dumps for the report tests: a clean run of the tiny preset and the same run with a one-token bug.

The bug adds noise to the hidden state of one token after one decoder layer (both prompts), so
the first divergent layer is ``layer + 1`` and its first failing token is ``token``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, dump_sequences, run_dump
from dumper.prompts import BUILTIN_PROMPTS
from tests.conftest import tiny_llama

SPEC = LogprobSpec(top_k=5, save_logits=True)
N_LAYERS = 8


def clean_dump(out: Path) -> Path:
    """The built-in prompts through tiny-llama, every layer, with logprobs and logits."""
    run_dump(RunConfig(out=str(out), layers="all", logprobs=SPEC))
    return out


def one_token_bug_dump(out: Path, *, layer: int, token: int) -> Path:
    """:func:`clean_dump` with noise added to ``token``'s hidden state after decoder layer ``layer``."""
    model, tok = tiny_llama()
    gen = torch.Generator().manual_seed(1)

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # [1, seq, hidden]
        row = hidden[0, token]
        row.add_(0.2 * row.norm() / math.sqrt(row.numel()) * torch.randn(row.shape, generator=gen))
        return output

    handle = model.model.layers[layer].register_forward_hook(hook)
    try:
        dump_sequences(
            model, [tok.encode(p) for p in BUILTIN_PROMPTS], RunConfig(out=str(out), layers="all", logprobs=SPEC)
        )
    finally:
        handle.remove()
    return out
