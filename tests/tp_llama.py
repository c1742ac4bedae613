"""Megatron-style tensor parallelism for the HF Llama of the ``tiny-llama`` preset, on CPU (gloo).

:func:`shard_llama` splits a ``LlamaForCausalLM`` in place for ``rank`` of ``world``:

- per decoder layer, ``q_proj`` / ``k_proj`` / ``v_proj`` become column-parallel (each rank keeps
  the weight rows of its contiguous slice of heads) and ``o_proj`` row-parallel (the matching
  slice of input columns) followed by an all-reduce (sum) of its output;
- ``mlp.gate_proj`` / ``mlp.up_proj`` column-parallel, ``mlp.down_proj`` row-parallel + all-reduce;
- embedding, norms and ``lm_head`` stay replicated.

HF's ``LlamaAttention`` (transformers 5) reshapes with ``view(*input_shape, -1, head_dim)``, so
fewer local heads work unchanged as long as the q/kv head ratio (``num_key_value_groups``) is
kept: tiny-llama has 4 q heads and 2 kv heads, so each of 2 ranks keeps 2 q heads and 1 kv head.

The row-parallel linears stay ``nn.Linear`` (subclass :class:`RowParallelLinear`) under the
attribute names ``o_proj`` / ``down_proj``, so module paths and parameter names stay canonical.

:func:`record_q_proj` adds forward hooks that ``dumper.dump`` each layer's ``q_proj`` output,
marked ``shard_dim=-1`` when the model is tensor-parallel (each rank holds a slice of the last dim).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["RowParallelLinear", "q_proj_name", "record_q_proj", "shard_llama"]


class RowParallelLinear(nn.Linear):
    """A linear holding a slice of the input features; the partial outputs are summed over ranks.

    The bias (if any) is added once, after the all-reduce.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group=None) -> None:
        super().__init__(
            weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            self.weight.copy_(weight)
            if bias is not None:
                self.bias.copy_(bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out if self.bias is None else out + self.bias


def _slice(n: int, rank: int, world: int, what: str) -> slice:
    if n % world:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {world}")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def _column_parallel(lin: nn.Linear, rows: slice) -> None:
    """Keep output features ``rows`` of ``lin`` (rows of its weight), in place."""
    with torch.no_grad():
        lin.weight = nn.Parameter(lin.weight[rows].clone(), requires_grad=lin.weight.requires_grad)
        if lin.bias is not None:
            lin.bias = nn.Parameter(lin.bias[rows].clone(), requires_grad=lin.bias.requires_grad)
    lin.out_features = lin.weight.shape[0]


def _row_parallel(lin: nn.Linear, cols: slice, group=None) -> RowParallelLinear:
    """A :class:`RowParallelLinear` holding input features ``cols`` of ``lin``."""
    with torch.no_grad():
        new = RowParallelLinear(lin.weight[:, cols], lin.bias, group)
    new.weight.requires_grad_(lin.weight.requires_grad)
    new.train(lin.training)
    return new


def shard_llama(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Shard a HF Llama causal LM in place for ``rank`` of ``world`` (Megatron split); returns it."""
    if world == 1:
        return model
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    q_heads = _slice(n_q, rank, world, "num_attention_heads")
    kv_heads = _slice(n_kv, rank, world, "num_key_value_heads")
    q_rows = slice(q_heads.start * head_dim, q_heads.stop * head_dim)
    kv_rows = slice(kv_heads.start * head_dim, kv_heads.stop * head_dim)
    ff = _slice(config.intermediate_size, rank, world, "intermediate_size")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _column_parallel(attn.q_proj, q_rows)
        _column_parallel(attn.k_proj, kv_rows)
        _column_parallel(attn.v_proj, kv_rows)
        attn.o_proj = _row_parallel(attn.o_proj, q_rows, group)
        # the q/kv ratio per rank is unchanged; assert it so a config that breaks it fails loudly
        assert (q_heads.stop - q_heads.start) // (kv_heads.stop - kv_heads.start) == attn.num_key_value_groups
        _column_parallel(mlp.gate_proj, ff)
        _column_parallel(mlp.up_proj, ff)
        mlp.down_proj = _row_parallel(mlp.down_proj, ff, group)
    return model


def q_proj_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.q_proj.output"


def record_q_proj(model: nn.Module, *, sharded: bool | None = None) -> list:
    """Forward hooks that ``dumper.dump`` every layer's q_proj output; returns the hook handles.

    ``sharded`` (default: torch.distributed is initialized with more than one rank) marks the
    dumps ``shard_dim=-1``: each rank holds its heads' slice of the last dim.
    """
    import dumper

    if sharded is None:
        sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    handles = []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, out, i=i):
            if sharded:
                dumper.dump(q_proj_name(i), out, layer=i, shard_dim=-1)
            else:
                dumper.dump(q_proj_name(i), out, layer=i)

        handles.append(layer.self_attn.q_proj.register_forward_hook(hook))
    return handles
