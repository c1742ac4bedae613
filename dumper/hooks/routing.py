"""The MoE routers of transformers models, and how the ``router`` point reads their output.

Each MoE block of the families below calls one router module on its flattened ``[tokens, hidden]``
input; a forward hook on that module (reading only, returning ``None``) sees everything the
``router`` point records (:mod:`dumper.format.manifest`): the gate logits over all experts, the
chosen expert ids in the order the selection returned them, and the combine weights exactly as
the experts multiply their outputs by them. transformers 5.x routers (``*TopKRouter``) return the
tuple ``(router_logits, weights, indices)``; the weights are the applied ones in every family read
here (softmax, top-k and renormalisation where the config asks, GPT-OSS's softmax over the top-k
logits, DeepSeek-V3's routed scaling factor). Only DeepSeek-V3's selection scores are computed
from the output, as its router computes them (:func:`_deepseek_v3`).

A router is known by its class (name and ``transformers.models.`` module): a decoder layer without
one (DeepSeek-V3's first ``first_k_dense_replace`` layers, Qwen-MoE's ``mlp_only_layers``) is
dense, and a model without any has no router driftscope reads (:func:`find_routers`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dumper.errors import UsageError
from dumper.format.manifest import (
    ROUTER_CHOICE_POINT,
    ROUTER_IDS,
    ROUTER_LOGITS,
    ROUTER_POINT,
    ROUTER_SCORES,
    ROUTER_WEIGHTS,
    router_name,
)

__all__ = [
    "Reader",
    "ROUTERS",
    "GROUPS",
    "TOPK_GROUP",
    "known_families",
    "find_routers",
    "has_router",
    "router_meta",
    "router_shape",
    "router_records",
    "check_router_hookable",
]

GROUPS = "n_group"
"""Meta of a :data:`ROUTER_SCORES` record: the expert groups of a grouped top-k (DeepSeek-V3)."""
TOPK_GROUP = "topk_group"
"""Meta of a :data:`ROUTER_SCORES` record: how many groups (by their two best scores' sum) a token may use."""

Reader = Callable[[tuple, dict, Any], dict[str, torch.Tensor]]
"""(args, kwargs, output) of a router module's call -> its routing parts (:data:`ROUTER_LOGITS`, ...)."""


def _triple(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> dict[str, torch.Tensor]:
    """``(router_logits, weights, indices)``, the return of every transformers 5.x ``*TopKRouter``."""
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        raise UsageError(
            f"{type(module).__name__} returned {type(output).__name__}, not the (logits, weights, "
            "indices) of the transformers version driftscope reads (5.x)"
        )
    logits, weights, ids = output
    if logits.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != logits.shape[0]:
        raise UsageError(
            f"{type(module).__name__}: router output shapes {list(logits.shape)}, "
            f"{list(weights.shape)}, {list(ids.shape)} are not [tokens, E], [tokens, k], [tokens, k]"
        )
    return {ROUTER_LOGITS: logits, ROUTER_IDS: ids, ROUTER_WEIGHTS: weights}


def _deepseek_v3(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> dict[str, torch.Tensor]:
    """DeepSeek-V3: the triple, plus the scores its grouped top-k ran on: ``sigmoid(logits) + e_score_correction_bias``.

    The router computes its logits in float32 and picks experts by these scores (restricted to the
    ``topk_group`` best groups), so they are not a monotone function of the logits; the weights it
    returns are ``sigmoid(logits)`` of the chosen experts, renormalised, times ``routed_scaling_factor``.
    """
    parts = _triple(module, args, kwargs, output)
    parts[ROUTER_SCORES] = parts[ROUTER_LOGITS].sigmoid() + module.e_score_correction_bias
    return parts


ROUTERS: dict[str, tuple[str, Callable[..., dict[str, torch.Tensor]]]] = {
    "MixtralTopKRouter": ("Mixtral", _triple),
    # Qwen2-MoE's block adds a shared expert gated by sigmoid(shared_expert_gate(x)); it is not
    # routed, so the router point records only the routed experts' choice and weights
    "Qwen2MoeTopKRouter": ("Qwen2-MoE", _triple),
    "Qwen3MoeTopKRouter": ("Qwen3-MoE", _triple),
    "DeepseekV3TopkRouter": ("DeepSeek-V3", _deepseek_v3),
    "OlmoeTopKRouter": ("OLMoE", _triple),
    "GptOssTopKRouter": ("GPT-OSS", _triple),
}
"""Router module class name -> (the family's name, its reader (module, args, kwargs, output) -> parts)."""


def known_families() -> str:
    """The families whose routers driftscope reads, for error messages."""
    return ", ".join(name for name, _ in ROUTERS.values())


def _is_router(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ in ROUTERS and cls.__module__.startswith("transformers.models.")


def find_routers(layer: nn.Module) -> list[tuple[nn.Module, Reader]]:
    """Every known router inside decoder layer ``layer`` and its reader (none: a dense layer)."""
    return [(m, functools.partial(ROUTERS[type(m).__name__][1], m)) for m in layer.modules() if _is_router(m)]


def has_router(model: nn.Module) -> bool:
    """Whether ``model`` holds any router driftscope knows."""
    return any(_is_router(m) for m in model.modules())


def router_meta(module: nn.Module) -> dict[str, int]:
    """What the comparator needs beside the scores to measure a grouped top-k's margin (none: a plain top-k)."""
    groups, keep = getattr(module, "num_group", None), getattr(module, "topk_group", None)
    if type(module).__name__ == "DeepseekV3TopkRouter" and isinstance(groups, int) and isinstance(keep, int):
        return {GROUPS: groups, TOPK_GROUP: keep}
    return {}


def router_shape(module: nn.Module) -> tuple[int, int, torch.dtype]:
    """(experts, top-k, logits dtype) of a known router: what the tap's buffers for it hold.

    The logits are in the router weight's dtype, except DeepSeek-V3's, computed in float32.
    """
    weight = module.weight
    dtype = torch.float32 if type(module).__name__ == "DeepseekV3TopkRouter" else weight.dtype
    return int(weight.shape[0]), int(module.top_k), dtype


def router_records(
    prefix: str,
    parts: dict[str, torch.Tensor],
    row_shape: tuple[int, ...] | None,
    scores_meta: dict[str, int] | None = None,
) -> list[tuple[str, str, torch.Tensor, dict[str, int]]]:
    """(record name, point, tensor, meta) of each routing part of the MoE layer named ``prefix``, as stored.

    Logits keep their dtype, ids become int64, weights and scores float32; a flat ``[N, w]`` part
    whose ``N`` is the pass's row count is viewed as ``[*row_shape, w]`` so that it inherits the
    pass's positions and sequence ids. ``scores_meta`` (:func:`router_meta`) goes with the scores.
    An unknown part name raises :class:`UsageError`.
    """
    cast = {ROUTER_LOGITS: None, ROUTER_IDS: torch.int64, ROUTER_WEIGHTS: torch.float32, ROUTER_SCORES: torch.float32}
    out = []
    for part, tensor in parts.items():
        if part not in cast:
            raise UsageError(f"record_router({prefix!r}): unknown part {part!r}; expected {', '.join(cast)}")
        if not isinstance(tensor, torch.Tensor):
            raise UsageError(f"record_router({prefix!r}): {part} is {type(tensor).__name__}, not a torch.Tensor")
        t = tensor.detach() if cast[part] is None else tensor.detach().to(cast[part])
        if row_shape is not None and t.dim() == 2 and len(row_shape) > 1 and t.shape[0] == math.prod(row_shape):
            t = t.reshape(*row_shape, t.shape[-1])
        out.append(
            (
                router_name(prefix, part),
                ROUTER_POINT if part == ROUTER_LOGITS else ROUTER_CHOICE_POINT,
                t,
                dict(scores_meta or {}) if part == ROUTER_SCORES else {},
            )
        )
    return out


def check_router_hookable(targets: Sequence[Any], *, hooked: bool, compiled: str | None) -> None:
    """Refuse hooking routers (``targets`` of point ``router``) in a model that runs compiled without a tap.

    Module hooks do not run in compiled code; the tap, installed before compilation with the
    ``router`` point, records them there (:mod:`dumper.hooks.router_tap`). An engine that reads its
    routing itself (``hooked=False``) calls ``Capture.record_router``.
    """
    if not hooked or not compiled or not any(t.point == ROUTER_POINT for t in targets):
        return
    raise UsageError(
        f"capture point {ROUTER_POINT!r}: the model runs compiled ({compiled}), where module hooks do "
        f"not run; tap it with the router point before it compiles (dumper.tap(model, points="
        f'"input,{ROUTER_POINT}"), or python -m dumper run --compile)'
    )
