"""Speculative decode dumps of the tiny HF Llama, made by driving the capture through real verify passes.

No engine: the prompt pass, then verify passes that feed each sequence's last token and the drafts
an n-gram prompt lookup proposes (draft indices ``0..k``) through the model's KV cache in one
forward pass, greedy acceptance (keep the drafts up to the first one the model's own argmax
disagrees with, then its token), :meth:`DynamicCache.crop` back to the kept rows. The capture
records every row of every verify pass (rejected rows too); ``extra.speculative`` comes from the
recorded rows by :func:`dumper.format.speculative.derive_steps`, checked against the steps the
loop took. The logprob of every generated token is recorded from the verify row that chose it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

from dumper.format.decode import GENERATED_IDS, NEW_TOKENS
from dumper.format.speculative import SPECULATIVE_KEY, Step, derive_steps, hidden_rows, speculative_extra
from dumper.hooks.capture import Capture
from dumper.prefill.forward import cache_kwarg
from dumper.prefill.logprob_records import LogprobSpec, record_logprobs, record_next_logprobs

__all__ = ["PROMPTS", "LOGPROBS", "ngram", "spec_decode", "draft_bug"]

PROMPTS = ([1] + [(7 * i) % 250 + 3 for i in range(39)], [1, 17, 33, 90, 5, 61, 7, 140, 9, 12, 44])
"""A 40-token and an 11-token prompt; the tiny Llama's greedy continuations of both fall into loops, which
n-gram prompt lookup drafts well."""

LOGPROBS = LogprobSpec(top_k=3)
"""Logprobs of every prompt and generated token, with their top 3 (a decode fork's gap is read from them)."""

Proposer = Callable[[list[int], int], list[int]]
"""``propose(context, k)``: up to ``k`` draft tokens after ``context``."""


def ngram(*, n_max: int = 3, n_min: int = 1, shift: int = 0) -> Proposer:
    """n-gram prompt lookup: the tokens after the latest earlier occurrence of the context's last ``n`` tokens
    (``n`` from ``n_max`` down to ``n_min``). ``shift`` 1 is an off-by-one proposer bug: it skips the token
    right after the match (worse drafts; the target model still decides what is kept)."""

    def propose(context: list[int], k: int) -> list[int]:
        for n in range(n_max, n_min - 1, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for i in range(len(context) - n - 1, -1, -1):
                if context[i : i + n] == tail:
                    out = context[i + n + shift : i + n + shift + k]
                    if out:
                        return out
        return []

    return propose


def draft_bug(layer: torch.nn.Module, first_index: int = 2, scale: float = 0.5):
    """A forward hook on a decoder layer that adds ``scale`` x mean|h| to its output at draft index >= ``first_index``
    of every verify pass (a pass of several tokens that does not start at position 0): a verify kernel wrong
    for the later drafts only. Returns the hook's handle."""

    def hook(module, args, kwargs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        pos = kwargs["position_ids"]
        if hidden.shape[1] > first_index and int(pos[0, 0]) > 0:
            hidden[:, first_index:].add_(scale * hidden.abs().mean())
        return output

    return layer.register_forward_hook(hook, with_kwargs=True)


def spec_decode(
    model: torch.nn.Module,
    out: str | Path,
    *,
    k: int = 3,
    new_tokens: int = 16,
    propose: Proposer | None = None,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    logprobs: LogprobSpec | None = LOGPROBS,
    setting: str | None = None,
) -> list[list[Step]]:
    """Decode ``new_tokens`` greedy tokens per prompt speculatively into the dump ``out``; returns the steps taken.

    One sequence at a time (batch 1, as transformers' prompt lookup runs). Each verify pass feeds the last
    chosen token and up to ``k`` drafts (no draft past the ``new_tokens`` asked for); as in vLLM's and
    transformers' dumps its records carry no decode label (a row is a decode row by its position).
    """
    propose = propose or ngram()
    kw = cache_kwarg(model)
    extra = {
        "job": "decode",
        "input_ids": [list(p) for p in prompts],
        "dtype": "float32",
        "attn": "eager",
        "logprobs": None if logprobs is None else vars(logprobs),
    }
    taken: list[list[Step]] = []
    generated: list[list[int]] = []
    with torch.inference_mode(), Capture(model, out, layers="all", model_name="tiny-llama", extra=extra) as cap:
        for s, prompt in enumerate(prompts):
            cap.set_sequence_ids([s])
            n = len(prompt)
            ids = torch.tensor([list(prompt)])
            cache = DynamicCache(config=model.config)
            o = model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=True, **{kw: cache})
            if logprobs is not None:
                record_logprobs(cap, o.logits, ids, torch.ones_like(ids), torch.arange(n)[None], 0, [s], logprobs)
            first = int(o.logits[0, -1].argmax())
            if logprobs is not None:
                record_next_logprobs(cap, o.logits[:, -1], torch.tensor([first]), torch.tensor([n]), [s], logprobs)
            gen, steps = [first], []
            while len(gen) < new_tokens:
                p = n + len(gen) - 1  # the last chosen token's position: draft index 0
                room = min(k, new_tokens - len(gen) - 1)
                drafts = propose(list(prompt) + gen, room)[:room] if room > 0 else []
                fed = [gen[-1], *drafts]
                o = model(
                    input_ids=torch.tensor([fed]),
                    position_ids=torch.arange(p, p + len(fed))[None],
                    use_cache=True,
                    **{kw: cache},
                )
                choices = o.logits[0].argmax(-1).tolist()
                a = 0
                while a < len(drafts) and drafts[a] == choices[a]:
                    a += 1
                kept = choices[: a + 1]
                if logprobs is not None:
                    record_next_logprobs(
                        cap,
                        o.logits[0, : a + 1],
                        torch.tensor(kept),
                        torch.arange(p + 1, p + a + 2),
                        [s] * (a + 1),
                        logprobs,
                    )
                steps.append((p, len(drafts), a))
                gen += kept
                if len(drafts) > a:
                    cache.crop(a - len(drafts))  # drop the rejected drafts' keys and values
            generated.append(gen)
            taken.append(steps)
        steps = derive_steps(hidden_rows(cap.records), [len(p) for p in prompts])  # as a run derives them
        assert [[(st.position, st.proposed, st.accepted) for st in seq] for seq in steps] == taken, (steps, taken)
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        cap.extra.update(
            {
                NEW_TOKENS: new_tokens,
                GENERATED_IDS: generated,
                SPECULATIVE_KEY: speculative_extra(setting or f"ngram:k={k}", config, steps),
            }
        )
    return steps
