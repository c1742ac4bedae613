"""The combine weights each family's MoE router gives a chosen set of experts, the choice made elsewhere.

A transformers 5.x router (:mod:`dumper.hooks.routing`) returns ``(logits, weights, ids)``: it picks
``ids`` and then weights them. The functions here are that second half, copied from each
family's router so that, applied to the router's own logits and ids, they give its own weights
bit for bit and in its dtype (``tests/dumper/hooks/test_router_weights.py`` checks this for every
family, float32 and bfloat16). Given other ids (a baseline's choice forced by ``dumper replay
--force-routing ids``, :mod:`dumper.jobs.replay_routing`), they give what the same router math
makes of those experts.

Example::

    from dumper.hooks.router_weights import combine_weights
    logits, weights, ids = model.model.layers[1].mlp.gate(hidden)  # [tokens, E], [tokens, k], [tokens, k]
    assert torch.equal(combine_weights(model.model.layers[1].mlp.gate, logits, ids), weights)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dumper.errors import UsageError

__all__ = ["WEIGHTS", "combine_weights"]


def _softmax_renorm(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax over all experts in float32, gathered at ``ids``, renormalised; returned in float32."""
    top = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    return top / top.sum(dim=-1, keepdim=True)


def _softmax_norm_topk(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE, Qwen3-MoE, OLMoE: softmax in float32, gathered, renormalised if ``norm_topk_prob``, cast back
    to the logits' dtype."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if module.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _softmax_of_chosen(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits only, in the logits' dtype."""
    top = logits.gather(1, ids)
    return torch.softmax(top, dim=1, dtype=top.dtype)


def _sigmoid_scaled(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: ``sigmoid(logits)`` gathered (not the bias-corrected selection scores), renormalised if
    ``norm_topk_prob`` (``+1e-20``), times ``routed_scaling_factor``."""
    top = logits.sigmoid().gather(1, ids)
    if module.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * module.routed_scaling_factor


WEIGHTS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "MixtralTopKRouter": _softmax_renorm,
    "Qwen2MoeTopKRouter": _softmax_norm_topk,
    "Qwen3MoeTopKRouter": _softmax_norm_topk,
    "DeepseekV3TopkRouter": _sigmoid_scaled,
    "OlmoeTopKRouter": _softmax_norm_topk,
    "GptOssTopKRouter": _softmax_of_chosen,
}
"""Router module class name -> (module, logits [tokens, E], ids [tokens, k]) -> the combine weights [tokens, k]
that router gives experts ``ids``: its own weight computation, with the selection step left out."""


def combine_weights(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The combine weights router ``module`` would apply had it chosen ``ids`` [tokens, k] from ``logits``.

    For the router's own ids this is its own weights output, bit for bit and in its dtype; for
    other ids it is what that router's math gives those experts. A router class without an entry
    in :data:`WEIGHTS` raises :class:`UsageError`.
    """
    weigh = WEIGHTS.get(type(module).__name__)
    if weigh is None:
        raise UsageError(
            f"{type(module).__name__}: driftscope does not know how this router weights its experts "
            f"(known: {', '.join(sorted(WEIGHTS))})"
        )
    return weigh(module, logits, ids)
