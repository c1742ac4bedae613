"""Lazy public names for a package's ``__init__`` (PEP 562): each is imported from its module on first use.

``comparator`` and ``comparator.store`` export this way, so that ``python -m comparator A B``
loads only what the comparison touches (not the run store and fsspec, say).

Example::

    _EXPORTS = {"RunStore": "comparator.store.runstore"}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    exports: Mapping[str, str],
    namespace: dict[str, Any],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public name -> defining module map is
    ``exports``; a name once imported is kept in ``namespace`` (the package's ``globals()``)."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *exports])

    return getattr_, dir_
