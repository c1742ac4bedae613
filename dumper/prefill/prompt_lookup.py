"""``--speculative ngram:k=K`` with ``--engine transformers``: transformers' own prompt-lookup decoding, recorded.

Each prompt runs alone (transformers' assisted decoding takes one sequence) through
``model.generate(..., prompt_lookup_num_tokens=K, max_matching_ngram_size=MAX)``: its
``PromptLookupCandidateGenerator`` copies up to K tokens that followed the latest n-gram's earlier
occurrence, and one forward pass of its assisted-decoding loop verifies them (greedy: the drafts
up to the first the model disagrees with are kept, plus the model's own next token), its KV cache
cropped back to the kept tokens. The capture's module hooks record every pass as it runs; the steps
(:mod:`dumper.format.speculative`) are derived afterwards from the rows recorded
(:func:`dumper.prefill.run.dump_sequences`).

Where the call differs from a bare ``generate``, and why:

- Greedy over the raw logits, as ``--new-tokens`` decodes: the model's own ``generation_config``
  (EOS, penalties, sampling defaults) is set aside for the call and ``eos_token_id=None``, so EOS
  neither stops the decode nor is masked out of the choice (``min_new_tokens`` would mask it).
- The prompt pass proposes no drafts. transformers appends its first drafts to the prompt pass,
  whose draft index 0 is then the prompt's last token; ``extra.speculative`` starts every
  sequence's steps at the prompt's length (a prompt pass holds no decode rows). From the second
  pass on every proposal is transformers' own: prompt lookup keeps no state between passes.
- No row at a position past ``len(prompt) + N - 2`` is recorded: transformers' drafts may run
  past the N tokens asked for (it bounds where the copied tokens come from, not where they land)
  and it crops the accepted ones to the budget after the pass; those rows are neither recorded
  nor counted (:meth:`dumper.hooks.families.HFFamily.set_position_end`).
- With ``--logprobs`` the prompt pass computes the logits of every row (``logits_to_keep=0``
  instead of 1), for the prompt tokens' own logprobs, as the prompt pass of ``--new-tokens`` does.
  Each generated token's logprob is read from ``output_logits``, the raw logits of the pass that
  chose it, at the token's own position.

No record carries a phase or a decode step (a verify pass holds several decode rows, and the
prompt pass none): a row is a decode row by its position, as for vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dumper.errors import DumpError, UsageError
from dumper.hooks.capture import Capture
from dumper.prefill.logprob_records import LogprobSpec, record_logprobs, record_next_logprobs
from dumper.prefill.speculative import SpeculativeSpec

if TYPE_CHECKING:
    from dumper.prefill.observer import LogprobSink

__all__ = ["prompt_lookup_decode", "hf_speculative_config"]

HF_METHOD = "prompt_lookup"
"""``extra.speculative.method`` of a transformers dump."""


def hf_speculative_config(spec: SpeculativeSpec) -> dict[str, Any]:
    """``extra.speculative.config`` of a transformers run: the method, the drafts per step and ``generate``'s own
    arguments."""
    return {"method": HF_METHOD, "num_speculative_tokens": spec.k, **spec.hf_kwargs()}


@contextlib.contextmanager
def _no_prompt_drafts(model: torch.nn.Module, prompt_length: int) -> Iterator[None]:
    """While open, ``model.generate``'s prompt-lookup generator proposes nothing for the prompt pass (the module doc);
    the generator itself is transformers' own, and so is every later proposal."""
    make = getattr(model, "_get_candidate_generator", None)
    if make is None:
        raise UsageError(
            f"--speculative: this transformers' {type(model).__name__}.generate has no _get_candidate_generator "
            "(the assisted-decoding entry driftscope drives); use transformers 4.46 to 5.x"
        )

    def candidate_generator(*args: Any, **kwargs: Any) -> Any:
        gen = make(*args, **kwargs)
        if type(gen).__name__ != "PromptLookupCandidateGenerator":
            raise UsageError(f"--speculative: transformers chose {type(gen).__name__}, not prompt lookup")
        propose = gen.get_candidates

        def get_candidates(input_ids: torch.Tensor, **kw: Any) -> Any:
            if input_ids.shape[1] <= prompt_length:
                return input_ids, None
            return propose(input_ids, **kw)

        gen.get_candidates = get_candidates
        return gen

    model._get_candidate_generator = candidate_generator  # an instance attribute over the class's method
    try:
        yield
    finally:
        del model._get_candidate_generator


@contextlib.contextmanager
def _bare_generation_config(model: torch.nn.Module) -> Iterator[None]:
    """While open, ``model.generation_config`` is transformers' default one: no EOS, penalty or sampling default of
    the model's own reaches the greedy choice."""
    from transformers import GenerationConfig

    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def prompt_lookup_decode(
    model: torch.nn.Module,
    sink: LogprobSink,
    prompt: list[int],
    seq_id: int,
    new_tokens: int,
    spec: SpeculativeSpec,
    logprobs: LogprobSpec | None,
    pad_id: int = 0,
) -> list[int]:
    """Decode ``new_tokens`` tokens after ``prompt`` (sequence ``seq_id``) with transformers' prompt lookup, every pass
    recorded by ``sink`` when it is a capture (the module doc); returns the tokens generated."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)
    length = len(prompt)
    sink.set_sequence_ids([seq_id])
    family = sink.family if isinstance(sink, Capture) else None
    calls, logits_dtype = 0, None

    def all_prompt_logits(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        nonlocal calls
        calls += 1
        return (args, {**kwargs, "logits_to_keep": 0}) if calls == 1 and "logits_to_keep" in kwargs else None

    def prompt_logprobs(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        nonlocal logits_dtype
        if calls == 1 and logprobs is not None:
            logits_dtype = output.logits.dtype
            positions = torch.arange(length, device=device)[None, :]
            record_logprobs(sink, output.logits, ids, mask, positions, 0, [seq_id], logprobs)

    handles = []
    if logprobs is not None:
        handles.append(model.register_forward_pre_hook(all_prompt_logits, with_kwargs=True))
        handles.append(model.register_forward_hook(prompt_logprobs, with_kwargs=True))
    if family is not None:
        family.set_position_end(length + new_tokens - 1)  # the last generated token is chosen, never fed
    try:
        with _no_prompt_drafts(model, length), _bare_generation_config(model):
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=pad_id,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=logprobs is not None,
                **spec.hf_kwargs(),
            )
    finally:
        for h in handles:
            h.remove()
        if family is not None:
            family.set_position_end(None)
    tokens = out.sequences[0, length:]
    if tokens.numel() != new_tokens:
        raise DumpError(
            f"--speculative: transformers generated {tokens.numel()} tokens for sequence {seq_id}, "
            f"not the {new_tokens} asked for"
        )
    if logprobs is not None:
        logits = torch.cat(list(out.logits), dim=0)  # [N, V]: float32 casts of the logits of the pass that chose each
        if logits_dtype is not None:
            logits = logits.to(logits_dtype)  # exact: the model's own logits, as --new-tokens records them
        positions = torch.arange(length, length + new_tokens, device=logits.device)
        record_next_logprobs(sink, logits, tokens.to(logits.device), positions, [seq_id] * new_tokens, logprobs)
    return tokens.tolist()
