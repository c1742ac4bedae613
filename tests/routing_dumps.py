"""Tiny HF Mixtral dumps with the router point, for routing comparison tests: benign pairs and seeded routing bugs.

The bugs live inside the model's own router (``MixtralTopKRouter.forward`` of one layer), written
without data-dependent Python branches so torch.compile would trace them:

- ``bias``: adds ``+bias`` to expert ``expert``'s logit of token ``token`` only, moving that one
  token to another expert (a flip far from any tie);
- ``order``: top-k over the softmax's probabilities without renormalising them, on a model
  whose reference renormalises: the same experts, other combine weights (an equal-ids weight bug).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import dumper

__all__ = ["mixtral", "prompt_ids", "router_dump", "seed_router_bug", "choose_flip_token"]

_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def mixtral(*, seed: int = 0, dtype: torch.dtype = torch.float32, attn: str = "eager") -> nn.Module:
    """The tiny Mixtral (3 layers, 8 experts, top-2, renormalised), seeded, eval mode."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_CONFIG)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).to(dtype).eval()


def prompt_ids(batch: int = 2, seq: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, _CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _seed_bias(router: nn.Module, token: int, expert: int, bias: float) -> None:
    """Replace one router's forward with the reference plus a logit bias at (flat row ``token``, ``expert``)."""

    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = nn.functional.linear(hidden_states, router.weight)
        bump = torch.zeros_like(logits)
        bump[token, expert] = bias
        logits = logits + bump
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    router.forward = forward


def _seed_order(router: nn.Module) -> None:
    """Replace one router's forward with top-k of the softmax, not renormalised (the reference renormalises)."""

    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = nn.functional.linear(hidden_states, router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        return logits, top.to(logits.dtype), idx

    router.forward = forward


def seed_router_bug(router: nn.Module, bug: str, *, token: int = 30, expert: int = 0, bias: float = 5.0) -> None:
    """Seed ``bug`` (``"bias"``: +``bias`` on ``expert``'s logit of flat row ``token``; ``"order"``: weights not
    renormalised) into one ``MixtralTopKRouter``."""
    if bug == "bias":
        _seed_bias(router, token, expert, bias)
    elif bug == "order":
        _seed_order(router)
    else:
        raise ValueError(f"unknown bug {bug!r}")


def router_dump(
    out: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    attn: str = "eager",
    bug: str | None = None,
    layer: int = 1,
    token: int = 30,
    expert: int = 0,
    bias: float = 5.0,
    batch: int = 2,
    seq: int = 40,
) -> Path:
    """Capture input and router points of every layer of the tiny Mixtral into ``out``.

    ``bug``: None, ``"bias"`` (flat row ``token`` of the batch, ``expert``, ``+bias``, in ``layer``)
    or ``"order"`` (``layer``'s weights not renormalised).
    """
    model = mixtral(dtype=dtype, attn=attn)
    if bug is not None:
        seed_router_bug(model.model.layers[layer].mlp.gate, bug, token=token, expert=expert, bias=bias)
    with torch.no_grad(), dumper.capture(model, out, layers="all", points=("input", "router")):
        model(prompt_ids(batch, seq))
    return Path(out)


def choose_flip_token(layer: int = 1, *, batch: int = 2, seq: int = 40) -> tuple[int, int, float]:
    """(flat row, expert, bias) that moves that row of ``layer`` to an unchosen expert by a wide margin.

    Picks the row whose margin (2nd-chosen minus best unchosen logit) is the median one, and the
    bias that lifts its best unchosen expert 1.0 above its best chosen: a flip far from a tie.
    """
    model = mixtral()
    seen = {}

    def hook(module, args, output):
        seen["logits"] = output[0].detach()

    h = model.model.layers[layer].mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        model(prompt_ids(batch, seq))
    h.remove()
    logits = seen["logits"]
    order = torch.argsort(logits, dim=-1, descending=True)
    margin = logits.gather(1, order[:, 1:2]) - logits.gather(1, order[:, 2:3])
    row = int(torch.argsort(margin.squeeze(1))[margin.shape[0] // 2])
    expert = int(order[row, 2])
    bias = float(logits[row, order[row, 0]] - logits[row, expert]) + 1.0
    return row, expert, bias
