"""Model families: what the hook API reads from a model's own calls, per model codebase.

:class:`dumper.hooks.capture.Capture` hooks the top-level model and one attention module per decoder
layer. What it reads there differs between codebases, so it asks a *family adapter*: which
child of a decoder layer is its attention module, which argument of that module holds the
hidden states, and the token position and sequence id of every row of a forward pass. For
the ``residual`` point it also hooks the decoder layers and the final norm, and asks where
their residual-stream input is (:meth:`FamilyAdapter.residual_input`, where
:attr:`FamilyAdapter.residual` is set: HF yes, vLLM no, as its layers take the stream split
in two). :class:`HFFamily` (transformers, the default) reads ``position_ids`` / ``cache_position`` /
the attention mask / the KV-cache length of a ``[batch, seq]`` call; the vLLM family
(:mod:`dumper.engines.vllm_hooks`, loaded only for a model whose class lives in ``vllm.``)
reads vLLM's flattened ``[tokens]`` batch and its request metadata.

Example: a family of your own, registered from your code (first match wins, newest first)::

    from dumper.hooks import families

    class MyFamily(families.HFFamily):
        name = "mine"
        attention_names = ("mixer",)

        @classmethod
        def matches(cls, model):
            return type(model).__module__.startswith("mylib.")

    families.register(MyFamily)
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from dumper.errors import UsageError
from dumper.hooks.fingerprint import model_identity
from dumper.format import PAD_SEQUENCE, TensorRecord, decode_runs, encode_runs
from dumper.hooks.layers import _ATTN_NAMES, _NORM_NAMES

__all__ = ["Runs", "PassRows", "SharedRows", "FamilyAdapter", "HFFamily", "register", "family_for",
           "resolve_model", "as_runs", "shared_row_tensors", "ATTENTION_NAMES", "NORM_NAMES", "HFRows"]

ATTENTION_NAMES = _ATTN_NAMES
"""Attribute names of the attention child of a decoder layer, tried in order (HF and vLLM agree)."""
NORM_NAMES = _NORM_NAMES
"""Attribute names of the final norm beside the decoder layer list, tried in order (for the ``residual`` point)."""


@dataclass(frozen=True)
class Runs:
    """Row metadata already run-length encoded (shared by every layer of one pass)."""

    runs: list[list[int]]


def as_runs(values: Any, rows: int, what: str) -> list[list[int]] | None:
    """Row metadata given per row (tensor, array, sequence) or as :class:`Runs`, run-length encoded."""
    if values is None:
        return None
    if isinstance(values, Runs):
        return values.runs
    arr = values.detach().reshape(-1).cpu().numpy() if isinstance(values, torch.Tensor) \
        else np.asarray(values).reshape(-1)
    if arr.size != rows:
        raise UsageError(f"{what} has {arr.size} entries but the tensor has {rows} rows")
    return encode_runs(arr, step=1 if what == "positions" else 0)


@dataclass
class PassRows:
    """Positions and sequence ids of the rows of one forward pass.

    A hidden tensor whose leading dims equal ``shape`` (``[batch, seq]`` for HF, ``[tokens]``
    for vLLM's flattened batch) inherits them. ``keep`` (flat row indices) selects the rows
    to record when some are not worth it (vLLM's decode tokens and padding); ``None`` keeps all.
    """

    shape: tuple[int, ...]
    positions: Runs
    sequence_ids: Runs
    keep: torch.Tensor | None = None

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [*shape, hidden] as the recorded rows [kept, hidden] (``x`` itself when all are kept)."""
        if self.keep is None:
            return x
        return x.reshape(-1, x.shape[-1]).index_select(0, self.keep.to(x.device, non_blocking=True))

    @property
    def empty(self) -> bool:
        return self.keep is not None and self.keep.numel() == 0


@dataclass(frozen=True)
class SharedRows:
    """Positions ``0 .. count-1`` of ``sequence`` reuse rows computed for ``source`` (a prefix-cache hit).

    The engine read those tokens' keys and values from ``source``'s cache blocks instead of
    computing them, so ``source``'s recorded rows are the states this sequence attended to.
    """

    sequence: int
    source: int
    count: int


class FamilyAdapter:
    """One capture's view of a model family; a subclass overrides what its codebase does differently.

    ``model`` is the module hooked; ``handle`` the object the user passed when it is not that
    module (an engine handle that :meth:`resolve` turned into its model), else ``None``.
    """

    name: ClassVar[str] = "base"
    attention_names: ClassVar[tuple[str, ...]] = ATTENTION_NAMES
    norm_names: ClassVar[tuple[str, ...]] = NORM_NAMES
    residual: ClassVar[bool] = False
    """Whether :meth:`residual_input` says where a decoder layer's residual stream is (the ``residual`` point)."""

    def __init__(self, model: nn.Module | None, handle: Any = None) -> None:
        self.model, self.handle = model, handle

    @classmethod
    def matches(cls, model: Any) -> bool:
        """Whether this family handles ``model`` (an ``nn.Module``, or an engine object it resolves)."""
        return False

    @classmethod
    def resolve(cls, obj: Any) -> Any:
        """The ``nn.Module`` to hook for ``obj`` (an engine handle may stand for its model)."""
        return obj

    def hidden_input(self, args: tuple, kwargs: dict) -> Any:
        """The hidden-state input of a hooked attention module call."""
        return kwargs.get("hidden_states", args[0] if args else None)

    def residual_input(self, args: tuple, kwargs: dict) -> Any:
        """The residual stream entering a hooked decoder layer (or the final norm), before its norm.

        Only called when :attr:`residual` is true; the default reads ``hidden_states`` or the first
        positional argument, as transformers' decoder layers take it.
        """
        return kwargs.get("hidden_states", args[0] if args else None)

    def pass_rows(self, args: tuple, kwargs: dict) -> PassRows | None:
        """Row metadata of a top-level forward pass from its inputs (``None``: rows stay unlabelled)."""
        return None

    def module_rows(self, rows: PassRows | None, kwargs: dict) -> PassRows | None:
        """``rows`` refined by what a hooked module's call says (default: unchanged)."""
        return rows

    def end_pass(self, rows: PassRows | None) -> None:
        """A top-level forward pass with these rows ended."""

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        """Sequence id of each batch row for the following passes (``None``: number them anew)."""
        raise UsageError(f"set_sequence_ids: the {self.name} family takes sequence ids from the engine's batch")

    def shared_rows(self) -> list[SharedRows]:
        """Rows that sequences reused from others instead of computing them (filled in at the end)."""
        return []

    def identity(self, name: str | None) -> dict[str, Any]:
        """The manifest's model identity."""
        return model_identity(self.model, name)

    def environment(self) -> dict[str, Any]:
        """Facts beyond :func:`dumper.hooks.fingerprint.environment_fingerprint` (engine, backend) for the manifest."""
        return {}


_REGISTRY: list[type[FamilyAdapter]] = []
_LAZY: list[tuple[str, str]] = [("vllm.", "dumper.engines.vllm_hooks")]
"""(module prefix of a model class, module that registers its family): no engine is imported until needed."""


def register(family: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Add ``family`` to the registry, checked before those registered earlier; usable as a decorator."""
    if family not in _REGISTRY:
        _REGISTRY.insert(0, family)
    return family


def family_for(model: Any) -> type[FamilyAdapter]:
    """The family class that handles ``model``: a registered one that matches, else :class:`HFFamily`."""
    module = type(model).__module__ or ""
    for prefix, loader in _LAZY:
        if module.startswith(prefix):
            importlib.import_module(loader)
    return next((f for f in _REGISTRY if f.matches(model)), HFFamily)


def resolve_model(model: Any) -> tuple[nn.Module | None, FamilyAdapter]:
    """(the module to hook, this capture's family adapter) for what :func:`dumper.capture` was given."""
    if model is None:
        return None, HFFamily(None)
    family = family_for(model)
    module = family.resolve(model)
    if not isinstance(module, nn.Module):
        raise UsageError(f"capture(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    return module, family(module, None if module is model else model)


# -- transformers ----------------------------------------------------------------------------------


def _cache_length(cache: Any) -> int:
    """Tokens a model's KV cache holds; 0 without one or when it cannot say (a state-space model's cache)."""
    get = getattr(cache, "get_seq_length", None)
    try:
        return int(get()) if callable(get) else 0
    except Exception:  # noqa: BLE001 - the model's own cache object
        return 0


@dataclass
class HFRows(PassRows):
    """Rows of a ``[batch, seq]`` pass. Padding rows keep their column index as position (one run in
    the encoding) and get sequence id :data:`PAD_SEQUENCE`, which keeps them out of every comparison."""

    pad: np.ndarray | None = None  # [batch, seq] bool, True for padding rows
    pos: np.ndarray | None = None  # [batch, seq] positions as last set
    row_ids: np.ndarray | None = None  # [batch] sequence id of each batch row
    position_ids: Any = None  # the tensor the positions were last read from (one device sync per tensor)

    def set_positions(self, pos: np.ndarray) -> None:
        if self.pad is not None:
            pos = np.where(self.pad, np.arange(self.shape[1])[None, :], pos)
        self.pos = np.asarray(pos)
        self.positions = Runs(encode_runs(self.pos, step=1))

    def set_sequences(self, ids: np.ndarray) -> None:
        self.row_ids = ids
        row_seq = np.repeat(ids, self.shape[1]).reshape(self.shape)
        self.sequence_ids = Runs(encode_runs(row_seq if self.pad is None else np.where(self.pad, PAD_SEQUENCE, row_seq),
                                             step=0))

    def with_position_ids(self, value: Any) -> HFRows:
        """Positions from a ``position_ids`` kwarg seen by a hooked module (read once per tensor object)."""
        batch, seq = self.shape
        if value is None or value is self.position_ids or not isinstance(value, torch.Tensor) \
                or value.shape[-1] != seq:
            return self
        self.set_positions(value.detach().reshape(-1, seq).expand(batch, seq).cpu().numpy())
        self.position_ids = value
        return self

    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per batch row: (first real position, last real position, whether the row has a real token)."""
        assert self.pos is not None
        real = np.ones(self.shape, bool) if self.pad is None else ~self.pad
        has = real.any(axis=1)
        cols = np.arange(self.shape[1])
        first = np.where(real, cols, self.shape[1]).min(axis=1).clip(max=self.shape[1] - 1)
        last = np.where(real, cols, -1).max(axis=1).clip(min=0)
        rows = np.arange(self.shape[0])
        return self.pos[rows, first], self.pos[rows, last], has


class HFFamily(FamilyAdapter):
    """transformers models (the default): one ``[batch, seq]`` call per pass, positions from its kwargs.

    Positions come from ``position_ids`` / ``cache_position``, else from a 2-D
    ``attention_mask`` (``cumsum - 1``, right for left padding too), else from the KV-cache
    length; rows whose mask is 0 are padding. Sequence ids are those of
    :meth:`set_sequence_ids`, else a pass whose every batch row starts right after that row's
    last position in the previous pass (a prefill chunk, a decode step over one KV cache)
    continues its sequences, else the pass gets new ids.
    """

    name = "hf"
    residual = True

    def __init__(self, model: nn.Module | None, handle: Any = None) -> None:
        super().__init__(model, handle)
        self._explicit: list[int] | None = None
        self._next = 0
        self._prev_ids: np.ndarray | None = None  # [batch] sequence ids of the previous pass
        self._prev_last: np.ndarray | None = None  # [batch] last real position of each row so far

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        self._explicit = None if ids is None else [int(i) for i in ids]

    def pass_rows(self, args: tuple, kwargs: dict) -> HFRows | None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
        if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
            return None
        batch, seq = int(ref.shape[0]), int(ref.shape[1])
        mask = kwargs.get("attention_mask")
        positions = pad = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] >= seq:
            m = mask.detach().to("cpu", torch.int64).numpy()
            pad = m[:, -seq:] == 0
            positions = (np.cumsum(m, axis=1) - 1)[:, -seq:]
        if positions is None:
            past = _cache_length(kwargs.get("cache", kwargs.get("past_key_values")))
            positions = np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq))
        rows = HFRows((batch, seq), Runs([]), Runs([]), pad=pad)
        rows.set_positions(positions)
        for key in ("position_ids", "cache_position"):
            if isinstance(kwargs.get(key), torch.Tensor):
                rows = rows.with_position_ids(kwargs[key])
                break
        rows.set_sequences(self._sequence_ids(rows))
        return rows

    def _sequence_ids(self, rows: HFRows) -> np.ndarray:
        batch = rows.shape[0]
        if self._explicit is not None and len(self._explicit) == batch:
            return np.asarray(self._explicit, dtype=np.int64)
        first, _, has = rows.bounds()
        prev, last = self._prev_ids, self._prev_last
        if prev is not None and last is not None and len(prev) == batch and has.any() \
                and bool(np.all(~has | (first == last + 1))):
            return prev
        out = np.arange(self._next, self._next + batch, dtype=np.int64)
        self._next += batch
        return out

    def module_rows(self, rows: PassRows | None, kwargs: dict) -> PassRows | None:
        return rows.with_position_ids(kwargs.get("position_ids")) if isinstance(rows, HFRows) else rows

    def end_pass(self, rows: PassRows | None) -> None:
        if not isinstance(rows, HFRows) or rows.row_ids is None:
            return
        _, last, has = rows.bounds()
        before = self._prev_last if self._prev_ids is not None and np.array_equal(self._prev_ids, rows.row_ids) \
            else np.full(len(last), -1, dtype=np.int64)
        self._prev_ids, self._prev_last = rows.row_ids, np.where(has, last, before)


def shared_row_tensors(out_dir: Path, records: Sequence[TensorRecord], shared: Sequence[SharedRows]
                       ) -> list[tuple[TensorRecord, torch.Tensor, np.ndarray, np.ndarray]]:
    """The rows each hit reused, read back from its source's records and labelled as the hit's own.

    Returns one entry per recorded (name, call): (a source record of it, rows [n, hidden],
    positions [n], sequence ids [n]). A hit whose source rows are incomplete gets none.
    """
    groups: dict[tuple[str, int], tuple[TensorRecord, list[torch.Tensor], list[np.ndarray], list[np.ndarray]]] = {}
    for hit in shared:
        found: dict[tuple[str, int], list[tuple[np.ndarray, TensorRecord, np.ndarray]]] = {}
        for rec in records:
            if rec.positions is None or rec.sequence_ids is None:
                continue
            pos, seq = decode_runs(rec.positions, step=1), decode_runs(rec.sequence_ids, step=0)
            rows = np.flatnonzero((seq == hit.source) & (pos < hit.count))
            if rows.size:
                found.setdefault((rec.name, rec.call), []).append((pos[rows], rec, rows))
        for key, parts in found.items():
            pos = np.concatenate([p for p, _, _ in parts])
            if not np.array_equal(np.sort(pos), np.arange(hit.count)):
                continue
            order = torch.from_numpy(np.argsort(pos, kind="stable"))
            rows = torch.cat([_read_rows(out_dir, rec, r) for _, rec, r in parts]).index_select(0, order)
            group = groups.setdefault(key, (parts[0][1], [], [], []))
            group[1].append(rows)
            group[2].append(np.arange(hit.count, dtype=np.int64))
            group[3].append(np.full(hit.count, hit.sequence, dtype=np.int64))
    return [(rec, torch.cat(t), np.concatenate(p), np.concatenate(q)) for rec, t, p, q in groups.values()]


def _read_rows(out_dir: Path, rec: TensorRecord, rows: np.ndarray) -> torch.Tensor:
    with safe_open(str(out_dir / rec.file), framework="pt") as f:
        t = f.get_tensor(rec.key)
    return t.reshape(-1, t.shape[-1]).index_select(0, torch.from_numpy(rows))

