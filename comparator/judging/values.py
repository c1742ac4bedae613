"""Threshold values as users write them: one parser for flags, env vars, JSON tables and noise floors.

Every threshold driftscope reads (``--threshold``, ``DRIFTSCOPE_TOKEN_THRESHOLD``,
``--logprob-threshold NAME=VALUE``, a row of ``logprob_thresholds.json``, ``--noise-floor``)
is a finite number >= 0, and some may be switched off. A NaN or a negative value would make
a check that can never fail, so it is refused here, in one line naming where it came from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

from dumper.errors import UsageError

__all__ = ["OFF_WORDS", "is_threshold", "parse_threshold", "parse_assignments"]

OFF_WORDS: Final = frozenset({"off", "none", "null"})
"""Words that switch a check off where that is allowed (a JSON ``null`` does too)."""


def is_threshold(value: object) -> bool:
    """A usable threshold: a finite int or float >= 0 (never a bool, NaN, inf or a negative number)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def parse_threshold(raw: object, *, where: str, allow_off: bool = False) -> float | None:
    """``raw`` (a string, an int or a float; None for a JSON null) as a threshold.

    ``where`` names the source for the error message (``DRIFTSCOPE_DIFF_THRESHOLD``,
    ``--logprob-threshold kl_max``...). Returns None for "not checked" when ``allow_off``.
    """
    hint = " (or off)" if allow_off else ""
    if raw is None:
        if allow_off:
            return None
        raise UsageError(f"{where}: a threshold is required")
    if isinstance(raw, str):
        text = raw.strip()
        if allow_off and text.lower() in OFF_WORDS:
            return None
        try:
            raw = float(text)
        except ValueError:
            raise UsageError(f"{where}: {text!r} is not a number{hint}") from None
    if isinstance(raw, int) and not isinstance(raw, bool):
        try:
            raw = float(raw)
        except OverflowError:  # a JSON integer beyond float range
            raise UsageError(f"{where}: an integer beyond float range is not a finite number >= 0{hint}") from None
    if not is_threshold(raw):
        raise UsageError(f"{where}: {raw!r} must be a finite number >= 0{hint}")
    return float(raw)


def parse_assignments(
    items: Iterable[str], *, flag: str, default_name: str | None = None, allow_off: bool = False
) -> dict[str, float | None]:
    """``NAME=VALUE`` items of a repeated flag as ``{name: value}``; later items win.

    With ``default_name``, a bare ``VALUE`` sets that name (``--noise-floor 1e-9`` is rel_diff's).
    """
    out: dict[str, float | None] = {}
    for item in items:
        name, sep, value = item.rpartition("=") if default_name else item.partition("=")
        if not sep:
            if default_name is None:
                raise UsageError(f"{flag} {item!r}: expected NAME=VALUE")
            name, value = default_name, item
        name = name.strip()
        if not name:
            raise UsageError(f"{flag} {item!r}: expected NAME=VALUE")
        out[name] = parse_threshold(value, where=f"{flag} {item!r}", allow_off=allow_off)
    return out
