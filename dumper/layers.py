"""Which modules to hook: layer specs and decoder-layer discovery in HF causal LMs.

Layer indices are taken from the position of a module in its ``nn.ModuleList`` and stored
as metadata; they are never parsed back out of module names.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .errors import UsageError

__all__ = ["DEFAULT_LAYERS", "HookTarget", "parse_layer_spec", "find_decoder_layers", "find_targets"]

DEFAULT_LAYERS = "first,last,every:8"
"""The seed's choice: first and last layer plus every 8th."""

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")


@dataclass(frozen=True)
class HookTarget:
    """One module to hook, its canonical name and the layer it belongs to (or ``None``)."""

    name: str
    module: nn.Module
    layer: int | None


def parse_layer_spec(spec: str | Sequence[int] | None, num_layers: int) -> list[int]:
    """Resolve a layer spec to sorted unique indices in ``[0, num_layers)``.

    Accepts ``all``, ``first``, ``last``, ``every:N`` (0, N, 2N, ...), integers (negative
    counts from the end), ranges ``A..B`` (inclusive), comma-separated combinations, or a
    sequence of integers. ``None`` means :data:`DEFAULT_LAYERS`.
    """
    if num_layers <= 0:
        raise UsageError("the model has no decoder layers to select from")
    if spec is None:
        spec = DEFAULT_LAYERS
    tokens: list[str | int] = (
        [t.strip() for t in spec.split(",") if t.strip()] if isinstance(spec, str) else list(spec)
    )
    if not tokens:
        raise UsageError("empty layer spec")
    out: set[int] = set()

    def index(v: int, token: object) -> int:
        i = v + num_layers if v < 0 else v
        if not 0 <= i < num_layers:
            raise UsageError(f"layer {token} is out of range for a model with {num_layers} layers")
        return i

    for tok in tokens:
        if isinstance(tok, int):
            out.add(index(tok, tok))
        elif tok == "all":
            out.update(range(num_layers))
        elif tok == "first":
            out.add(0)
        elif tok == "last":
            out.add(num_layers - 1)
        elif tok.startswith("every:"):
            try:
                n = int(tok[len("every:"):])
            except ValueError:
                n = 0
            if n <= 0:
                raise UsageError(f"bad layer spec {tok!r}: every:N needs a positive integer N")
            out.update(range(0, num_layers, n))
        elif ".." in tok:
            a, _, b = tok.partition("..")
            try:
                lo, hi = index(int(a), tok), index(int(b), tok)
            except ValueError:
                raise UsageError(f"bad layer range {tok!r}: expected A..B with integers") from None
            out.update(range(lo, hi + 1))
        else:
            try:
                out.add(index(int(tok), tok))
            except ValueError:
                raise UsageError(
                    f"bad layer spec {tok!r}: use all, first, last, every:N, an integer or A..B"
                ) from None
    return sorted(out)


def _attention_child(layer: nn.Module) -> tuple[str, nn.Module] | None:
    for attr in _ATTN_NAMES:
        child = getattr(layer, attr, None)
        if isinstance(child, nn.Module):
            return attr, child
    return None


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of decoder layers: the longest list whose items have an attention child."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            if all(_attention_child(layer) is not None for layer in mod):
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
            item = model.get_submodule(".".join(parts[:cut + 1]))
            for i, child in enumerate(container):
                if child is item:
                    return i
    return None


def find_targets(model: nn.Module, *, layers: str | Sequence[int] | None = None,
                 modules: str | None = None) -> tuple[list[HookTarget], int]:
    """The self-attention modules to hook and the model's number of decoder layers.

    With ``modules`` (an fnmatch pattern over ``named_modules()`` names, comma-separated for
    several) every matching module is hooked, filtered by ``layers`` when it lies in a layer.
    """
    if modules:
        patterns = [p.strip() for p in modules.split(",") if p.strip()]
        matched = [(n, m) for n, m in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not matched:
            raise UsageError(f"module pattern {modules!r} matches no module of {type(model).__name__}")
        found = [HookTarget(n, m, _layer_of(model, n)) for n, m in matched]
        layer_ids = [t.layer for t in found if t.layer is not None]
        num_layers = max(layer_ids) + 1 if layer_ids else 0
        if layers is None or num_layers == 0:
            return found, num_layers
        keep = set(parse_layer_spec(layers, num_layers))
        return [t for t in found if t.layer is None or t.layer in keep], num_layers
    list_name, layer_list = find_decoder_layers(model)
    keep = parse_layer_spec(layers, len(layer_list))
    targets = []
    for i in keep:
        attr, child = _attention_child(layer_list[i])  # type: ignore[misc]
        prefix = f"{list_name}.{i}" if list_name else str(i)
        targets.append(HookTarget(f"{prefix}.{attr}", child, i))
    return targets, len(layer_list)
