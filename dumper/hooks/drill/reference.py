"""The float64 reference of one dispatched op: the op again on its own inputs upcast, or a registered reference.

An aten op has float64 kernels, so its reference is the op itself on float64 copies of its floating
inputs (a ``dtype=`` argument naming a float dtype becomes float64). An engine's custom op (vLLM's
``_C.silu_and_mul``, ``_C.rotary_embedding``, its oneDNN GEMM, its attention) usually has no float64
kernel, and some take state the op's arguments do not show (a prepacked weight, the paged KV cache):
their references are written here from the op's documented math and registered by the op's schema
name. :func:`register_reference` adds one for an op of your own.

A reference returns, for each judged output of the op (the arguments it writes, in schema order, then
what it returns), the float64 value, the magnitude the rounding model scales its accumulation by
(None: ``|ref|``) and the reduction length ``K`` (:mod:`dumper.hooks.drill.rounding`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "Reference",
    "OpCall",
    "register_reference",
    "reference_for",
    "written_args",
    "upcast",
    "REFERENCES",
]


@dataclass
class OpCall:
    """One op call as the reference sees it: its inputs before the call (written arguments as they were) and the
    module it ran under (``module``: where a reference finds state the op's arguments do not carry)."""

    func: Any
    args: tuple
    kwargs: dict
    module: torch.nn.Module | None = None
    state: dict[str, Any] = field(default_factory=dict)
    """What the engine's drill adapter knows that the op does not show (``weights``: handle -> weight, ...)."""


@dataclass(frozen=True)
class Reference:
    """A float64 reference: ``fn(call) -> (values, mags, size)`` (see the module docstring), named in the log."""

    name: str
    fn: Callable[[OpCall], tuple[list[torch.Tensor], list[torch.Tensor | None], int]]


REFERENCES: dict[str, Reference] = {}
"""Registered references by op schema name (``_C::silu_and_mul``)."""


def register_reference(
    schema_name: str,
    fn: Callable[[OpCall], tuple[list[torch.Tensor], list[torch.Tensor | None], int]],
    *,
    name: str | None = None,
) -> None:
    """Use ``fn`` as the float64 reference of the op named ``schema_name`` (``namespace::op``)."""
    REFERENCES[schema_name] = Reference(name or schema_name, fn)


def written_args(func: Any) -> list[tuple[int, str]]:
    """(position, name) of each argument the op writes, in schema order."""
    return [
        (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    ]


def arg(call_args: tuple, call_kwargs: dict, func: Any, i: int, name: str) -> Any:
    """Argument ``i`` (``name``) of a call, positional or keyword; None when absent."""
    if i < len(call_args):
        return call_args[i]
    if name in call_kwargs:
        return call_kwargs[name]
    return func._schema.arguments[i].default_value


def upcast(x: Any) -> Any:
    """Floating tensors as float64 copies, floating dtypes as float64, the rest as given (tensors cloned)."""

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().to(torch.float64) if v.is_floating_point() else v.detach().clone()
        if isinstance(v, torch.dtype) and v.is_floating_point:
            return torch.float64
        return v

    return pytree.tree_map(one, x)


def _abs(x: Any) -> Any:
    return pytree.tree_map(lambda v: v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v, x)


def returned_tensors(func: Any, result: Any) -> list[torch.Tensor]:
    """The tensors an op returns, except what an in-place or out= op returns (the argument it wrote, listed already)."""
    if any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
        return []
    return [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def judged_outputs(func: Any, args: Sequence[Any], kwargs: dict, result: Any) -> list[torch.Tensor]:
    """What an op computed: the arguments it writes (after the call), then the tensors it returns."""
    outs = [arg(tuple(args), kwargs, func, i, n) for i, n in written_args(func)]
    outs = [o for o in outs if isinstance(o, torch.Tensor)]
    return outs + returned_tensors(func, result)


_CONTRACTIONS = {
    "aten::mm": (0, -1),
    "aten::bmm": (0, -1),
    "aten::matmul": (0, -1),
    "aten::addmm": (1, -1),
    "aten::baddbmm": (1, -1),
    "aten::linear": (0, -1),
}
"""Contractions: the argument whose last dimension is K."""
_REDUCTIONS = {
    "aten::_softmax",
    "aten::softmax",
    "aten::_log_softmax",
    "aten::log_softmax",
    "aten::sum",
    "aten::mean",
    "aten::var",
    "aten::norm",
    "aten::linalg_vector_norm",
    "aten::rms_norm",
    "aten::_fused_rms_norm",
    "aten::layer_norm",
    "aten::native_layer_norm",
    "aten::cumsum",
    "aten::logsumexp",
}
_ATTENTION = {
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
}


def _magnitude(call: OpCall, up_args: tuple, up_kwargs: dict, outs: list[torch.Tensor]) -> tuple[list, int]:
    """The accumulation magnitude of each output and the reduction length of an aten op."""
    name = call.func._schema.name
    if name in _CONTRACTIONS:
        k_arg = _CONTRACTIONS[name][0]
        a = up_args[k_arg]
        size = int(a.shape[-1]) if isinstance(a, torch.Tensor) and a.dim() else 1
        if name == "aten::linear":
            w = up_args[1]
            mag = torch.nn.functional.linear(
                a.abs(), w.abs(), None if len(up_args) < 3 or up_args[2] is None else up_args[2].abs()
            )
        else:
            mag = call.func(*_abs(up_args), **{k: v for k, v in up_kwargs.items() if k not in ("beta", "alpha")})
        return [mag] + [None] * (len(outs) - 1), size
    if name in _ATTENTION:
        k = up_args[1]
        size = int(k.shape[-2]) if isinstance(k, torch.Tensor) and k.dim() >= 2 else 1
        v = up_args[2]
        scale = v.abs().mean() if isinstance(v, torch.Tensor) else None
        return [None if scale is None else outs[0].abs() + scale] + [None] * (len(outs) - 1), size
    if name in _REDUCTIONS:
        x = next((a for a in up_args if isinstance(a, torch.Tensor)), None)
        size = int(x.shape[-1]) if x is not None and x.dim() else 1
        if name in ("aten::sum", "aten::mean", "aten::cumsum"):
            return [call.func(*_abs(up_args), **up_kwargs)] + [None] * (len(outs) - 1), size
        return [None] * len(outs), size
    return [None] * len(outs), 1


def generic(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """The op itself on float64 copies of its inputs: what it writes, then what it returns."""
    up_args, up_kwargs = upcast((call.args, call.kwargs))
    outs = judged_outputs(call.func, up_args, up_kwargs, call.func(*up_args, **up_kwargs))
    mags, size = _magnitude(call, up_args, up_kwargs, outs)
    return outs, mags, size


def reference_for(func: Any) -> Reference | None:
    """The registered reference of ``func``, the generic rerun for an aten op, else None (no reference known)."""
    name = func._schema.name
    if name in REFERENCES:
        return REFERENCES[name]
    if name.startswith("aten::") or name.startswith("prims::"):
        return Reference("float64", generic)
    return None


# --- vLLM's CPU custom ops: their math, from vLLM's own native (pure torch) implementations' definitions ---------


def _silu_and_mul(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """``_C::silu_and_mul(out, input)``: out = silu(x[..., :d]) * x[..., d:]."""
    x = upcast(_get(call, 1, "input"))
    d = x.shape[-1] // 2
    return [torch.nn.functional.silu(x[..., :d]) * x[..., d:]], [None], 1


def _gelu_and_mul(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    x = upcast(_get(call, 1, "input"))
    d = x.shape[-1] // 2
    return [torch.nn.functional.gelu(x[..., :d]) * x[..., d:]], [None], 1


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rms_norm(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """``_C::rms_norm(out, input, weight, epsilon)``."""
    x, w = upcast(_get(call, 1, "input")), upcast(_get(call, 2, "weight"))
    return [_rms(x, w, float(_get(call, 3, "epsilon")))], [None], int(x.shape[-1])


def _fused_add_rms_norm(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """``_C::fused_add_rms_norm(input, residual, weight, epsilon)``: residual += input; input = rms_norm(residual)."""
    x, r, w = upcast(_get(call, 0, "input")), upcast(_get(call, 1, "residual")), upcast(_get(call, 2, "weight"))
    s = x + r
    return [_rms(s, w, float(_get(call, 3, "epsilon"))), s], [None, None], int(x.shape[-1])


def _rotary_embedding(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """``_C::rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``, in place on query and key:
    each head's first ``rotary_dim`` features rotated by the cache's cos/sin row of the token's position."""
    positions = _get(call, 0, "positions").long()
    head_size = int(_get(call, 3, "head_size"))
    cache = upcast(_get(call, 4, "cos_sin_cache"))
    neox = bool(_get(call, 5, "is_neox"))
    cos, sin = cache[positions.reshape(-1)].chunk(2, dim=-1)  # [t, rot/2] each
    outs = []
    for i, n in ((1, "query"), (2, "key")):
        x = _get(call, i, n)
        if x is None:
            continue
        x = upcast(x)
        t = x.reshape(positions.numel(), -1, head_size)
        rot = cos.shape[-1] * 2
        r, rest = t[..., :rot], t[..., rot:]
        c, s = cos[:, None, :], sin[:, None, :]
        if neox:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
            r = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            r = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        outs.append(torch.cat([r, rest], dim=-1).reshape(x.shape))
    return outs, [None] * len(outs), 2


def _onednn_mm(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """``_C::onednn_mm(out, x, bias, handler)``: out = x @ W.T + bias, W the weight vLLM packed into the handler
    (kept by the drill's vLLM adapter before vLLM drops it: ``state["weights"]``)."""
    handle = _get(call, 3, "handler")
    weights = call.state.get("weights", {})
    key = int(handle.reshape(-1)[0]) if isinstance(handle, torch.Tensor) else None
    w = weights.get(key)
    if w is None:
        raise LookupError("the oneDNN handle's weight was not kept (the drill keeps it for layers it loads)")
    x, bias = upcast(_get(call, 1, "x")), _get(call, 2, "bias")
    w64 = w.detach().to(x.device, torch.float64)
    b = None if bias is None else upcast(bias)
    ref = torch.nn.functional.linear(x, w64, b)
    mag = torch.nn.functional.linear(x.abs(), w64.abs(), None if b is None else b.abs())
    return [ref], [mag], int(w.shape[-1])


def _get(call: OpCall, i: int, name: str) -> Any:
    return arg(call.args, call.kwargs, call.func, i, name)


def _unified_attention(call: OpCall) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """``vllm::unified_attention_with_output(query, key, value, output, layer_name, ...)`` of a prefill from an empty
    cache: causal attention of the query's own tokens, each query head on its KV head, at the layer's scale."""
    q, k, v = (upcast(_get(call, i, n)) for i, n in ((0, "query"), (1, "key"), (2, "value")))
    scale = call.state.get("attention_scale", {}).get(_layer_name(_get(call, 4, "layer_name")))
    if scale is None:
        raise LookupError("the attention layer's scale is unknown (the drill's vLLM adapter records it)")
    if not call.state.get("fresh_prefill", False):
        raise LookupError("the query reads earlier context from the paged KV cache; only a fresh prefill has one")
    t, h, d = q.shape
    kv = k.shape[1]
    kq = k.repeat_interleave(h // kv, dim=1)
    vq = v.repeat_interleave(h // kv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, kq) * scale
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    ref = torch.einsum("hts,shd->thd", p, vq)
    mag = torch.einsum("hts,shd->thd", p, vq.abs())
    return [ref.reshape(_get(call, 3, "output").shape)], [mag.reshape(_get(call, 3, "output").shape)], t


def _layer_name(name: Any) -> str:
    """vLLM passes a layer's name to its opaque attention ops as the string or wrapped in a ``LayerName``."""
    value = getattr(name, "value", name)  # vLLM's LayerName wraps the string
    return value if isinstance(value, str) else str(value)


def _register_builtin() -> None:
    for schema, fn in (
        ("_C::silu_and_mul", _silu_and_mul),
        ("_C::gelu_and_mul", _gelu_and_mul),
        ("_C::rms_norm", _rms_norm),
        ("_C::fused_add_rms_norm", _fused_add_rms_norm),
        ("_C::rotary_embedding", _rotary_embedding),
        ("_C::onednn_mm", _onednn_mm),
        ("vllm::unified_attention_with_output", _unified_attention),
    ):
        register_reference(schema, fn, name=f"float64 ({schema})")


_register_builtin()
NOT_JUDGED: dict[str, str] = {
    "vllm::unified_kv_cache_update": "writes the KV cache (read back by the attention op after it)",
}
"""Ops whose outputs are not judged, and why."""
UNINITIALIZED = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided")
"""Ops whose output is memory not yet written: neither judged nor hashed."""
