"""Forward passes of a HF causal LM as the jobs run them: the model call, its KV cache, padded batches, prefill.

The forward pass is a trust boundary (:func:`call_model`): an exception from the model's own code
is the model's problem (exit 2), not driftscope's. transformers takes the KV cache as ``cache=``
(5.x) or ``past_key_values=`` (4.x): :func:`cache_kwarg` reads the name from the signature.

Example::

    ids, mask = pad_batch([[1, 5, 9], [1, 7]], side="right")
    cache = prefill(model, ids, mask, chunk_size=2, keep_cache=True)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from dumper.errors import DriftscopeError, InternalError, ModelError, error_reason
from dumper.hooks.families import HFFamily
from dumper.hooks.tap import unwrap_compiled
from dumper.prefill.presets import model_label

__all__ = ["cache_kwarg", "call_model", "cache_length", "pad_batch", "prefill"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes a KV cache.

    transformers 5.x takes ``cache=``; 4.x takes ``past_key_values=`` and silently ignores an
    unknown ``cache=``, so the name must come from the signature, not from a guess.
    """
    params = inspect.signature(unwrap_compiled(model).forward).parameters
    names = HFFamily.cache_kwargs  # the names the hooks read the cache by, too
    for name in names:
        if name in params:
            return name
    raise ModelError(
        f"{model_label(model)}: {type(model).__name__}.forward takes no KV cache argument "
        f"({' or '.join(n + '=' for n in names)}); --chunk-size and selfcheck need one"
    )


def call_model(model: torch.nn.Module, **inputs: Any) -> Any:
    """``model(**inputs)``; an exception from the model's own code becomes a :class:`ModelError` naming the model.

    The forward pass is a trust boundary: input ids the model cannot embed or a config that
    builds but cannot run are the model's problem (exit 2), not driftscope's. driftscope's own
    hooks run inside the call too, but they raise only :class:`DriftscopeError` or
    :class:`InternalError` (see :mod:`dumper.hooks.capture`), which pass through, so a bug still exits 3.
    """
    try:
        return model(**inputs)
    except (DriftscopeError, InternalError):
        raise
    except Exception as e:  # noqa: BLE001 - the forward boundary
        raise ModelError(f"{model_label(model)}: the forward pass failed ({error_reason(e)})") from e


def cache_length(out: Any) -> tuple[Any, int | None]:
    """The KV cache a forward pass returned (``cache`` on transformers 5.x, ``past_key_values`` on 4.x) and its length.

    The length is ``None`` when there is no cache or it cannot say how many tokens it holds
    (a state-space model's cache raises on ``get_seq_length``).
    """
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    get = getattr(cache, "get_seq_length", None)
    try:
        return cache, (int(get()) if callable(get) else None)
    except Exception:  # noqa: BLE001 - the model's cache object: any failure means "cannot say"
        return cache, None


def pad_batch(seqs: list[list[int]], *, side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` input ids and attention mask (1 = real token), padded on ``side``."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(length - len(s), length)
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    chunk_size: int | None,
    on_logits: Callable[[torch.Tensor, int, torch.Tensor], None] | None = None,
    keep_cache: bool = False,
) -> Any:
    """Teacher-forced prefill of a padded batch: one forward pass, or one per chunk through the KV cache.

    Positions are ``cumsum(mask) - 1`` so that each real token has its absolute position in
    its own sequence whatever the padding; the mask is passed only when there is padding.
    ``on_logits(logits, first_column, positions)`` sees each pass's logits. Returns the KV
    cache when chunked or ``keep_cache`` (for decode steps after it), else None.
    """
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    padded = bool((mask == 0).any())
    if chunk_size is None:
        out = call_model(
            model,
            input_ids=ids,
            attention_mask=mask if padded else None,
            position_ids=positions,
            use_cache=keep_cache,
            **({cache_kwarg(model): None} if keep_cache else {}),
        )
        if on_logits is not None:
            on_logits(out.logits, 0, positions)
        return cache_length(out)[0] if keep_cache else None
    kw = cache_kwarg(model)
    cache = None
    length = ids.shape[1]
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        out = call_model(
            model,
            input_ids=ids[:, start:end],
            attention_mask=mask[:, :end] if padded else None,
            position_ids=positions[:, start:end],
            use_cache=True,
            **{kw: cache},
        )
        cache, grown = cache_length(out)
        if grown != end:  # the model's cache, not driftscope: a sliding window, a cache it ignores, none at all
            held = (
                "no KV cache"
                if cache is None
                else f"a {type(cache).__name__} holding {'an unknown number of' if grown is None else grown} tokens"
            )
            raise ModelError(
                f"{model_label(model)}: --chunk-size needs a KV cache that grows by each chunk; "
                f"after the chunk ending at token {end} the model returned {held} "
                f"(cache argument {kw!r})"
            )
        if on_logits is not None:
            on_logits(out.logits, start, positions)
    return cache
