"""A seeded chunk-boundary bug in vLLM's CPU attention backend (loaded by ``sitecustomize`` for ``chunk_layer``).

``{"chunk_layer": L, "add": A}``: the attention of layer ``L`` adds ``A`` to its output rows of
every request that continues from an earlier engine step (tokens computed before this step:
``seq_len - query_len > 0``), i.e. the rows after a chunked-prefill boundary. A prompt that
runs in one step is untouched, so only runs that chunk the prompt diverge, from the first
boundary on. (A prefix-cache hit also continues a request: keep such cells out of a sweep
that uses this bug.) Which layer is buggy is a constant of the layer; the rest is tensor
code over vLLM's own attention metadata, with no branch on data.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["patch_cpu_attention", "step_rows"]


def step_rows(meta: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of the step's real rows, from vLLM's attention metadata: each row's request, and per request the tokens of
    earlier steps (``seq_len - query_len``) and its query length, and each row's offset in its request's query."""
    starts, n = meta.query_start_loc, int(meta.num_actual_tokens)
    query = starts[1:] - starts[:-1]
    rows = torch.arange(n, device=starts.device)
    request = torch.searchsorted(starts[1:], rows, right=True)
    return request, meta.seq_lens - query, query, rows - starts[request]


def patch_cpu_attention(module: Any, seed: dict[str, Any]) -> None:
    """``CPUAttentionBackendImpl.forward`` of layer ``seed["chunk_layer"]`` perturbs continuing requests' rows."""
    from vllm.model_executor.models.utils import extract_layer_index

    cls = module.CPUAttentionBackendImpl
    forward = cls.forward
    layer_index, add = int(seed["chunk_layer"]), float(seed.get("add", 0.5))

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
        request, context, _, _ = step_rows(attn_metadata)
        rows = out.view(out.shape[0], -1)[: request.shape[0]]
        rows += add * (context[request] > 0)[:, None].to(rows.dtype)
        return out

    cls.forward = seeded_forward
