"""What a capture refuses in the caller's frame, before anything is stored: the manifest's free
metadata and what :meth:`dumper.hooks.capture.Capture.record` stores beside a tensor's data; and
:func:`hook_guard`, which tells a driftscope bug inside a hook from the model's own failure.

Each check mirrors one the dump reader makes (:mod:`dumper.format.validate`), so a capture never
writes a dump its own reader would refuse.
"""

from __future__ import annotations

import functools
import json
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dumper.errors import CorruptDumpError, DriftscopeError, InternalError, UsageError
from dumper.format.validate import check_extra, first_bad_text

__all__ = ["checked_extra", "checked_record_args", "as_index", "hook_guard"]


def checked_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` as the JSON the manifest will hold, refused now (not at exit) where the reader would refuse it."""
    try:
        out = json.loads(json.dumps(dict(extra or {}), allow_nan=False))
        check_extra(out, "capture(extra=...)")
    except (TypeError, ValueError) as e:
        raise UsageError(f"capture(extra=...): not storable as JSON ({e})") from None
    except CorruptDumpError as e:
        raise UsageError(str(e)) from None
    return out


def checked_record_args(
    name: Any, shape: tuple[int, ...], layer: Any, point: Any, shard_dim: Any, meta: dict[str, Any]
) -> tuple[int | None, int | None, dict[str, Any]]:
    """Validate what :meth:`Capture.record` stores beside the data; return (layer, shard_dim, meta) as stored.

    Refused here, in the caller's frame, is everything the reader would refuse in the manifest
    (:mod:`dumper.format.validate`): a name that is not non-empty text, a non-integer layer (numpy and
    torch integer scalars are integers, ``True`` is not), a non-text point, and a tensor of
    rows but no columns, which the reader cannot tell from one declaring 2^31 rows to make the
    aligner allocate (it asks a byte of file per row).
    """
    if type(name) is not str or not name or not name.isprintable() or first_bad_text(name, "name") is not None:
        raise UsageError(f"dump({name!r}): the name must be a non-empty string of printable, valid Unicode")
    if len(shape) > 1 and shape[-1] == 0 and math.prod(shape[:-1]) > 0:
        raise UsageError(
            f"dump({name!r}): shape {list(shape)} has rows but a last dim of 0; a dump cannot "
            "hold such a zero-width tensor (skip it: it holds no values)"
        )
    layer, shard_dim = as_index(name, "layer", layer), as_index(name, "shard_dim", shard_dim)
    if point is not None and (type(point) is not str or first_bad_text(point, "point") is not None):
        raise UsageError(f"dump({name!r}): point must be a string or None, got {point!r}")
    if shard_dim is not None:
        if not -len(shape) <= shard_dim < len(shape):
            raise UsageError(f"dump({name!r}): shard_dim {shard_dim} is out of range for shape {list(shape)}")
        shard_dim %= len(shape)
    stored: dict[str, Any] = {}
    for k, v in meta.items():
        v = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if (
            isinstance(v, float)
            and not math.isfinite(v)
            or isinstance(v, str)
            and first_bad_text(v, k) is not None
            or first_bad_text(k, k) is not None
        ):
            raise UsageError(
                f"dump({name!r}): meta {k!r}={v!r} cannot be stored (JSON needs finite numbers and valid Unicode text)"
            )
        stored[k] = v
    return layer, shard_dim, stored


def as_index(name: str, what: str, v: Any) -> int | None:
    """``v`` as a Python int (any integer scalar, via ``operator.index``), or None; a bool or non-integer raises."""
    if v is None:
        return None
    try:
        if isinstance(v, (bool, np.bool_)) or isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            raise TypeError
        i = operator.index(v)
    except TypeError:
        raise UsageError(f"dump({name!r}): {what} must be an integer or None, got {v!r}") from None
    if not -(1 << 63) <= i < 1 << 63:
        raise UsageError(f"dump({name!r}): {what} {i} is out of the int64 range")
    return i


def hook_guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook; anything it raises that is not a :class:`DriftscopeError` is a driftscope bug (InternalError),
    so that the run's boundary does not call it "the model's forward failed" (exit 3, not 2)."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (DriftscopeError, InternalError):
            raise
        except Exception as e:
            raise InternalError(f"driftscope hook {fn.__name__} failed ({type(e).__name__}: {e})") from e

    return guarded
