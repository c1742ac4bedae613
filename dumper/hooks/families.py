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
(:mod:`dumper.engines.vllm.hooks`, loaded only for a model whose class lives in ``vllm.``)
reads vLLM's flattened ``[tokens]`` batch and its request metadata.

Every name the hooks read is an attribute of the adapter, so model code that spells them
otherwise needs a subclass that changes attributes, not an edit of the library. Example: a
family of your own, registered from your code (first match wins, newest first)::

    from dumper.hooks import families

    class MyFamily(families.HFFamily):
        name = "mine"
        attention_names = ("mixer",)        # layer.mixer is the attention module
        hidden_kwarg = "x"                  # it is called as mixer(x=...)
        position_kwargs = ("positions",)    # the model is called as model(ids, positions=...)

        @classmethod
        def matches(cls, model):
            return type(model).__module__.startswith("mylib.")

    families.register(MyFamily)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from dumper.errors import UsageError
from dumper.format.points import MLP_INPUT, OUTPUT_POINTS, RESIDUAL
from dumper.hooks.fingerprint import model_identity
from dumper.hooks.routing import find_routers, has_router, known_families
from dumper.hooks.rows import HFRows, PassRows, Runs, SharedRows

__all__ = ["FamilyAdapter", "HFFamily", "RouterHook", "register", "unregister", "family_for", "resolve_model"]


@dataclass(frozen=True)
class RouterHook:
    """One MoE router to hook for the ``router`` point: ``module`` gets a forward hook (``with_kwargs=True``)
    that calls ``read(args, kwargs, output)`` for the routing parts (``{ROUTER_LOGITS: t, ROUTER_IDS: t,
    ROUTER_WEIGHTS: t, ROUTER_SCORES: t}``, any subset; :mod:`dumper.format.manifest`), recorded by
    :meth:`dumper.hooks.capture.Capture.record_router`. ``read`` only reads: the model's outputs stay as they are."""

    module: nn.Module
    read: Callable[[tuple, dict, Any], dict[str, torch.Tensor]]


class FamilyAdapter:
    """One capture's view of a model family; a subclass overrides what its codebase does differently.

    The whole interface, in four parts (override only what differs):

    - *which modules*: :attr:`attention_names`, :attr:`mlp_names`, :attr:`norm_names`, :attr:`residual` and
      :meth:`router_hooks` (the ``router`` point), read by :func:`dumper.hooks.layers.hook_targets`;
    - *where a hooked call's hidden states are*: :meth:`point_value`, through :meth:`hidden_input` (the
      attention input) and :meth:`residual_input` (a decoder layer's input), by default the
      :attr:`hidden_kwarg` keyword or the first positional argument;
    - *where its rows' positions and sequence ids come from*: :meth:`pass_rows` (the top-level
      call), :meth:`module_rows` (a hooked module's call), :meth:`end_pass`,
      :meth:`set_sequence_ids` and :meth:`shared_rows` (:mod:`dumper.hooks.rows`);
    - *what the manifest says*: :meth:`identity` and :meth:`environment`.

    ``model`` is the module hooked; ``handle`` the object the user passed when it is not that
    module (an engine handle that :meth:`resolve` turned into its model), else ``None``.
    """

    name: ClassVar[str] = "base"
    attention_names: ClassVar[tuple[str, ...]] = ("self_attn", "attn", "attention", "self_attention")
    """Attribute names of the attention child of a decoder layer, tried in order (HF and vLLM agree)."""
    mlp_names: ClassVar[tuple[str, ...]] = ("mlp", "block_sparse_moe", "feed_forward", "ffn")
    """Attribute names of the MLP (or MoE block) child of a decoder layer, tried in order (the ``mlp_*`` points)."""
    norm_names: ClassVar[tuple[str, ...]] = ("norm", "final_layernorm", "ln_f", "final_norm")
    """Attribute names of the final norm beside the decoder layer list, tried in order (the ``residual`` point)."""
    residual: ClassVar[bool] = False
    """Whether :meth:`residual_input` says where a decoder layer's residual stream is (the ``residual`` point)."""
    hidden_kwarg: ClassVar[str] = "hidden_states"
    """The keyword a hooked module takes its hidden states by (else its first positional argument)."""

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
        """The hidden-state input of a hooked attention module call (:attr:`hidden_kwarg`, else ``args[0]``)."""
        return kwargs.get(self.hidden_kwarg, args[0] if args else None)

    def residual_input(self, args: tuple, kwargs: dict) -> Any:
        """The residual stream entering a hooked decoder layer (or the final norm), before its norm.

        Only called when :attr:`residual` is true; the default reads :attr:`hidden_kwarg` or the
        first positional argument, as transformers' decoder layers take it.
        """
        return kwargs.get(self.hidden_kwarg, args[0] if args else None)

    def point_value(self, point: str, args: tuple, kwargs: dict, output: Any = None) -> Any:
        """What ``point`` records of a hooked call: :meth:`hidden_input`, :meth:`residual_input`, the MLP's input
        (``mlp_input``: :attr:`hidden_kwarg`, ``x`` or the first positional argument) or the module's output
        (``attn_output``, ``mlp_output``: the first item of a tuple, as transformers' attention returns one)."""
        if point in OUTPUT_POINTS:
            return output[0] if isinstance(output, tuple) and output else output
        if point == MLP_INPUT:
            return kwargs.get(self.hidden_kwarg, kwargs.get("x", args[0] if args else None))
        return self.residual_input(args, kwargs) if point == RESIDUAL else self.hidden_input(args, kwargs)

    def router_hooks(self, layer: nn.Module, index: int) -> list[RouterHook]:
        """The MoE routers of decoder layer ``index`` (``layer``) to hook for the ``router`` point (``[]``: dense).

        The default knows no router: the family cannot capture the point.
        """
        raise UsageError(
            f"capture point 'router': the {self.name} model family does not say where a layer's MoE router is"
        )

    def pass_rows(self, args: tuple, kwargs: dict) -> PassRows | None:
        """Row metadata of a top-level forward pass from its inputs (``None``: rows stay unlabelled)."""
        return None

    def cache_reader(self, targets: Sequence[Any]) -> Any:
        """What reads the KV cache of ``targets`` (the ``k_cache`` / ``v_cache`` points) after each pass
        (:class:`dumper.hooks.kv_cache.CacheReader`); the default family cannot."""
        raise UsageError(
            f"capture points 'k_cache'/'v_cache': the {self.name} model family does not say where its KV cache is"
        )

    def module_rows(self, rows: PassRows | None, kwargs: dict) -> PassRows | None:
        """``rows`` refined by what a hooked module's call says (default: unchanged)."""
        return rows

    def end_pass(self, rows: PassRows | None) -> None:
        """A top-level forward pass with these rows ended."""

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        """Sequence id of each batch row for the following passes (``None``: number them anew)."""
        raise UsageError(f"set_sequence_ids: the {self.name} family takes sequence ids from the engine's batch")

    def set_position_end(self, end: int | None) -> None:
        """Record no row at a position ``>= end`` in the following passes (``None``: every row), e.g. the drafts a
        speculative verify pass feeds past the tokens asked for."""
        raise UsageError(f"set_position_end: the {self.name} family records every row of the engine's batch")

    def shared_rows(self) -> list[SharedRows]:
        """Rows that sequences reused from others instead of computing them (filled in at the end)."""
        return []

    def compiled_reason(self) -> str | None:
        """What compiles this model so that module hooks do not run in it (``None``: hooks run)."""
        return None

    def tap_hint(self) -> str:
        """How a user installs the tap (:mod:`dumper.hooks.tap`) on a model of this family before it compiles."""
        return "dumper.tap(model, layers=..., max_tokens=...) before torch.compile"

    def identity(self, name: str | None) -> dict[str, Any]:
        """The manifest's model identity."""
        return model_identity(self.model, name)

    def environment(self) -> dict[str, Any]:
        """Facts beyond :func:`dumper.hooks.fingerprint.environment_fingerprint` (engine, backend) for the manifest."""
        return {}


_REGISTRY: list[type[FamilyAdapter]] = []
_LAZY: list[tuple[str, str]] = [("vllm.", "dumper.engines.vllm.hooks")]
"""(module prefix of a model class, module that registers its family): no engine is imported until needed."""


def register(family: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Add ``family`` to the registry, checked before those registered earlier; usable as a decorator."""
    if family not in _REGISTRY:
        _REGISTRY.insert(0, family)
    return family


def unregister(family: type[FamilyAdapter]) -> None:
    """Remove ``family`` from the registry (no-op when it is not there)."""
    if family in _REGISTRY:
        _REGISTRY.remove(family)


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


class HFFamily(FamilyAdapter):
    """transformers models (the default): one ``[batch, seq]`` call per pass, positions from its kwargs.

    Positions come from the first of :attr:`position_kwargs` given (``position_ids`` /
    ``cache_position``), else from a 2-D :attr:`mask_kwarg` (``cumsum - 1``, right for left
    padding too), else from the length of the KV cache in :attr:`cache_kwargs`; rows whose mask
    is 0 are padding. Sequence ids are those of :meth:`set_sequence_ids`, else a pass whose every
    batch row starts right after that row's last position in the previous pass (a prefill chunk,
    a decode step over one KV cache) continues its sequences, else the pass gets new ids. After
    :meth:`set_position_end` the rows at or past that position are left out (:attr:`HFRows.end`). A
    subclass for model code that names these arguments otherwise changes only the attributes.
    """

    name = "hf"
    residual = True
    ids_kwarg: ClassVar[str] = "input_ids"
    """The top-level call's token ids (``[batch, seq]``; else its first positional argument)."""
    embeds_kwarg: ClassVar[str] = "inputs_embeds"
    """The top-level call's input embeddings (``[batch, seq, hidden]``), read when it gets no token ids."""
    mask_kwarg: ClassVar[str] = "attention_mask"
    """The top-level call's 2-D padding mask (1: a token, 0: padding)."""
    cache_kwargs: ClassVar[tuple[str, ...]] = ("cache", "past_key_values")
    """The top-level call's KV cache, by the first of these keywords given (transformers 5.x, then 4.x)."""
    position_kwargs: ClassVar[tuple[str, ...]] = ("position_ids", "cache_position")
    """The top-level call's positions, from the first of these keywords that holds a tensor."""
    module_position_kwarg: ClassVar[str] = "position_ids"
    """A hooked module's positions keyword (a model may compute positions inside and pass them down)."""

    def __init__(self, model: nn.Module | None, handle: Any = None) -> None:
        super().__init__(model, handle)
        self._explicit: list[int] | None = None
        self._next = 0
        self._prev_ids: np.ndarray | None = None  # [batch] sequence ids of the previous pass
        self._prev_last: np.ndarray | None = None  # [batch] last real position of each row so far
        self._end: int | None = None

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        self._explicit = None if ids is None else [int(i) for i in ids]

    def set_position_end(self, end: int | None) -> None:
        self._end = None if end is None else int(end)

    def router_hooks(self, layer: nn.Module, index: int) -> list[RouterHook]:
        """The known transformers routers in ``layer`` (:mod:`dumper.hooks.routing`); a model with none is refused."""
        found = [RouterHook(module, read) for module, read in find_routers(layer)]
        if not found and self.model is not None and not has_router(self.model):
            raise UsageError(
                f"capture point 'router': {type(self.model).__name__} has no MoE router driftscope "
                f"reads (known: {known_families()})"
            )
        return found

    def pass_rows(self, args: tuple, kwargs: dict) -> HFRows | None:
        ids = kwargs.get(self.ids_kwarg, args[0] if args else None)
        ref = ids if isinstance(ids, torch.Tensor) else kwargs.get(self.embeds_kwarg)
        if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
            return None
        batch, seq = int(ref.shape[0]), int(ref.shape[1])
        mask = kwargs.get(self.mask_kwarg)
        positions = pad = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] >= seq:
            m = mask.detach().to("cpu", torch.int64).numpy()  # [batch, past + seq]
            pad = m[:, -seq:] == 0
            positions = (np.cumsum(m, axis=1) - 1)[:, -seq:]
        if positions is None:
            past = _cache_length(next((kwargs[k] for k in self.cache_kwargs if k in kwargs), None))
            positions = np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq))
        rows = HFRows((batch, seq), Runs([]), Runs([]), pad=pad, end=self._end)
        rows.set_positions(positions)
        given = next((kwargs[k] for k in self.position_kwargs if isinstance(kwargs.get(k), torch.Tensor)), None)
        if given is not None:
            rows = rows.with_position_ids(given)
        rows.set_sequences(self._sequence_ids(rows))
        return rows

    def cache_reader(self, targets: Sequence[Any]) -> Any:
        from dumper.hooks.kv_cache import HFCacheReader

        return HFCacheReader(self.model, targets)

    def _sequence_ids(self, rows: HFRows) -> np.ndarray:
        batch = rows.shape[0]
        if self._explicit is not None and len(self._explicit) == batch:
            return np.asarray(self._explicit, dtype=np.int64)
        first, _, has = rows.bounds()
        prev, last = self._prev_ids, self._prev_last
        if (
            prev is not None
            and last is not None
            and len(prev) == batch
            and has.any()
            and bool(np.all(~has | (first == last + 1)))
        ):
            return prev
        out = np.arange(self._next, self._next + batch, dtype=np.int64)
        self._next += batch
        return out

    def module_rows(self, rows: PassRows | None, kwargs: dict) -> PassRows | None:
        return rows.with_position_ids(kwargs.get(self.module_position_kwarg)) if isinstance(rows, HFRows) else rows

    def end_pass(self, rows: PassRows | None) -> None:
        if not isinstance(rows, HFRows) or rows.row_ids is None:
            return
        _, last, has = rows.bounds()
        before = (
            self._prev_last
            if self._prev_ids is not None and np.array_equal(self._prev_ids, rows.row_ids)
            else np.full(len(last), -1, dtype=np.int64)
        )
        self._prev_ids, self._prev_last = rows.row_ids, np.where(has, last, before)
