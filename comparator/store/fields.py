"""The exact-type field checks of the run record reader (``run.json`` is untrusted input).

Exact means exact: ``true`` is not an integer, ``"3"`` is not a number. Each failed check is a
``ValueError`` naming the field by its path in the record (``summary.first_divergent.layer``);
the store prefixes the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from dumper.format.files import printable

__all__ = ["show", "bad", "check", "is_int", "is_num", "is_str", "where_prefixed"]


def show(v: Any) -> str:
    """A JSON value as an error shows it: printable, at most 60 characters."""
    try:
        text = json.dumps(v, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    return printable(text if len(text) <= 60 else text[:57] + "...")


def bad(field: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"field {field!r}: expected {expected}, got {show(got)}")


def is_int(v: Any) -> bool:
    return type(v) is int


def is_num(v: Any) -> bool:
    return type(v) in (int, float)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def check(d: Mapping[str, Any], field: str, ok: Callable[[Any], bool], expected: str, *, prefix: str = "") -> None:
    """Refuse ``d[field]`` (when present) unless ``ok`` holds for it."""
    if field in d and not ok(d[field]):
        raise bad(prefix + field, expected, d[field])


def where_prefixed(e: ValueError, where: str | None) -> ValueError:
    """``e`` with the file it was read from in front (``where: field ...``), when known."""
    return ValueError(f"{where}: {e}") if where is not None else e
