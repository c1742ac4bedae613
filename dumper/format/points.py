"""The capture points of a decoder layer: their names, the record name each writes, and their order in the layer.

A point is where in a decoder layer hidden states are recorded. Data flows through a layer in
this order (:data:`ORDER`), which is how the comparator tells which point diverged first:

==============  =========================================  ==============================
point           what                                       record name (layer ``i``)
==============  =========================================  ==============================
``residual``    the residual stream entering the layer     ``model.layers.i.residual``
``input``       the attention input (after the input norm)  ``model.layers.i.self_attn.input``
``k_cache``     the key row the layer stored in its KV     ``model.layers.i.self_attn.k_cache``
                cache for the token (after RoPE;
                dequantized when the cache is fp8)
``v_cache``     the value row it stored                    ``model.layers.i.self_attn.v_cache``
``attn_output`` what attention adds (before the residual    ``model.layers.i.self_attn.output``
                add; after a tensor-parallel all-reduce)
``mlp_input``   the MLP input (after the post-attention     ``model.layers.i.mlp.input``
                norm)
``router``      an MoE layer's routing (its own records)    ``model.layers.i.router.*``
``mlp_output``  what the MLP or MoE block adds (before the  ``model.layers.i.mlp.output``
                residual add)
==============  =========================================  ==============================

The next layer's ``residual`` follows ``mlp_output``. A point's record name is its module's name
and :data:`RECORD_SUFFIX` (the module names are the model's: ``block_sparse_moe`` for Mixtral's MoE).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "INPUT",
    "RESIDUAL",
    "ATTN_OUTPUT",
    "MLP_INPUT",
    "MLP_OUTPUT",
    "ROUTER",
    "K_CACHE",
    "V_CACHE",
    "CACHE_POINTS",
    "FP8_CACHE_DTYPES",
    "SUBLAYER_POINTS",
    "OUTPUT_POINTS",
    "RECORD_SUFFIX",
    "ORDER",
    "order_in_layer",
    "record_name",
]

INPUT: Final = "input"
RESIDUAL: Final = "residual"
ATTN_OUTPUT: Final = "attn_output"
MLP_INPUT: Final = "mlp_input"
MLP_OUTPUT: Final = "mlp_output"
K_CACHE: Final = "k_cache"
V_CACHE: Final = "v_cache"
CACHE_POINTS: Final = (K_CACHE, V_CACHE)
"""The KV cache points (:mod:`dumper.hooks.kv_cache`): read from the engine's cache after the pass, never hooked."""
FP8_CACHE_DTYPES: Final = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""An engine's fp8 KV-cache dtype names (vLLM's ``kv_cache_dtype``) and the torch dtype, by name, its bytes hold."""
ROUTER: Final = "router"
"""An MoE layer's routing (``dumper.format.manifest.ROUTER_POINT``, with the records it names)."""
SUBLAYER_POINTS: Final = (ATTN_OUTPUT, MLP_INPUT, MLP_OUTPUT)
"""The points inside a layer past its attention input (issue 34): which kernel, attention or MLP."""
OUTPUT_POINTS: Final = frozenset({ATTN_OUTPUT, MLP_OUTPUT})
"""Points read from a module's output (a forward hook) rather than its input."""
RECORD_SUFFIX: Final[dict[str, str]] = {
    INPUT: "input",
    RESIDUAL: "residual",
    ATTN_OUTPUT: "output",
    MLP_INPUT: "input",
    MLP_OUTPUT: "output",
    K_CACHE: "k_cache",
    V_CACHE: "v_cache",
}
"""What follows the module's name in a point's record name."""
ORDER: Final = (RESIDUAL, INPUT, K_CACHE, V_CACHE, ATTN_OUTPUT, MLP_INPUT, ROUTER, MLP_OUTPUT)
"""The points in the order data flows through one decoder layer."""


def order_in_layer(point: str | None) -> int:
    """Where ``point`` sits in :data:`ORDER`; a point it does not know (None, a custom module's) as ``input``."""
    return ORDER.index(point) if point in ORDER else ORDER.index(INPUT)


def record_name(module: str, point: str) -> str:
    """The record name of ``point`` read at the module named ``module``: ``model.layers.2.mlp`` + ``mlp_output`` is
    ``model.layers.2.mlp.output`` (:data:`RECORD_SUFFIX`; a point it does not know is its own suffix)."""
    return f"{module}.{RECORD_SUFFIX.get(point, point)}"
