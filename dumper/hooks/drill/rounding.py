"""How far an op's output may sit from its float64 reference by rounding alone, and how far it does, per token row.

An op computed in a floating dtype rounds its result once (at most half a unit in the last place,
``u`` below) and, where it reduces over ``K`` terms (a GEMM's inner dimension, an attention's keys,
a norm's row), accumulates rounding whose typical size grows like ``sqrt(K)`` units of its
accumulation dtype (float32 for float32, bfloat16 and float16 kernels on CPU and GPU) times the
size of the terms. The bound of each element is therefore::

    bound = u(out) * |ref| + u(acc) * sqrt(K) * mag

with ``mag`` the sum of the terms' magnitudes (``|A| @ |B|`` for a GEMM, ``|ref|`` otherwise). A
row's ratio is ``rms(out - ref) / rms(bound)`` over the row's elements: about 0.3-1 for an op that
rounds as its dtype predicts, a few units for a vectorized transcendental, and far beyond for an op
that computes something else. Elements where the output equals the reference (infinities of a
mask included, and NaN where both are NaN) count as exact; a non-finite output where the reference
differs makes the row's ratio infinite, so a NaN never passes.
"""

from __future__ import annotations

import math

import torch

from dumper.format.dtypes import unit_roundoff as format_unit_roundoff

__all__ = ["unit_roundoff", "accumulation_roundoff", "row_ratios", "token_dim"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half a unit in the last place of 1.0 in ``dtype`` (:func:`dumper.format.dtypes.unit_roundoff`)."""
    if not dtype.is_floating_point:
        raise ValueError(f"{dtype} is not a floating dtype")
    return format_unit_roundoff(str(dtype).removeprefix("torch."))


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the dtype kernels of ``dtype`` accumulate in: float32, float64 for float64."""
    return format_unit_roundoff("float64" if dtype == torch.float64 else "float32")


def token_dim(shape: tuple[int, ...] | torch.Size, n: int) -> int | None:
    """The first dimension of ``shape`` of size ``n`` (the drilled tokens), skipping none; None when there is none."""
    return next((d for d, size in enumerate(shape) if size == n), None) if n > 1 else _single(shape)


def _single(shape: tuple[int, ...] | torch.Size) -> int | None:
    """With one token, a tensor's rows are per token when it has any dimension at all: the first one."""
    return 0 if len(shape) else None


def row_ratios(
    out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor | None, size: int, dim: int | None
) -> torch.Tensor:
    """Per row along ``dim`` (one row when None): ``rms(out - ref) / rms(bound)`` (float64 [rows]).

    ``ref`` and ``mag`` are float64 of ``out``'s shape (``mag`` None: ``|ref|``); ``size`` is the reduction
    length ``K`` of the rounding model. A row with a zero bound is 0 when exact, else infinite.
    """
    o = out.detach().to(torch.float64)
    r = ref.to(o.device, torch.float64)
    if o.shape != r.shape:
        r = r.expand_as(o) if r.numel() == 1 else r.reshape(o.shape)
    same = (o == r) | (torch.isnan(o) & torch.isnan(r))
    err = torch.where(same, torch.zeros((), dtype=torch.float64, device=o.device), o - r)
    finite_ref = torch.where(same | ~torch.isfinite(r), torch.zeros_like(r), r)
    m = finite_ref.abs() if mag is None else mag.to(o.device, torch.float64).abs().expand_as(o)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    bound = unit_roundoff(out.dtype) * finite_ref.abs() + accumulation_roundoff(out.dtype) * math.sqrt(size) * m
    if dim is None:
        err, bound = err.reshape(1, -1), bound.reshape(1, -1)
    else:
        err, bound = err.movedim(dim, 0).reshape(o.shape[dim], -1), bound.movedim(dim, 0).reshape(o.shape[dim], -1)
    bad = ~torch.isfinite(err)
    num = torch.where(bad, torch.zeros_like(err), err).square().sum(1)
    den = bound.square().sum(1)
    ratio = torch.where(den > 0, (num / torch.where(den > 0, den, torch.ones_like(den))).sqrt(), num.sqrt() * math.inf)
    ratio = torch.where(num == 0, torch.zeros_like(ratio), ratio)
    return torch.where(bad.any(1), torch.full_like(ratio, math.inf), ratio)
