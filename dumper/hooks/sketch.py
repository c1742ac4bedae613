"""Sketching on the capture device: a hidden-state tensor to its projection and exact squared norms.

The projection ``R`` (see :mod:`dumper.format.sketch`) is generated where the tensor lives, from
integer hashes that give the same bits on CPU and GPU, and cached per (device, width). A row
``x`` becomes ``R x`` in float32 (``x`` widened to float32 first: exact for bf16/fp16/fp32) and
``||x||^2`` summed in float64. Nothing is synchronized: both are device tensors, copied out by
the writer like any other record.

Example::

    sk = Sketcher(SketchSpec(k=256))
    proj, sq_norm = sk(hidden)          # [*rows, 256] float32, [*rows] float64
"""

from __future__ import annotations

from typing import Any

import torch

from dumper.format.sketch import NORM_SUFFIX, SKETCHED_POINTS, SketchSpec, hash_keys, mix32

__all__ = ["Sketcher", "sign_matrix", "sketch_for_record"]


def sign_matrix(spec: SketchSpec, hidden: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``R``'s signs as float32 ``[k, hidden]`` on ``device``: the bits of :func:`dumper.format.sketch.sign_bits`."""
    rows, cols = hash_keys(spec.seed, spec.k, hidden, lambda n: torch.arange(n, dtype=torch.int64, device=device))
    negative = (mix32(rows[:, None] ^ cols[None, :]) >> 31).to(torch.bool)
    return 1.0 - 2.0 * negative.to(torch.float32)


class Sketcher:
    """Projects hidden-state tensors under one :class:`SketchSpec`; ``R`` is built once per device and width."""

    def __init__(self, spec: SketchSpec) -> None:
        self.spec = spec
        self._mats: dict[tuple[str, int], torch.Tensor] = {}

    def matrix(self, hidden: int, device: torch.device) -> torch.Tensor:
        """``R^T`` scaled, ``[hidden, k]`` float32 on ``device``."""
        key = (str(device), hidden)
        m = self._mats.get(key)
        if m is None:
            m = self._mats[key] = (sign_matrix(self.spec, hidden, device) * self.spec.scale).T.contiguous()
        return m

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[*rows, hidden]`` -> (``[*rows, k]`` float32 projection, ``[*rows]`` float64 squared norms)."""
        x = x.detach()
        proj = x.to(torch.float32) @ self.matrix(x.shape[-1], x.device)
        sq = x.to(torch.float64).square().sum(dim=-1)
        return proj, sq


def sketch_for_record(sketcher: Sketcher | None, tensor: torch.Tensor, key: str, *, point: str | None,
                      shard_dim: int | None, code: str) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None,
                                                             dict[str, Any] | None]:
    """What a capture stores for ``tensor`` under ``key``: (tensor, companion tensors, the record's ``sketch`` field).

    Unchanged unless ``sketcher`` is set and ``tensor`` is a whole floating-point hidden state; then its
    projection, its norms under ``key + NORM_SUFFIX`` and ``{"hidden", "dtype"}`` (``code``: its dtype's code).
    """
    if sketcher is None or point not in SKETCHED_POINTS or shard_dim is not None \
            or not tensor.dtype.is_floating_point or tensor.dim() == 0:
        return tensor, None, None
    sketcher.spec.check_width(tensor.shape[-1], f"{key} ({code}{list(tensor.shape)})")
    proj, sq = sketcher(tensor)
    return proj, {key + NORM_SUFFIX: sq.reshape(-1)}, {"hidden": int(tensor.shape[-1]), "dtype": code}
