"""Which modules to hook: layer specs, capture points and decoder-layer discovery.

The names that mark a decoder layer's attention child and the final norm, and where a layer's
MoE router is, are the model family's (:class:`dumper.hooks.families.FamilyAdapter`), passed in
by :func:`hook_targets`. Layer indices are taken from the position of a module in its ``nn.ModuleList`` and stored
as metadata; they are never parsed back out of module names.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from dumper.errors import UsageError
from dumper.format.manifest import ROUTER_POINT
from dumper.format.points import (
    ATTN_OUTPUT,
    CACHE_POINTS,
    INPUT,
    OUTPUT_POINTS,
    RESIDUAL,
    SUBLAYER_POINTS,
    record_name,
)

__all__ = [
    "DEFAULT_LAYERS",
    "HookTarget",
    "parse_layer_spec",
    "find_decoder_layers",
    "find_targets",
    "ATTN_INPUT",
    "ROUTER",
    "POINTS",
    "parse_points",
    "find_residual_targets",
    "find_sublayer_targets",
    "find_router_targets",
    "hook_targets",
    "named_child",
]

DEFAULT_LAYERS = "first,last,every:8"
"""The seed's choice: first and last layer plus every 8th."""

ATTN_INPUT = INPUT
"""Capture point of a hooked module's input hidden states (name suffix ``.input``); the other points are
:mod:`dumper.format.points`' (``residual``, ``attn_output``, ``mlp_input``, ``mlp_output``)."""
ROUTER = ROUTER_POINT
"""Capture point of an MoE layer's routing: ``model.layers.{i}.router.{logits,ids,weights}`` (:mod:`.routing`)."""
POINTS = (ATTN_INPUT, RESIDUAL, *CACHE_POINTS, *SUBLAYER_POINTS, ROUTER)
"""Every capture point the hook API knows, in the order the manifest lists them."""
_INT = re.compile(r"-?[0-9]+")
"""A layer index as written in a spec: ASCII digits, an optional minus (not ``+3``, ``1_0`` or ``３``)."""


@dataclass(frozen=True)
class HookTarget:
    """One module to hook, its canonical name, the layer it belongs to (or ``None``) and the point it records.

    A :data:`ROUTER` target's name is its decoder layer's (the records' prefix), its module the router
    and ``read`` what reads the router's call (:class:`dumper.hooks.families.RouterHook`).
    """

    name: str
    module: nn.Module
    layer: int | None
    point: str = ATTN_INPUT
    read: Callable[[tuple, dict, Any], dict[str, Any]] | None = field(default=None, compare=False)

    @property
    def record(self) -> str:
        """The name its rows are recorded under: the module's name and the point's suffix (``self_attn.output``)."""
        return record_name(self.name, self.point)

    @property
    def output(self) -> bool:
        """Whether the point is read from the module's output (a forward hook), not its input."""
        return self.point in OUTPUT_POINTS


def parse_layer_spec(spec: str | Sequence[int] | None, num_layers: int) -> list[int]:
    """Resolve a layer spec to sorted unique indices in ``[0, num_layers)``.

    Accepts ``all``, ``first``, ``last``, ``every:N`` (0, N, 2N, ...), integers (negative
    counts from the end), ranges ``A..B`` (inclusive, ``A`` at or before ``B`` once negatives
    are resolved: ``-3..-1`` is the last three layers), comma-separated combinations, or a
    sequence of integers. ``None`` means :data:`DEFAULT_LAYERS`. Anything else, an index
    outside the model, or a spec that selects nothing raises :class:`UsageError` naming it.
    """
    if num_layers <= 0:
        raise UsageError("the model has no decoder layers to select from")
    if spec is None:
        spec = DEFAULT_LAYERS
    tokens: list[str | int] = [t.strip() for t in spec.split(",") if t.strip()] if isinstance(spec, str) else list(spec)
    if not tokens:
        raise UsageError(f"empty layer spec {spec!r}")
    out: set[int] = set()
    for tok in tokens:
        out.update(_spec_token(tok, num_layers, spec))
    return sorted(out)


def _spec_token(tok: str | int, num_layers: int, spec: object) -> range | list[int]:
    """The layers one comma-separated part of a spec selects (never none)."""
    where = f"layer spec {spec!r}"

    def index(v: str | int) -> int:
        if isinstance(v, bool) or not isinstance(v, int) and not _INT.fullmatch(v):
            raise UsageError(f"{where}: {tok!r} is not all, first, last, every:N, an integer or A..B")
        i = int(v) + num_layers if int(v) < 0 else int(v)
        if not 0 <= i < num_layers:
            raise UsageError(
                f"{where}: layer {v} is out of range for a model with {num_layers} layers "
                f"(0..{num_layers - 1}, or -{num_layers}..-1 from the end)"
            )
        return i

    if isinstance(tok, int) or _INT.fullmatch(tok):
        return [index(tok)]
    if tok in ("all", "first", "last"):
        return {"all": range(num_layers), "first": [0], "last": [num_layers - 1]}[tok]
    if tok.startswith("every:"):
        n = tok[len("every:") :]
        if not _INT.fullmatch(n) or int(n) <= 0:
            raise UsageError(f"{where}: every:N needs a positive integer N, got {tok!r}")
        return range(0, num_layers, int(n))
    if ".." in tok:
        a, _, b = tok.partition("..")
        lo, hi = index(a), index(b)
        if lo > hi:
            raise UsageError(
                f"{where}: range {tok!r} is empty (layer {lo} comes after layer {hi}); write it as {b}..{a}"
            )
        return range(lo, hi + 1)
    return [index(tok)]  # raises: not a spec


def named_child(layer: nn.Module, names: Sequence[str]) -> tuple[str, nn.Module] | None:
    for attr in names:
        child = getattr(layer, attr, None)
        if isinstance(child, nn.Module):
            return attr, child
    return None


def find_decoder_layers(model: nn.Module, attention_names: Sequence[str]) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of decoder layers: the longest list whose items have an attention child.

    An ``nn.Identity`` item stands for a layer that runs elsewhere (vLLM's ``PPMissingLayer`` on a
    pipeline stage that does not hold it): it keeps its index and is never hooked.

    ``attention_names`` are the child attribute names that count as attention, tried in order
    (the model family's :attr:`~dumper.hooks.families.FamilyAdapter.attention_names`).
    """
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            real = [not isinstance(layer, nn.Identity) for layer in mod]  # Identity: a layer on another stage
            if any(real) and all(
                named_child(layer, attention_names) is not None for layer, here in zip(mod, real, strict=True) if here
            ):
                if best is None or len(mod) > len(best[1]):
                    best = (name, mod)
    if best is None:
        raise UsageError(
            f"cannot find decoder layers in {type(model).__name__}; "
            "pass modules='<pattern>' (e.g. 'model.layers.*.self_attn') to choose what to hook"
        )
    return best


def _layer_of(model: nn.Module, name: str) -> int | None:
    """Index of the nearest ``nn.ModuleList`` item that contains module ``name``."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[: cut - 1])) if cut > 1 else model
        container = getattr(parent, parts[cut - 1], None)
        if isinstance(container, nn.ModuleList):
            item = model.get_submodule(".".join(parts[: cut + 1]))
            for i, child in enumerate(container):
                if child is item:
                    return i
    return None


def _decoder_layer_count(model: nn.Module, attention_names: Sequence[str]) -> int:
    """How many decoder layers the model has (0 when it has no recognizable decoder layer list)."""
    try:
        return len(find_decoder_layers(model, attention_names)[1])
    except UsageError:
        return 0


def find_targets(
    model: nn.Module,
    *,
    layers: str | Sequence[int] | None = None,
    modules: str | None = None,
    attention_names: Sequence[str],
) -> tuple[list[HookTarget], int]:
    """The self-attention modules to hook and the model's number of decoder layers.

    With ``modules`` (an fnmatch pattern over ``named_modules()`` names, comma-separated for
    several) every matching module is hooked, filtered by ``layers`` when it lies in a layer.
    ``attention_names`` (the model family's, see :mod:`dumper.hooks.families`) find the attention child.
    """
    if modules:
        patterns = [p.strip() for p in modules.split(",") if p.strip()]
        matched = [(n, m) for n, m in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not matched:
            raise UsageError(f"module pattern {modules!r} matches no module of {type(model).__name__}")
        found = [HookTarget(n, m, _layer_of(model, n)) for n, m in matched]
        layer_ids = [t.layer for t in found if t.layer is not None]
        num_layers = max(_decoder_layer_count(model, attention_names), max(layer_ids) + 1 if layer_ids else 0)
        if layers is None or not layer_ids:
            return found, num_layers
        keep = set(parse_layer_spec(layers, num_layers))
        kept = [t for t in found if t.layer is None or t.layer in keep]
        if not kept:
            raise UsageError(
                f"module pattern {modules!r} matches modules only in layers "
                f"{sorted({t.layer for t in found})}, none of layer spec {layers!r} {sorted(keep)}"
            )
        return kept, num_layers
    list_name, layer_list = find_decoder_layers(model, attention_names)
    keep = parse_layer_spec(layers, len(layer_list))
    targets = []
    for i in (i for i in keep if not isinstance(layer_list[i], nn.Identity)):  # this pipeline stage's layers
        attr, child = named_child(layer_list[i], attention_names)  # type: ignore[misc]
        prefix = f"{list_name}.{i}" if list_name else str(i)
        targets.append(HookTarget(f"{prefix}.{attr}", child, i))
    return targets, len(layer_list)


def parse_points(points: str | Sequence[str] | None) -> tuple[str, ...]:
    """Capture points as a tuple in :data:`POINTS` order: ``"input,residual"``, a sequence, or ``None`` (input only).

    An unknown or empty selection raises :class:`UsageError` naming it and the known points.
    """
    if points is None:
        return (ATTN_INPUT,)
    names = [p.strip() for p in points.split(",")] if isinstance(points, str) else list(points)
    bad = [p for p in names if p not in POINTS]
    if bad or not names:
        raise UsageError(
            f"capture points {points!r}: {'unknown ' + repr(bad[0]) if bad else 'none given'}; "
            f"choose from {', '.join(POINTS)} (comma-separated)"
        )
    return tuple(p for p in POINTS if p in names)


def find_residual_targets(
    model: nn.Module,
    *,
    layers: str | Sequence[int] | None = None,
    attention_names: Sequence[str],
    norm_names: Sequence[str],
) -> tuple[list[HookTarget], int]:
    """The decoder layers whose residual input to record, and the model's number of decoder layers.

    One target per selected layer (``model.layers.{i}``, layer ``i``), plus, when the last
    layer is selected, the final norm (the list's sibling named one of ``norm_names``, layer
    ``num_layers``): its input is the residual stream after the last layer, the counterpart
    of that layer's output. A model without such a norm gets no final target.
    """
    list_name, layer_list = find_decoder_layers(model, attention_names)
    keep = parse_layer_spec(layers, len(layer_list))
    prefix = f"{list_name}." if list_name else ""
    targets = [HookTarget(f"{prefix}{i}", layer_list[i], i, RESIDUAL) for i in keep]
    if keep[-1] == len(layer_list) - 1:
        parent_name = list_name.rpartition(".")[0]
        parent = model.get_submodule(parent_name)
        for attr in norm_names:
            norm = getattr(parent, attr, None)
            if isinstance(norm, nn.Module):
                name = f"{parent_name}.{attr}" if parent_name else attr
                targets.append(HookTarget(name, norm, len(layer_list), RESIDUAL))
                break
    return targets, len(layer_list)


def find_sublayer_targets(
    model: nn.Module, family: _Family, point: str, *, layers: str | Sequence[int] | None = None
) -> tuple[list[HookTarget], int]:
    """The modules of the selected decoder layers that ``point`` (one of :data:`SUBLAYER_POINTS` or the cache points)
    reads: the attention child (``attn_output``, ``k_cache``, ``v_cache``) or the MLP child, dense or MoE
    (``mlp_input``, ``mlp_output``), named by ``family.attention_names`` and ``family.mlp_names``.
    A layer without such a child is refused, naming it."""
    list_name, layer_list = find_decoder_layers(model, family.attention_names)
    names = family.attention_names if point == ATTN_OUTPUT or point in CACHE_POINTS else family.mlp_names
    prefix = f"{list_name}." if list_name else ""
    targets = []
    for i in (i for i in parse_layer_spec(layers, len(layer_list)) if not isinstance(layer_list[i], nn.Identity)):
        child = named_child(layer_list[i], names)
        if child is None:
            raise UsageError(
                f"capture point {point!r}: layer {i} of {type(model).__name__} has none of the children "
                f"{', '.join(names)} ({family.name} model family); drop the point"
            )
        targets.append(HookTarget(f"{prefix}{i}.{child[0]}", child[1], i, point))
    return targets, len(layer_list)


def find_router_targets(
    model: nn.Module, family: _Family, *, layers: str | Sequence[int] | None = None
) -> tuple[list[HookTarget], int]:
    """The MoE routers of the selected decoder layers (``family.router_hooks``), and the model's number of layers.

    One target per router, named as its layer (``model.layers.{i}``); dense layers have none. A
    selection without any MoE layer raises :class:`UsageError` naming the model and the layers.
    """
    list_name, layer_list = find_decoder_layers(model, family.attention_names)
    keep = parse_layer_spec(layers, len(layer_list))
    prefix = f"{list_name}." if list_name else ""
    targets = [
        HookTarget(f"{prefix}{i}", hook.module, i, ROUTER, hook.read)
        for i in keep
        if not isinstance(layer_list[i], nn.Identity)
        for hook in family.router_hooks(layer_list[i], i)
    ]
    if not targets:
        shown = f"{keep[0]}..{keep[-1]}" if keep == list(range(keep[0], keep[-1] + 1)) and len(keep) > 2 else keep
        raise UsageError(
            f"capture point {ROUTER!r}: {type(model).__name__} has no MoE layer among layers {shown}; "
            "select layers with a router, or drop the point"
        )
    return targets, len(layer_list)


class _Family(Protocol):
    """What :func:`hook_targets` reads of a family adapter (:class:`dumper.hooks.families.FamilyAdapter`)."""

    name: str
    attention_names: tuple[str, ...]
    mlp_names: tuple[str, ...]
    norm_names: tuple[str, ...]
    residual: bool

    def router_hooks(self, layer: nn.Module, index: int) -> Sequence[Any]: ...


def hook_targets(
    model: nn.Module,
    family: _Family,
    *,
    layers: str | Sequence[int] | None = None,
    modules: str | None = None,
    points: str | Sequence[str] | None = None,
) -> tuple[list[HookTarget], int]:
    """Every module :class:`dumper.hooks.capture.Capture` hooks for ``points`` (:func:`parse_points`), and the layer
    count.

    ``input`` hooks :func:`find_targets` (``modules`` chooses them); ``residual`` hooks
    :func:`find_residual_targets`, for a family that says where the residual stream is; ``attn_output``,
    ``mlp_input`` and ``mlp_output`` hook :func:`find_sublayer_targets`, whose attention children ``k_cache`` and
    ``v_cache`` name without a hook (:mod:`dumper.hooks.kv_cache` reads them); ``router`` hooks
    :func:`find_router_targets`, the MoE routers of the selected layers.
    """
    chosen = parse_points(points)
    targets: list[HookTarget] = []
    num_layers = 0
    if ATTN_INPUT in chosen:
        targets, num_layers = find_targets(
            model, layers=layers, modules=modules, attention_names=family.attention_names
        )
    elif modules:
        raise UsageError(
            f"modules {modules!r} choose what the {ATTN_INPUT!r} point hooks; add {ATTN_INPUT!r} "
            "to the capture points or drop modules"
        )
    if RESIDUAL in chosen:
        if not family.residual:
            raise UsageError(
                f"capture point {RESIDUAL!r}: the {family.name} model family does not say where a "
                f"decoder layer's residual stream is; capture the {ATTN_INPUT!r} point instead"
            )
        found, num_layers = find_residual_targets(
            model, layers=layers, attention_names=family.attention_names, norm_names=family.norm_names
        )
        targets += found
    for point in (p for p in (*CACHE_POINTS, *SUBLAYER_POINTS) if p in chosen):
        found, num_layers = find_sublayer_targets(model, family, point, layers=layers)
        targets += found
    if ROUTER in chosen:
        found, num_layers = find_router_targets(model, family, layers=layers)
        targets += found
    return targets, num_layers
