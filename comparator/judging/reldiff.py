"""The one rel_diff formula, ``||x-y||^2 / (||x||^2 + ||y||^2)``, from sums its caller accumulated.

Every rel_diff the comparator reports is this ratio: a whole tensor's and each row's
(:mod:`comparator.hidden.metrics`, :mod:`comparator.hidden.registry`), a tensor-parallel shard's
(:mod:`comparator.hidden.compare`), the router logits' (:mod:`comparator.routing.compare`). The callers
differ only in how they sum (streamed float64 row sums, scaled near float64's limits; plain numpy sums),
so they pass the sums and this module applies the ratio and its two rules: 0/0 (two all-zero tensors, or
rows) is 0, and a NaN/Inf on one side only is inf, so it never passes a threshold. The C kernel
(``comparator/_kernels.c``) computes only the sums; it holds no copy of the ratio. Two arrays in, one
float out: :func:`comparator.hidden.metrics.rel_diff` (``from comparator import rel_diff``).

Example::

    import numpy as np
    from comparator.judging.reldiff import rel_diff_of
    rel_diff_of(1.0, 4.0)                                            # 0.25
    rel_diff_of(np.array([0.0, 1.0]), np.array([0.0, 2.0]))         # array([0. , 0.5])
"""

from __future__ import annotations

import math
from typing import overload

import numpy as np

__all__ = ["rel_diff_of"]


@overload
def rel_diff_of(dd: float, norms: float, *, mismatched: bool = False) -> float: ...


@overload
def rel_diff_of(dd: np.ndarray, norms: np.ndarray, *, mismatched: bool | np.ndarray = False) -> np.ndarray: ...


def rel_diff_of(
    dd: float | np.ndarray, norms: float | np.ndarray, *, mismatched: bool | np.ndarray = False
) -> float | np.ndarray:
    """``dd / norms``, with ``dd`` the sum of ``(x-y)^2`` and ``norms`` the sum of ``x^2 + y^2`` at one scale:
    floats for one rel_diff, or arrays of one per row.

    0 where ``norms`` is not above 0 (0/0; a NaN sum reads as 0 too); inf where ``mismatched`` (a
    NaN/Inf on one side only), a bool or, for arrays, a bool per row.
    """
    if isinstance(dd, np.ndarray):
        positive = norms > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(positive, dd / np.where(positive, norms, 1.0), 0.0)
        return np.where(mismatched, np.inf, out)
    if mismatched:
        return math.inf
    return dd / norms if norms > 0 else 0.0
