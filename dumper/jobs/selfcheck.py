"""Decode <-> prefill self-consistency of one model, with no external baseline.

The decode path (greedy, temperature 0, KV cache, one token a step) and a fresh prefill of
prompt + output with no cache reuse compute the logprob of the same output tokens; they must
agree up to numerical noise. k3 = (e^d - 1) - d with d = log q_decode - log p_prefill
(:func:`comparator.logprobs.metrics.k3`, stable for tiny d) is averaged over the output positions
(SGLang's kl_test_utils). The tokens are greedy, not samples of the
distribution, so that mean is a consistency measure and a biased estimate of KL (k3's mean is
KL only over sampled tokens); results say so (``k3_tokens``, :data:`GREEDY_K3_NOTE`). Cache-hit
variants first write a prefix into the KV cache and generate on top of it, so they check that
reused KV equals recomputed KV; they assert the cache was really hit, so an empty run cannot pass.

Example::

    from dumper.prefill.presets import load_model
    from dumper.jobs.selfcheck import selfcheck
    model, tok = load_model("tiny-llama")
    result = selfcheck(model, tok.encode("The quick brown fox"), new_tokens=16, mode="prefill-hit")
    assert result.passed, result
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from comparator import k3_summary
from dumper.errors import InternalError, ModelError, UsageError
from dumper.jobs.k3_json import k3_from_json, k3_to_json
from dumper.prefill.forward import cache_kwarg, cache_length, call_model
from dumper.prefill.logprobs import input_token_logprobs
from dumper.prefill.presets import model_label

__all__ = [
    "MODES",
    "SelfCheckResult",
    "check_inputs",
    "greedy_decode",
    "selfcheck",
    "vocab_size_of",
    "DEFAULT_K3_THRESHOLD",
]

MODES = ("no-cache", "prefill-hit", "decode-hit")
DEFAULT_K3_THRESHOLD = 1e-3
"""Mean k3 allowed between the two paths (SGLang's radix-cache tests use 0.0025-0.03 in bf16)."""


@dataclass(frozen=True)
class SelfCheckResult:
    """One mode's verdict: decode-path vs prefill-path logprobs of the same output tokens."""

    mode: str
    prompt_tokens: int
    output_ids: tuple[int, ...]
    decode_logprobs: tuple[float, ...]
    prefill_logprobs: tuple[float, ...]
    cache_hit_tokens: int
    k3_mean: float
    k3_max: float
    k3_max_position: int
    max_abs_err: float
    threshold: float
    passed: bool
    k3_tokens: str = "greedy"
    """How the scored tokens were chosen: greedy (argmax), so mean k3 is not an unbiased KL estimate."""

    def to_json(self) -> dict[str, Any]:
        return k3_to_json(asdict(self))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SelfCheckResult:
        """Inverse of :meth:`to_json`; a null k3 or error reads back infinite (a NaN one too: it never passes)."""
        return cls(
            mode=str(d["mode"]),
            prompt_tokens=int(d["prompt_tokens"]),
            output_ids=tuple(int(t) for t in d["output_ids"]),
            decode_logprobs=tuple(float(v) for v in d["decode_logprobs"]),
            prefill_logprobs=tuple(float(v) for v in d["prefill_logprobs"]),
            cache_hit_tokens=int(d["cache_hit_tokens"]),
            **k3_from_json(d),
        )


def _step(model: torch.nn.Module, ids: torch.Tensor, cache: Any, kw: str, past: int) -> tuple[torch.Tensor, Any]:
    """One forward of ``ids`` [1, s] on top of ``past`` cached tokens; returns the last logits row and the cache."""
    positions = torch.arange(past, past + ids.shape[1], device=ids.device)[None]
    out = call_model(model, input_ids=ids, position_ids=positions, use_cache=True, **{kw: cache})
    cache, length = cache_length(out)
    if length != past + ids.shape[1]:  # the model's cache does not keep every token: nothing to check against
        raise ModelError(
            f"{model_label(model)}: selfcheck needs a KV cache that keeps every token; after "
            f"{past + ids.shape[1]} tokens the model's cache holds "
            f"{'none' if cache is None else 'an unknown number' if length is None else length}"
        )
    return out.logits[0, -1], cache


def greedy_decode(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, *, cache: Any = None, cached: int = 0
) -> tuple[list[int], list[float], Any]:
    """Greedy decode (ignoring EOS) after ``ids`` [1, n], of which the first ``cached`` sit in ``cache``.

    Returns the output ids, the logprob of each under its raw logits row (temperature 0),
    and the cache.
    """
    kw = cache_kwarg(model)
    row, cache = _step(model, ids[:, cached:], cache, kw, cached)
    out_ids: list[int] = []
    logprobs: list[float] = []
    length = ids.shape[1]
    for i in range(new_tokens):
        lp = torch.log_softmax(row.float(), dim=-1)
        token = int(torch.argmax(lp))
        out_ids.append(token)
        logprobs.append(float(lp[token]))
        if i + 1 < new_tokens:
            row, cache = _step(model, torch.tensor([[token]], device=ids.device), cache, kw, length)
            length += 1
    return out_ids, logprobs, cache


def _generate(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, mode: str
) -> tuple[list[int], list[float], int]:
    """Output ids and decode-path logprobs for ``mode``, and how many tokens came from the cache."""
    kw = cache_kwarg(model)
    n = ids.shape[1]
    if mode == "no-cache":
        out, lps, _ = greedy_decode(model, ids, new_tokens)
        return out, lps, 0
    if mode == "prefill-hit":
        hit = max(1, (3 * n) // 4)  # < n for every prompt check_inputs admits (n >= 2)
        _, cache = _step(model, ids[:, :hit], None, kw, 0)  # write the prefix into the cache first
        out, lps, _ = greedy_decode(model, ids, new_tokens, cache=cache, cached=hit)
        return out, lps, hit
    if mode == "decode-hit":
        first = new_tokens // 2  # >= 1: check_inputs admits new_tokens >= 2
        out1, lps1, cache = greedy_decode(model, ids, first)  # writes prompt + outputs into the cache
        hit = n + first - 1  # all but the last token, which is fed again (as a radix cache does)
        extra = int(cache.get_seq_length()) - hit
        if extra > 0:  # keep prompt + first outputs: the continuation must hit them
            if not callable(getattr(cache, "crop", None)):
                raise ModelError(
                    f"{model_label(model)}: decode-hit needs a KV cache that can be cropped; "
                    f"{type(cache).__name__} cannot"
                )
            cache.crop(-extra)
        cont = torch.cat([ids, torch.tensor([out1[:first]], device=ids.device)], dim=1)
        out2, lps2, _ = greedy_decode(model, cont, new_tokens - first, cache=cache, cached=hit)
        return out1[:first] + out2, lps1[:first] + lps2, hit
    raise InternalError(f"unknown selfcheck mode {mode!r} passed check_inputs")


def check_inputs(prompt_ids: Sequence[int], *, vocab_size: int | None, new_tokens: int, mode: str) -> None:
    """Raise :class:`UsageError` when ``selfcheck`` cannot run ``mode`` on this prompt (say why and what works).

    Every prompt needs a token and ids inside the vocabulary; ``prefill-hit`` caches 3/4 of
    the prompt and decodes the rest, so it needs 2 tokens; ``decode-hit`` continues from half
    of the output, so it needs ``new_tokens >= 2``.
    """
    if mode not in MODES:
        raise UsageError(f"unknown selfcheck mode {mode!r}; choose from {', '.join(MODES)}")
    if new_tokens < 1:
        raise UsageError(f"--new-tokens must be >= 1, got {new_tokens}")
    if not prompt_ids:
        raise UsageError("the prompt is empty")
    bad = [t for t in prompt_ids if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if mode == "prefill-hit" and len(prompt_ids) < 2:
        raise UsageError(
            f"prefill-hit needs a prompt of at least 2 tokens, got {len(prompt_ids)} "
            "(--mode no-cache and decode-hit run on one token)"
        )
    if mode == "decode-hit" and new_tokens < 2:
        raise UsageError(f"decode-hit needs --new-tokens >= 2, got {new_tokens}")


def vocab_size_of(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding (``None`` when it has no ``get_input_embeddings``)."""
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    return int(emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else None


def selfcheck(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    new_tokens: int = 16,
    mode: str = "no-cache",
    threshold: float = DEFAULT_K3_THRESHOLD,
) -> SelfCheckResult:
    """Compare decode-path and prefill-path logprobs of ``new_tokens`` greedy tokens (see module doc).

    Inputs are checked by :func:`check_inputs`; a model whose forward fails or whose cache does
    not keep every token raises :class:`UsageError` naming it.
    """
    check_inputs(prompt_ids, vocab_size=vocab_size_of(model), new_tokens=new_tokens, mode=mode)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    with torch.inference_mode():
        out_ids, decode_lps, hit = _generate(model, ids, new_tokens, mode)
        if mode != "no-cache" and 2 * hit < ids.shape[1]:  # check_inputs makes this impossible: a bug
            raise InternalError(f"{mode}: only {hit} of {ids.shape[1]} prompt tokens came from the cache")
        full = torch.cat([ids, torch.tensor([out_ids], device=device)], dim=1)
        logits = call_model(model, input_ids=full, use_cache=False).logits[0]  # fresh prefill, nothing reused
        prefill_lps = input_token_logprobs(logits, full[0]).logprobs[-new_tokens:]
    k3 = k3_summary(prefill_lps, decode_lps)
    return SelfCheckResult(
        mode=mode,
        prompt_tokens=ids.shape[1],
        output_ids=tuple(out_ids),
        decode_logprobs=tuple(decode_lps),
        prefill_logprobs=tuple(float(v) for v in prefill_lps),
        cache_hit_tokens=hit,
        k3_mean=k3.mean,
        k3_max=k3.max,
        k3_max_position=ids.shape[1] + k3.argmax,
        max_abs_err=k3.max_abs_err,
        threshold=threshold,
        passed=bool(k3.mean <= threshold),
    )
