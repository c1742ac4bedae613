"""Seeded speculative-decoding bugs in vLLM's CPU attention backend (loaded by ``sitecustomize`` for ``spec_draft``
and ``spec_rollback``): a verify pass wrong at its later drafts, and a rejected draft's cache row left in place.

``{"spec_draft": L, "add": A}``: the attention of layer ``L`` adds ``A`` to its output rows of draft
index 2 and later of every verify pass: rows of a request whose query holds several tokens and
continues from earlier steps (``query_len > 1`` and ``seq_len - query_len > 0``), at offset 2 or
more in its query. A prompt pass (no earlier tokens) and a plain decode step (one token) are
untouched, so only speculative decoding diverges (keep chunked prefill and prefix-cache hits, which
also continue a request with several tokens, out of a run that uses it).

``{"spec_rollback": L}``: layer ``L`` does not write a row into its KV cache slot when the step
before wrote that same slot: the slot of a rejected draft, which the next verify pass computes
again for the token the target chose. The cache keeps the rejected draft's key and value there,
and every later query of the request reads them. A run without speculative decoding never writes
a slot twice in consecutive steps, so it is untouched.

Both are plain tensor code over vLLM's own attention metadata and slot mapping (which layer is
buggy is a constant of the layer), in the attention custom ops vLLM-CPU runs outside its compiled
graph: a compiled engine calls them as they are at every step.
"""

from __future__ import annotations

from typing import Any

import torch
from chunk_bug import step_rows  # beside this file, on PYTHONPATH with it

__all__ = ["patch_speculative"]


def patch_speculative(module: Any, seed: dict[str, Any]) -> None:
    """Patch ``vllm.v1.attention.backends.cpu_attn`` with the seed's ``spec_draft`` and ``spec_rollback`` bugs."""
    if "spec_draft" in seed:
        _patch_draft(module.CPUAttentionBackendImpl, int(seed["spec_draft"]), float(seed.get("add", 0.5)))
    if "spec_rollback" in seed:
        _patch_rollback(module.CPUAttentionBackendImpl, int(seed["spec_rollback"]))


def _patch_draft(cls: Any, layer_index: int, add: float) -> None:
    """``CPUAttentionBackendImpl.forward`` of layer ``layer_index`` perturbs the rows of draft index >= 2."""
    from vllm.model_executor.models.utils import extract_layer_index

    forward = cls.forward

    def seeded_forward(
        self: Any,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is None or extract_layer_index(layer.layer_name) != layer_index:  # warm-up; other layers
            return out
        request, context, query_len, draft = step_rows(attn_metadata)  # a row's offset in its query: its draft index
        hit = (context[request] > 0) & (query_len[request] > 1) & (draft >= 2)
        rows = out.view(out.shape[0], -1)[: request.shape[0]]
        rows += add * hit[:, None].to(rows.dtype)
        return out

    cls.forward = seeded_forward


def _patch_rollback(cls: Any, layer_index: int) -> None:
    """``CPUAttentionBackendImpl.do_kv_cache_update`` of layer ``layer_index`` skips slots the step before wrote."""
    from vllm.model_executor.models.utils import extract_layer_index

    update = cls.do_kv_cache_update
    written: dict[str, torch.Tensor] = {}  # per layer: the slots its previous step wrote

    def seeded_update(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        if extract_layer_index(layer.layer_name) != layer_index:  # a constant of the layer
            update(self, layer, key, value, kv_cache, slot_mapping)
            return
        before = written.get(layer.layer_name, slot_mapping[:0])
        again = torch.isin(slot_mapping, before) & (slot_mapping >= 0)
        update(self, layer, key, value, kv_cache, torch.where(again, torch.full_like(slot_mapping, -1), slot_mapping))
        written[layer.layer_name] = slot_mapping[slot_mapping >= 0].clone()

    cls.do_kv_cache_update = seeded_update
