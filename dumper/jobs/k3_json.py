"""The JSON of the k3 verdict that ``selfcheck`` and its server variant share (torch-free).

Both results carry the same trailing fields (``k3_mean`` .. ``k3_tokens``): this module writes
them (a non-finite k3 or error as ``null``, by :mod:`dumper.format.jsonfloat`, and the constant
``k3_note``) and reads them back, so the two codecs cannot drift apart.

Example::

    d = k3_to_json(asdict(result))           # in SelfCheckResult.to_json
    fields = k3_from_json(json.loads(text))  # keyword arguments of SelfCheckResult / ServerSelfCheck
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from comparator import GREEDY_K3_NOTE
from dumper.format.jsonfloat import from_json_float, to_json_float

__all__ = ["K3_FLOATS", "k3_to_json", "k3_from_json"]

K3_FLOATS: Final = ("k3_mean", "k3_max", "max_abs_err")
"""The verdict's floats that may be non-finite (a NaN or -inf logprob on one path): ``null`` in JSON."""


def k3_to_json(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` (a result's ``asdict``) with :data:`K3_FLOATS` JSON-safe and ``k3_note`` added; changed in place."""
    for k in K3_FLOATS:
        d[k] = to_json_float(d[k])
    d["k3_note"] = GREEDY_K3_NOTE
    return d


def k3_from_json(d: Mapping[str, Any]) -> dict[str, Any]:
    """The shared fields read back from :func:`k3_to_json`'s output; a null float is infinite (it never passes)."""
    return {k: from_json_float(d[k]) for k in K3_FLOATS} | {
        "k3_max_position": int(d["k3_max_position"]),
        "threshold": float(d["threshold"]),
        "passed": bool(d["passed"]),
        "k3_tokens": str(d["k3_tokens"]),
    }
