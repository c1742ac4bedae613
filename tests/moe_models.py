"""Tiny random-weight MoE causal LMs of every family the router point reads, built from a config (no downloads).

``build_moe(family)`` gives a seeded model in eval mode: 2-4 decoder layers, hidden 64, 4-8 experts,
top-2, vocab 256. Every family gets a router whose choice is not trivial: routers that transformers
initializes to zero are re-drawn, and DeepSeek-V3's ``e_score_correction_bias`` is drawn too, so its
selection scores are not a monotone function of its logits. Shared by the hook, engine and comparator tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "MOE_CONFIGS", "build_moe", "moved_gate_checkpoints"]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss")
"""Every family :func:`build_moe` builds (a transformers ``model_type`` each)."""

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_experts_per_tok": 2,
}

MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_hidden_layers": 3, "intermediate_size": 96, "head_dim": 16, "num_local_experts": 8},
    # layer 1 dense (mlp_only_layers): the router point skips it
    "qwen2_moe": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "head_dim": 16,
        "num_experts": 6,
        "norm_topk_prob": True,
    },
    # layer 0 dense (first_k_dense_replace); 8 experts in 4 groups, 2 groups kept
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
    "olmoe": {"num_hidden_layers": 2, "intermediate_size": 48, "num_experts": 4, "norm_topk_prob": False},
    "gpt_oss": {
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "head_dim": 16,
        "num_local_experts": 4,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
    },  # its default YaRN factor 32 over 4096 positions
}
"""Each family's config beyond :data:`_COMMON` (``build_moe``'s overrides go on top)."""


def _redraw_routers(model: nn.Module, gen: torch.Generator) -> None:
    """Router weights (and biases) transformers leaves at zero drawn from N(0, 0.2); DeepSeek's bias drawn too."""
    for module in model.modules():
        if not type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
            continue
        with torch.no_grad():
            for name in ("weight", "bias", "e_score_correction_bias"):
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor):
                    scale = 0.05 if name == "e_score_correction_bias" else 0.2
                    t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * scale)


def build_moe(
    family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, attn: str = "eager", **overrides: Any
) -> nn.Module:
    """A tiny seeded ``<Family>ForCausalLM`` of ``family`` (one of :data:`FAMILIES`) in eval mode.

    ``overrides`` replace config fields (``num_hidden_layers=4``); the weights depend only on the
    seed, the family and the config (drawn in float32, then cast to ``dtype``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in MOE_CONFIGS:
        raise ValueError(f"unknown MoE family {family!r}; choose from {', '.join(FAMILIES)}")
    config = AutoConfig.for_model(family, **{**_COMMON, **MOE_CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    _redraw_routers(model, torch.Generator().manual_seed(seed + 1))
    return model.to(dtype).eval()


def moved_gate_checkpoints(root: Any) -> tuple[Any, Any]:
    """The tiny Mixtral saved as ``root/ref``, and as ``root/bug`` with its layer-1 gate row of expert 6 moved by
    half its norm (a gate that computes otherwise; its experts and attention untouched): the replay tests' pair."""
    model = build_moe("mixtral")
    model.save_pretrained(root / "ref")
    with torch.no_grad():
        gate = model.model.layers[1].mlp.gate.weight  # [experts, hidden]
        noise = torch.randn(gate.shape[1], generator=torch.Generator().manual_seed(5))
        gate[6] += 0.5 * gate[6].norm() * noise / gate.shape[1] ** 0.5
    model.save_pretrained(root / "bug")
    return root / "ref", root / "bug"
