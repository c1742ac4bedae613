"""Exact-type reads of NOISE.json's fields, for the readers in :mod:`comparator.judging.noise` and ``.logprob_noise``.

A noise file is input from outside (a hand edit, another version, an attacker) and it decides
what passes, so it is read like a manifest (:mod:`dumper.format.validate`): required keys and
no unknown ones; integers that are ints (``true``, ``3.0``, ``1e9`` or ``Infinity`` are not);
noise values that are finite numbers >= 0 (``"0.0"`` and ``false`` are not), at most 2 where
they are rel_diffs; strings that are text (:func:`~dumper.format.files.is_text`). Each check
raises one :class:`~dumper.errors.UsageError` line naming the file and the field. The two bounds
every noise reader shares live here too: :data:`REL_DIFF_MAX` (a larger noise is impossible) and
:data:`EXCESSIVE` (a threshold derived from noise past it is a warning).

Example::

    from comparator.judging.fields import integer, number, record
    d = record(raw, "NOISE.json", "logprobs.means.k3_mean", ("mean", "se", "positions"))
    se = number(d["se"], "NOISE.json", "logprobs.means.k3_mean.se")          # 1e-9; "1e-9" or true raise
    positions = integer(d["positions"], "NOISE.json", "logprobs.means.k3_mean.positions")
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from dumper.errors import UsageError
from dumper.format.files import is_text, show

__all__ = ["REL_DIFF_MAX", "EXCESSIVE", "bad", "record", "items", "text", "integer", "number"]

REL_DIFF_MAX = 2.0
"""The largest rel_diff there is, ``|x-y|² / (|x|² + |y|²) <= 2`` (at ``y = -x``): a noise above it is impossible."""
EXCESSIVE = 10.0
"""A noise-derived threshold over this many times the fixed threshold it replaces gets a warning:
such noise lets pass what the fixed thresholds fail. Benign calibrations stay well below it (the
bfloat16 tiny-llama, eager vs SDPA and chunked: 3 x noise is at most 0.13x the fixed per-token
1e-3 and 0.25x its logprob rows; the peaked presets' bfloat16 KL mean 5.4x the default row). Over
the fixed 1e-3 it takes a rel_diff noise above 3.3e-3, a relative error norm of about 8%."""
_I64_MAX = (1 << 63) - 1
_FLOAT_MAX = sys.float_info.max


def bad(where: str, field: str, expected: str, got: Any) -> UsageError:
    """The one-line error for a field that is not what the format says."""
    return UsageError(f"{where}: {field}: expected {expected}, got {show(got)}")


def record(v: Any, where: str, field: str, required: Iterable[str], optional: Iterable[str] = ()) -> dict[str, Any]:
    """``v`` if it is an object holding every ``required`` key and no key outside ``required`` and ``optional``."""
    if type(v) is not dict:
        raise bad(where, field, "an object", v)
    need, allowed = set(required), {*required, *optional}
    missing, unknown = sorted(need - v.keys()), [k for k in v if k not in allowed]
    if missing or unknown:
        parts = ([f"missing keys {missing}"] if missing else []) + (
            [f"unknown keys {', '.join(show(k) for k in unknown[:3])}{' ...' if len(unknown) > 3 else ''}"]
            if unknown
            else []
        )
        raise UsageError(f"{where}: {field}: {'; '.join(parts)}")
    return v


def items(v: Any, where: str, field: str, *, length: int | None = None) -> list[Any]:
    """``v`` if it is a list (of ``length`` items when given)."""
    if type(v) is not list:
        raise bad(where, field, "a list", v)
    if length is not None and len(v) != length:
        raise UsageError(f"{where}: {field}: expected {length} values (one per variant), got {len(v)}")
    return v


def text(v: Any, where: str, field: str, *, null: bool = False, name: bool = False) -> Any:
    """``v`` if it is text (or null with ``null``); ``name``: non-empty, printable characters only (a tensor name)."""
    if v is None and null:
        return None
    if is_text(v) and (not name or v and v.isprintable()):
        return v
    raise bad(
        where,
        field,
        ("a non-empty string of printable characters" if name else "a string") + (" or null" if null else ""),
        v,
    )


def integer(v: Any, where: str, field: str, *, low: int | None = 0, null: bool = False) -> Any:
    """``v`` if it is an int (not a bool) in ``[low, 2^63)`` (``low`` None: from ``-2^63``), or null with ``null``."""
    if v is None and null:
        return None
    if type(v) is int and (-_I64_MAX - 1 if low is None else low) <= v <= _I64_MAX:
        return v
    what = "an integer" if low is None else f"an integer >= {low}"
    raise bad(where, field, what + (" or null" if null else ""), v)


def number(v: Any, where: str, field: str, *, high: float | None = None, null: bool = False) -> Any:
    """``v`` as a float if it is a finite JSON number (not a bool) in ``[0, high]``, or null with ``null``.

    NaN, infinity and an integer too large for a float fail the range test, never raise.
    """
    if v is None and null:
        return None
    top = _FLOAT_MAX if high is None else high
    if (type(v) is float or type(v) is int) and 0 <= v <= top:
        return float(v)
    what = (
        f"a number in [0, {high:g}] (a rel_diff is at most {REL_DIFF_MAX:g})"
        if high == REL_DIFF_MAX
        else "a finite number >= 0"
        if high is None
        else f"a number in [0, {high:g}]"
    )
    raise bad(where, field, what + (" or null" if null else ""), v)
