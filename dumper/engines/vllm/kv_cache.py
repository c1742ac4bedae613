"""The cache points in vLLM: the rows each layer wrote into its paged KV cache, read through the step's own addressing.

After every forward pass (outside the compiled graph, in the process that runs the model: the
engine core or each TP worker), for each selected layer this reads the layer's cache tensor at
the pass's slot mapping (where ``reshape_and_cache`` wrote each token's key and value), and for
each recorded request the rows of its whole context through the block table the attention
kernel was given (what the step read): the read-back check of :class:`~dumper.hooks.kv_cache.ReadbackLedger`.
A request's first pass after a prefix-cache hit also records the rows it was served for
positions before its first computed one (``meta.cache_hits``: how many lead the record).

Cache layouts (per layer, as the backend's ``kv_cache`` tensor holds them):

- ``CPU_ATTN`` (ISA ``vec``/``vec16``): ``[blocks, kv_heads, block_size, 2 x head_dim]``, each
  (block, head) holding the keys transposed, ``[head_dim, block_size]``, then the values
  ``[block_size, head_dim]`` (measured against ``cpu_attn_reshape_and_cache``; the AMX and NEON
  layouts are refused: not measured);
- ``[2, blocks, block_size, kv_heads, head_dim]`` (FlashAttention and its kin) and
  ``[blocks, 2, block_size, kv_heads, head_dim]`` (Triton): read by their shape; not run here (no GPU).

An fp8 cache's bytes are dequantized with the layer's ``k_scale``/``v_scale`` into float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dumper.errors import UsageError
from dumper.format import decode_runs
from dumper.format.points import CACHE_POINTS, K_CACHE, V_CACHE
from dumper.hooks.kv_cache import FP8_DTYPES, CacheRows, ReadbackLedger, fingerprint, layout_entry

__all__ = ["VllmCacheReader", "attention_layer"]

Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""slots ``[n]`` (>= 0) -> raw (keys, values) ``[n, kv_heads, head_dim]`` as the cache holds them."""


def attention_layer(module: nn.Module) -> nn.Module | None:
    """vLLM's ``Attention`` inside a decoder layer's attention module: the child that owns a KV cache."""
    for m in module.modules():
        if hasattr(m, "layer_name") and hasattr(m, "kv_cache") and hasattr(m, "impl"):
            return m
    return None


def _gather(attn: nn.Module, kv: torch.Tensor, where: str) -> tuple[Gather, int]:
    """How to read the rows at given slots of ``kv`` (the layer's cache), and its block size."""
    backend = attn.attn_backend.get_name() if hasattr(attn, "attn_backend") else type(attn.impl).__name__
    if backend == "CPU_ATTN":
        isa = getattr(attn, "isa", None)
        if isa not in ("vec", "vec16") or kv.dim() != 4:
            raise UsageError(
                f"{where}: vLLM's CPU attention with ISA {isa!r} and a cache of {list(kv.shape)} lays its blocks "
                "out in a way driftscope has not measured (vec and vec16 only); drop the cache points"
            )
        nb, h, bs, two_d = (int(s) for s in kv.shape)
        d = two_d // 2
        keys = kv.view(nb, h, 2, bs * d)[:, :, 0].reshape(nb, h, d, bs)
        values = kv.view(nb, h, 2, bs, d)[:, :, 1]

        def cpu(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b, o = slots // bs, slots % bs
            return keys[b, :, :, o], values[b, :, o, :]

        return cpu, bs
    if kv.dim() == 5 and kv.shape[0] == 2:  # [2, blocks, block_size, kv_heads, head_dim]
        bs = int(kv.shape[2])
        return (lambda s: (kv[0][s // bs, s % bs], kv[1][s // bs, s % bs])), bs
    if kv.dim() == 5 and kv.shape[1] == 2:  # [blocks, 2, block_size, kv_heads, head_dim]
        bs = int(kv.shape[2])
        return (lambda s: (kv[s // bs, 0, s % bs], kv[s // bs, 1, s % bs])), bs
    raise UsageError(
        f"{where}: vLLM's {backend} KV cache is {list(kv.shape)}, a layout driftscope cannot read; "
        "drop the cache points"
    )


class VllmCacheReader:
    """Reads the selected layers' paged KV cache after each pass of a vLLM model (see the module doc)."""

    def __init__(self, family: Any, targets: Sequence[Any]) -> None:
        self.family = family
        self.ledger = ReadbackLedger()
        self.layers: list[tuple[int, str, nn.Module]] = []
        for t in sorted(
            {(t.layer, t.name): t for t in targets if t.point in CACHE_POINTS}.values(), key=lambda t: t.layer
        ):
            attn = attention_layer(t.module)
            if attn is None:
                raise UsageError(f"{t.name}.{K_CACHE}: no vLLM Attention with a KV cache inside {t.name}")
            self.layers.append((t.layer, t.name, attn))
        first = self.layers[0][2] if self.layers else None
        self._dtype = str(getattr(first, "kv_cache_dtype", None) or getattr(first.impl, "kv_cache_dtype", "auto"))
        self._heads = int(getattr(first, "num_kv_heads", 0) or 0)
        self._dim = int(getattr(first, "head_size", 0) or 0)
        self._tp = _tp_size()
        self._block: int | None = None
        self._stored: torch.dtype | None = None
        self._hits_done: set[int] = set()  # sequences whose cache-hit rows were recorded
        self._ctx: tuple[int, torch.Tensor, list[tuple[int, int, int]]] | None = None  # this pass's contexts

    def _rows_of(self, attn: nn.Module, raw: torch.Tensor, point: str) -> torch.Tensor:
        """Raw cache rows ``[n, kv_heads, head_dim]`` as ``[n, width]`` values (fp8 dequantized to float32)."""
        fp8 = FP8_DTYPES.get(self._dtype)
        if fp8 is None:
            return raw.reshape(raw.shape[0], -1)
        scale = float(getattr(attn, "_k_scale_float" if point == K_CACHE else "_v_scale_float", 1.0))
        vals = raw if raw.dtype == fp8 else raw.view(fp8)
        return (vals.to(torch.float32) * scale).reshape(raw.shape[0], -1)

    def read(self, rows: Any, output: Any) -> list[CacheRows]:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        batch = getattr(self.family, "last_batch", None)
        if rows is None or not batch or not is_forward_context_available():
            return []
        ctx = get_forward_context()
        self._ctx = None
        n = int(rows.shape[0])
        keep = np.arange(n) if rows.keep is None else rows.keep.cpu().numpy()
        pos = decode_runs(rows.positions.runs, step=1)
        seq = decode_runs(rows.sequence_ids.runs, step=0)
        out = []
        for layer, name, attn in self.layers:
            where = f"{name}.{K_CACHE}"
            meta = ctx.attn_metadata.get(attn.layer_name) if isinstance(ctx.attn_metadata, dict) else None
            slots = ctx.slot_mapping.get(attn.layer_name) if isinstance(ctx.slot_mapping, dict) else None
            if slots is None:
                slots = getattr(meta, "slot_mapping", None)
            kv = attn.kv_cache
            if meta is None or slots is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                continue
            gather, self._block = _gather(attn, kv, where)
            mine = slots[:n].to(torch.int64)[torch.from_numpy(keep).to(slots.device)]
            if (mine < 0).any():
                raise UsageError(f"{where}: a recorded token has no cache slot in this step (slot mapping -1)")
            raw_k, raw_v = gather(mine)
            self.ledger.write(layer, K_CACHE, seq, pos, fingerprint(raw_k))
            self.ledger.write(layer, V_CACHE, seq, pos, fingerprint(raw_v))
            context = self._check(layer, meta, gather, batch)
            k, v = self._rows_of(attn, raw_k, K_CACHE), self._rows_of(attn, raw_v, V_CACHE)
            self._stored = k.dtype
            hit_k, hit_v, hit_pos, hit_seq = self._hits(attn, context, batch)
            labels = (np.concatenate([hit_pos, pos]), np.concatenate([hit_seq, seq]))
            out.append(
                CacheRows(
                    layer,
                    name,
                    torch.cat([hit_k, k]) if hit_k is not None else k.clone(),
                    torch.cat([hit_v, v]) if hit_v is not None else v.clone(),
                    labels=labels,
                    hits=len(hit_pos),
                    sharded=self._tp > 1,
                )
            )
        self._hits_done.update(s for _, s, _, _, hit in batch if hit > 0)
        return out

    def _context(self, meta: Any, i: int, length: int) -> torch.Tensor:
        """The slots of positions ``0 .. length-1`` of request ``i`` through the block table attention was given."""
        p = torch.arange(length, device=meta.block_table.device)
        bs = int(self._block or 1)
        return meta.block_table[i].to(torch.int64)[p // bs] * bs + p % bs

    def _contexts(self, meta: Any, batch: Sequence[tuple]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Every recorded request's whole context through the block table attention was given, as one slot tensor,
        and (sequence, query position, length) per request in its order; computed once per metadata per pass."""
        key = id(meta)
        if self._ctx is None or self._ctx[0] != key:
            # up to the sequence's last recorded row: a speculative pass may write drafts past the output, unrecorded
            seq_lens = meta.seq_lens.cpu().tolist()
            lens = {s: min(int(seq_lens[i]), self.family.end(s)) for i, s, _, _, _ in batch}
            slots = [self._context(meta, i, lens[s]) for i, s, _, _, _ in batch]
            cat = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
            self._ctx = (key, cat, [(s, min(last, lens[s] - 1), lens[s]) for _, s, last, _, _ in batch])
        return self._ctx[1], self._ctx[2]

    def _check(
        self, layer: int, meta: Any, gather: Gather, batch: Sequence[tuple]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The read-back check: each recorded request's whole context as the step read it (one gather per layer).
        Returns each sequence's raw (keys, values) of that context, by position."""
        slots, parts = self._contexts(meta, batch)
        if slots.numel() == 0:
            return {}
        raw_k, raw_v = gather(slots)
        for point, raw in ((K_CACHE, raw_k), (V_CACHE, raw_v)):
            fps, start = fingerprint(raw), 0
            for s, last, n in parts:
                self.ledger.check(layer, point, s, last, np.arange(n), fps[start : start + n])
                start += n
        starts = np.cumsum([0] + [n for _, _, n in parts])
        return {
            s: (raw_k[a : a + n], raw_v[a : a + n]) for (s, _, n), a in zip(parts, starts[:-1].tolist(), strict=True)
        }

    def _hits(
        self, attn: nn.Module, context: dict[int, tuple[torch.Tensor, torch.Tensor]], batch: Sequence[tuple]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, np.ndarray, np.ndarray]:
        """The rows a prefix-cache hit served to each request at its first pass (positions before its first), taken
        from the context :meth:`_check` read."""
        ks, vs, ps, ss = [], [], [], []
        for _, s, _, first, hit in batch:
            if hit <= 0 or s in self._hits_done or first != hit:
                continue
            raw_k, raw_v = (t[:hit] for t in context[s])
            ks.append(self._rows_of(attn, raw_k, K_CACHE))
            vs.append(self._rows_of(attn, raw_v, V_CACHE))
            ps.append(np.arange(hit, dtype=np.int64))
            ss.append(np.full(hit, s, dtype=np.int64))
        if not ks:
            return None, None, np.zeros(0, np.int64), np.zeros(0, np.int64)
        return torch.cat(ks), torch.cat(vs), np.concatenate(ps), np.concatenate(ss)

    def layout(self) -> dict[str, Any]:
        scales = {
            layer: (float(getattr(a, "_k_scale_float", 1.0)), float(getattr(a, "_v_scale_float", 1.0)))
            for layer, _, a in self.layers
        }
        return layout_entry(
            engine_dtype=self._dtype,
            stored_dtype=self._stored or torch.float32,
            num_kv_heads=self._heads * self._tp,
            head_dim=self._dim,
            block_size=self._block,
            scales=scales if self._dtype in FP8_DTYPES else None,
            tensor_parallel_size=self._tp,
        )


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no parallel state (a model built outside an engine): one rank
        return 1
