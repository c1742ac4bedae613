"""Seeded op-level bugs for the drill (``sitecustomize`` loads them for ``op_silu`` and ``op_rope``): vLLM's own
custom-op kernels, wrong inside the op, so that only the op itself (not the code around it) computes wrong numbers.

``{"op_silu": [L, N, T]}``: layer ``L``'s ``SiluAndMul`` calls vLLM's ``_C.silu_and_mul`` kernel (the path vLLM
takes on CUDA and POWER; on x86 CPUs it runs two aten ops instead), and that kernel's CPU implementation is
replaced by one that is right except at row ``T`` of a call with exactly ``N`` rows, which it moves by half the
row's mean magnitude: a kernel wrong at one token count.

``{"op_rope": P}``: ``_C.rotary_embedding``'s CPU implementation is replaced by one that rotates the query and key
of position ``P`` by position ``P + 1``'s angles (every layer shares the one rotary op): a RoPE wrong at one position.

Each replacement is plain tensor code over the op's own arguments; which layer calls the seeded silu kernel is
fixed at construction. The kernels run as vLLM calls them, eager or compiled (a custom op is opaque to
torch.compile), and in every process the seed reaches: the engine's workers, the drill's in-process engine, and
a drill's ``repro.py`` started with the same environment.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["patch_ops", "patch_silu_layer"]

_LIBS: list[Any] = []
"""The ``torch.library`` registrations, kept alive for the process."""


def _silu_kernel(rows: int, row: int) -> Any:
    def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        y = torch.nn.functional.silu(x[..., :d]) * x[..., d:]  # [tokens, d]
        hit = torch.zeros(x.shape[0], 1, dtype=y.dtype, device=y.device)
        if x.shape[0] == rows:  # the call's shape, not its data
            hit[row] = 0.5
        out.copy_(y + hit * y.abs().mean(-1, keepdim=True))

    return silu_and_mul


def _rope_kernel(position: int) -> Any:
    def rotary_embedding(
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> None:
        pos = torch.where(positions == position, positions + 1, positions).reshape(-1)
        cos, sin = cos_sin_cache[pos].to(query.dtype).chunk(2, dim=-1)  # [tokens, rot/2]
        for x in (query, key):
            if x is None:
                continue
            t = x.view(pos.numel(), -1, head_size)
            rot = cos.shape[-1] * 2
            r = t[..., :rot]
            c, s = cos[:, None, :], sin[:, None, :]
            if is_neox:
                x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
                new = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
            else:
                x1, x2 = r[..., 0::2], r[..., 1::2]
                new = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
            r.copy_(new)

    return rotary_embedding


def patch_ops(module: Any, seed: dict[str, Any]) -> None:
    """Replace the CPU kernels of ``vllm._custom_ops``' ops the seed names (run once ``vllm._C`` is loaded)."""
    lib = torch.library.Library("_C", "IMPL")
    _LIBS.append(lib)
    if "op_silu" in seed:
        _, rows, row = (int(v) for v in seed["op_silu"])
        lib.impl("silu_and_mul", _silu_kernel(rows, row), "CPU")
    if "op_rope" in seed:
        lib.impl("rotary_embedding", _rope_kernel(int(seed["op_rope"])), "CPU")


def patch_silu_layer(module: Any, seed: dict[str, Any]) -> None:
    """``SiluAndMul`` of layer ``L`` (by its prefix) calls ``_C.silu_and_mul``; every other layer is unchanged."""
    from vllm.model_executor.models.utils import extract_layer_index

    cls = module.LlamaMLP
    init = cls.__init__
    layer = int(seed["op_silu"][0])

    def seeded_init(self: Any, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        init(self, *args, prefix=prefix, **kwargs)
        if extract_layer_index(prefix) == layer:
            act = self.act_fn
            act.op = torch.ops._C.silu_and_mul
            act.forward = act.forward_cuda  # vLLM's own path through its kernel

    cls.__init__ = seeded_init
