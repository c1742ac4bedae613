"""How a run is stored: its label (``baseline``, ``passed``, ``failed``), and the one list of them.

Its own module, importing nothing, so that a parser offering ``--label`` choices loads no run
record machinery (:mod:`comparator.store.types` holds the rest of a record's typed parts).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["Label", "LABELS", "is_label"]


class Label(str, Enum):
    """How a run is stored: ``baseline`` (bootstrapped or promoted by a human), or its verdict against
    its baseline, ``passed`` or ``failed`` (a failed run is evidence, never selected as a baseline).

    A ``str``: ``Label.FAILED == "failed"``, and it prints and serializes as its value.
    """

    BASELINE = "baseline"
    PASSED = "passed"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of_verdict(cls, passed: bool) -> Label:
        return cls.PASSED if passed else cls.FAILED


LABELS: tuple[str, ...] = tuple(label.value for label in Label)
"""The label values, in :class:`Label` order (``--label`` choices)."""


def is_label(v: Any) -> bool:
    """A label as ``run.json`` stores it: one of :data:`LABELS`."""
    return isinstance(v, str) and v in LABELS
