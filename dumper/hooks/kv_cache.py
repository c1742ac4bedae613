"""The KV cache points: the key and value rows each layer stored for each token, and the read-back check.

``k_cache`` and ``v_cache`` (:data:`dumper.format.points.CACHE_POINTS`) are not hooked: after each
forward pass the capture reads, for the selected layers, the rows the pass wrote into the
engine's own cache, through the engine's own addressing (vLLM: the step's slot mapping into the
paged cache; transformers: the model's cache object), so that what is recorded is what a later
step will read. Keys are after RoPE; an fp8 cache is dequantized with the layer's scale and
stored as float32, any other is stored in its own dtype. Rows are labelled by (sequence,
position) like every other point, one ``[rows, kv_heads x head_dim]`` record per layer and
point (under tensor parallelism each rank records its own heads, ``shard_dim`` 1).

The **read-back check** (:class:`ReadbackLedger`) keeps a fingerprint of every row written for
a recorded (sequence, position), and at every pass compares the rows attention reads for each
query (vLLM: gathered through the block table the attention kernel was given; transformers: the
cache's columns before the pass) with the fingerprints written there. A row that differs is a
failure naming the sequence, the query's position and the position read, and whose row it
found instead when it is one the capture saw written. The manifest's ``extra.kv_cache`` holds the
layout (:func:`layout_entry`) and the check's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dumper.errors import UsageError
from dumper.format.points import CACHE_POINTS, FP8_CACHE_DTYPES, K_CACHE, V_CACHE

__all__ = [
    "CacheRows",
    "CacheReader",
    "ReadbackLedger",
    "fingerprint",
    "layout_entry",
    "HFCacheReader",
    "MAX_FAILURES",
    "FP8_DTYPES",
]

MAX_FAILURES = 64
"""Read-back failures kept in full in a dump (the count says how many there were)."""
FP8_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in FP8_CACHE_DTYPES.items()}
"""An engine's fp8 cache dtype names and the torch dtype its bytes hold (:data:`FP8_CACHE_DTYPES`)."""


@dataclass
class CacheRows:
    """What one pass wrote (or a prefix-cache hit served) for one layer: key and value rows ``[..., width]``.

    ``labels`` is ``None`` when the rows are shaped by the pass's rows (they inherit its labels); otherwise
    ``(positions, sequence_ids)`` label each row (prefix-cache hits first).
    """

    layer: int
    name: str  # the attention module's name: records are ``{name}.k_cache`` and ``{name}.v_cache``
    k: torch.Tensor
    v: torch.Tensor
    labels: tuple[np.ndarray, np.ndarray] | None = None
    hits: int = 0  # how many leading rows a prefix-cache hit served (read from the cache, not written by the pass)
    sharded: bool = False  # this rank's heads only (tensor parallelism): the rows are a shard of the last dim


class CacheReader(Protocol):
    """Reads the KV cache of the selected layers after each pass (a family's :meth:`cache_reader`)."""

    ledger: ReadbackLedger

    def read(self, rows: Any, output: Any) -> list[CacheRows]:
        """The rows the pass that just ended wrote for each selected layer, after checking what it read."""
        ...

    def layout(self) -> dict[str, Any]:
        """The manifest's ``extra.kv_cache`` entry (:func:`layout_entry`)."""
        ...


def layout_entry(
    *,
    engine_dtype: str,
    stored_dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    block_size: int | None,
    scales: dict[int, tuple[float, float]] | None = None,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """``extra.kv_cache``: the cache dtype the engine ran (``auto``, ``fp8_e4m3``...), the dtype its rows are stored
    in, the kv heads of the whole model and the head size, the block size (None: not paged), per-layer scales."""
    return {
        "dtype": engine_dtype,
        "stored_dtype": str(stored_dtype).removeprefix("torch."),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "block_size": None if block_size is None else int(block_size),
        "tensor_parallel_size": int(tensor_parallel_size),
        **({"scales": {str(k): [float(a), float(b)] for k, (a, b) in sorted(scales.items())}} if scales else {}),
    }


_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}
_CHUNK_BYTES = 32 << 20
"""Most bytes of int64 products :func:`fingerprint` holds at once (a long context's rows go in chunks)."""


def fingerprint(raw: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint ``[n]`` of each row of ``raw`` ``[n, ...]`` from its bytes: equal rows (bit for bit)
    give equal fingerprints, and two different rows the same one only by a ~2^-50 chance. Runs where ``raw`` is
    (no copy to the host); exact integer arithmetic, no overflow (bytes < 2^8, weights < 2^40, < 2^15 terms)."""
    n = raw.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=raw.device)
    b = raw.reshape(n, -1).contiguous()
    b = b.view(torch.uint8) if b.dtype != torch.uint8 else b
    width = b.shape[1]
    key = (width, str(b.device))
    w = _WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED + width)
        w = _WEIGHTS[key] = torch.randint(1, 1 << 40, (width,), generator=g, dtype=torch.int64).to(b.device)
    if width >= 1 << 15:
        raise UsageError(f"k_cache: a cache row of {width} bytes is wider than the read-back check takes")
    step = max(1, _CHUNK_BYTES // (8 * width))  # int64 products of at most this many rows at a time
    return torch.cat([(b[i : i + step].to(torch.int64) * w).sum(dim=1) for i in range(0, n, step)])


@dataclass
class Failure:
    """One row a query read that is not the row written there."""

    layer: int
    point: str
    sequence: int
    query_position: int
    read_position: int
    written_by: tuple[int, int] | None  # (sequence, position) of the row it read instead, when the capture wrote it

    def record(self) -> dict[str, Any]:
        """The failure as ``extra.kv_cache.readback.failures`` holds it (:mod:`dumper.format.kv_cache`)."""
        d: dict[str, Any] = {
            "layer": self.layer,
            "point": self.point,
            "sequence": self.sequence,
            "query_position": self.query_position,
            "read_position": self.read_position,
        }
        if self.written_by is not None:
            d["written_by"] = {"sequence": self.written_by[0], "position": self.written_by[1]}
        return d


class ReadbackLedger:
    """Fingerprints of the rows written per (layer, point, sequence, position), and the reads checked against them.

    Per (layer, point, sequence): one int64 array of fingerprints by position and a mask of the positions known,
    so a check is a few vectorized operations whatever the context length; only a failure searches whose row it
    read (the first sequence, in order, that wrote that fingerprint at that layer and point).
    """

    def __init__(self) -> None:
        self._book: dict[tuple[int, str, int], tuple[np.ndarray, np.ndarray]] = {}
        self.checked = 0
        self.count = 0
        self.failures: list[Failure] = []

    def _arrays(self, layer: int, point: str, seq: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        fps, known = self._book.get((layer, point, seq), (np.zeros(0, np.int64), np.zeros(0, bool)))
        if fps.size < size:
            grown = max(size, 2 * fps.size)
            fps = np.concatenate([fps, np.zeros(grown - fps.size, np.int64)])
            known = np.concatenate([known, np.zeros(grown - known.size, bool)])
            self._book[layer, point, seq] = (fps, known)
        return fps, known

    def write(self, layer: int, point: str, seqs: Any, positions: Any, fps: torch.Tensor) -> None:
        """Rows written for (sequence, position): their fingerprints are what later reads must find."""
        seqs, positions = np.asarray(seqs, np.int64), np.asarray(positions, np.int64)
        f = fps.detach().cpu().numpy()
        for s in np.unique(seqs).tolist():
            at = seqs == s
            book, known = self._arrays(layer, point, int(s), int(positions[at].max()) + 1)
            book[positions[at]] = f[at]
            known[positions[at]] = True

    def check(self, layer: int, point: str, seq: int, query: int, positions: np.ndarray, fps: torch.Tensor) -> None:
        """The rows at ``positions`` that sequence ``seq``'s query at ``query`` read; each is checked against the row
        written for (``seq``, position) where one was, and becomes the expected row where none was (a prefix-cache
        hit's first read)."""
        if positions.size == 0:
            return
        f = fps.detach().cpu().numpy()
        book, known = self._arrays(layer, point, seq, int(positions.max()) + 1)
        seen = known[positions]
        new = positions[~seen]
        book[new], known[new] = f[~seen], True
        bad = seen & (book[positions] != f)
        self.checked += int(seen.sum())
        self.count += int(bad.sum())
        for p, got in zip(positions[bad].tolist(), f[bad].tolist(), strict=True):
            if len(self.failures) >= MAX_FAILURES:
                break
            self.failures.append(Failure(layer, point, seq, query, p, self._owner(layer, point, got)))

    def _owner(self, layer: int, point: str, fp: int) -> tuple[int, int] | None:
        for (la, pt, s), (book, known) in sorted(self._book.items()):
            if (la, pt) == (layer, point):
                hit = np.flatnonzero(known & (book == fp))
                if hit.size:
                    return s, int(hit[0])
        return None

    def summary(self) -> dict[str, Any]:
        """``extra.kv_cache.readback``: reads checked, failures counted, the first :data:`MAX_FAILURES` in full."""
        return {"checked": self.checked, "failed": self.count, "failures": [f.record() for f in self.failures]}


def _cache_layer(cache: Any, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) ``[batch, kv_heads, columns, head_dim]`` of one layer of a transformers cache object."""
    layers = getattr(cache, "layers", None)
    if layers is not None and index < len(layers):
        k, v = getattr(layers[index], "keys", None), getattr(layers[index], "values", None)
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            return k, v
    kc, vc = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if isinstance(kc, list) and isinstance(vc, list) and index < len(kc):
        return kc[index], vc[index]
    return None


class HFCacheReader:
    """The cache points of a transformers model: its cache object after each pass (``use_cache=True``).

    The pass's own rows are the cache's last ``seq`` columns (a dynamic cache grows by each pass);
    the columns before them are what the pass's queries read, checked against what earlier passes
    of the capture wrote there (there is no block table: the written cache is the reference).
    """

    def __init__(self, model: Any, targets: Sequence[Any]) -> None:
        self.model = model
        self.layers = sorted({(t.layer, t.name) for t in targets if t.point in CACHE_POINTS})
        self.ledger = ReadbackLedger()
        self._cols: np.ndarray | None = None  # [batch, columns] sequence id (-1: padding) of each cache column written
        self._pos: np.ndarray | None = None  # [batch, columns] its position
        self._dtype: torch.dtype | None = None
        self._shape: tuple[int, int] | None = None

    def read(self, rows: Any, output: Any) -> list[CacheRows]:
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if cache is None:
            raise UsageError(
                f"{K_CACHE}/{V_CACHE}: {type(self.model).__name__}'s forward pass returned no KV cache; "
                "call it with use_cache=True to capture the cache points"
            )
        shape = getattr(rows, "shape", None)
        if shape is None or len(shape) != 2:
            raise UsageError(f"{K_CACHE}/{V_CACHE}: the pass's rows are not labelled [batch, seq]")
        batch, seq = shape
        pad = rows.pad if getattr(rows, "pad", None) is not None else np.zeros(shape, bool)
        ids = np.where(pad, -1, np.repeat(np.asarray(rows.row_ids), seq).reshape(shape))  # this pass's columns
        pos = np.asarray(rows.pos)
        real = np.flatnonzero(ids.reshape(-1) >= 0)
        out, past = [], 0
        for layer, name in self.layers:
            kv = _cache_layer(cache, layer)
            if kv is None:
                raise UsageError(
                    f"{name}.{K_CACHE}: {type(cache).__name__} holds no keys and values for layer {layer} "
                    "(a cache driftscope cannot read: not a dynamic cache)"
                )
            k, v = kv
            if k.dim() != 4 or k.shape[0] != batch or k.shape[2] < seq:
                raise UsageError(
                    f"{name}.{K_CACHE}: {type(cache).__name__}'s keys are {list(k.shape)}, not [batch {batch}, "
                    f"kv_heads, >= {seq} columns, head_dim]"
                )
            self._shape = (int(k.shape[1]), int(k.shape[3]))
            self._dtype = k.dtype
            past = int(k.shape[2]) - seq
            new = {}
            for point, t in ((K_CACHE, k), (V_CACHE, v)):
                self._check(layer, point, t[:, :, :past, :], pos[:, -1])
                new[point] = t[:, :, past:, :].transpose(1, 2).reshape(batch, seq, -1)
                flat = new[point].reshape(batch * seq, -1)[torch.from_numpy(real).to(t.device)]
                self.ledger.write(layer, point, ids.reshape(-1)[real], pos.reshape(-1)[real], fingerprint(flat))
            out.append(CacheRows(layer, name, new[K_CACHE].clone(), new[V_CACHE].clone()))
        written = self._cols is not None and past > 0 and self._cols.shape == (batch, past)
        self._cols = np.concatenate([self._cols, ids], axis=1) if written else ids
        self._pos = np.concatenate([self._pos, pos], axis=1) if written else pos
        return out

    def _check(self, layer: int, point: str, read: torch.Tensor, query: np.ndarray) -> None:
        """The columns the pass's queries read (``read`` ``[batch, kv_heads, past, head_dim]``) against the rows the
        capture saw written there; a cache it did not see written has nothing to check against."""
        cols, past = self._cols, read.shape[2]
        if past == 0 or cols is None or cols.shape != (read.shape[0], past):
            return
        assert self._pos is not None
        rows = read.transpose(1, 2)  # [batch, past, kv_heads, head_dim]
        for b in range(cols.shape[0]):
            real = np.flatnonzero(cols[b] >= 0)
            if real.size:
                fps = fingerprint(rows[b, torch.from_numpy(real).to(rows.device)])
                self.ledger.check(layer, point, int(cols[b, real[0]]), int(query[b]), self._pos[b, real], fps)

    def layout(self) -> dict[str, Any]:
        heads, dim = self._shape or (0, 0)
        return layout_entry(
            engine_dtype="auto",
            stored_dtype=self._dtype or torch.float32,
            num_kv_heads=heads,
            head_dim=dim,
            block_size=None,
        )
