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

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dumper.format.sketch import NORM_SUFFIX, SKETCHED_POINTS, SketchSpec, hash_keys, mix32

__all__ = ["Sketcher", "sign_matrix", "sketch_for_record"]


def sign_matrix(spec: SketchSpec, hidden: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``R``'s signs as float32 ``[k, hidden]`` on ``device``: the bits of :func:`dumper.format.sketch.sign_bits`."""
    rows, cols = hash_keys(spec.seed, spec.k, hidden, lambda n: torch.arange(n, dtype=torch.int64, device=device))
    negative = (mix32(rows[:, None] ^ cols[None, :]) >> 31).to(torch.bool)
    return 1.0 - 2.0 * negative.to(torch.float32)


BLOCK_BYTES = 2 << 20
"""On a CPU, rows are sketched a block of about this many float32 bytes at a time, so that the block is still in cache
for its norm (measured 2-5x faster norms: ``bench/bench_sketch.py``); a GPU takes a tensor at once."""
_MATRICES: dict[tuple[SketchSpec, int, str], torch.Tensor] = {}
"""``R^T`` scaled, per (spec, width, device), shared by every capture of the process (a few MiB each)."""
_MAX_MATRICES = 8


def _matrix(spec: SketchSpec, hidden: int, device: torch.device) -> torch.Tensor:
    """``R^T`` scaled, ``[hidden, k]`` float32 on ``device``, built once per process."""
    key = (spec, hidden, str(device))
    m = _MATRICES.get(key)
    if m is None:
        if len(_MATRICES) >= _MAX_MATRICES:
            _MATRICES.pop(next(iter(_MATRICES)))
        m = _MATRICES[key] = (sign_matrix(spec, hidden, device) * spec.scale).T.contiguous()
    return m


@contextlib.contextmanager
def _ieee_fp32(device: torch.device) -> Iterator[None]:
    """float32 matmuls in full float32 on a GPU: a user's TF32 setting (10-bit mantissas) would raise the sketch's
    floor by seven decades. The setting is restored at once: the model's own matmuls are untouched."""
    matmul = torch.backends.cuda.matmul
    if device.type != "cuda" or getattr(matmul, "fp32_precision", "ieee") == "ieee":
        yield
        return
    saved, matmul.fp32_precision = matmul.fp32_precision, "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = saved


class Sketcher:
    """Projects hidden-state tensors under one :class:`SketchSpec`."""

    def __init__(self, spec: SketchSpec) -> None:
        self.spec = spec

    def matrix(self, hidden: int, device: torch.device) -> torch.Tensor:
        """``R^T`` scaled, ``[hidden, k]`` float32 on ``device``."""
        return _matrix(self.spec, hidden, device)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[*rows, hidden]`` -> (``[*rows, k]`` float32 projection, ``[*rows]`` float64 squared norms).

        The norm is ``vector_norm`` in float64, squared: within a few float64 roundings of the exact sum of
        squares (measured at most 32 units in the last place at hidden 4096), at half the cost of summing squares.
        """
        x = x.detach()
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)
        m = self.matrix(hidden, x.device)
        proj = torch.empty((rows.shape[0], self.spec.k), dtype=torch.float32, device=x.device)
        sq = torch.empty(rows.shape[0], dtype=torch.float64, device=x.device)
        step = rows.shape[0] if x.is_cuda else max(1, BLOCK_BYTES // (4 * max(1, hidden)))
        with _ieee_fp32(x.device):
            for a in range(0, rows.shape[0], step):
                block = rows[a : a + step]
                torch.mm(block.to(torch.float32), m, out=proj[a : a + step])
                torch.linalg.vector_norm(block, dim=-1, dtype=torch.float64, out=sq[a : a + step])
        sq.square_()
        return proj.reshape(*x.shape[:-1], self.spec.k), sq.reshape(x.shape[:-1])


def sketch_for_record(
    sketcher: Sketcher | None, tensor: torch.Tensor, key: str, *, point: str | None, shard_dim: int | None, code: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    """What a capture stores for ``tensor`` under ``key``: (tensor, companion tensors, the record's ``sketch`` field).

    Unchanged unless ``sketcher`` is set and ``tensor`` is a whole floating-point hidden state; then its
    projection, its norms under ``key + NORM_SUFFIX`` and ``{"hidden", "dtype"}`` (``code``: its dtype's code).
    """
    if (
        sketcher is None
        or point not in SKETCHED_POINTS
        or shard_dim is not None
        or not tensor.dtype.is_floating_point
        or tensor.dim() == 0
    ):
        return tensor, None, None
    sketcher.spec.check_width(tensor.shape[-1], f"{key} ({code}{list(tensor.shape)})")
    proj, sq = sketcher(tensor)
    return proj, {key + NORM_SUFFIX: sq.reshape(-1)}, {"hidden": int(tensor.shape[-1]), "dtype": code}
