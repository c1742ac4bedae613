"""How a run is stored: its label (``baseline``, ``passed``, ``failed``, ``bisect``), and the one list of them.

Its own module, importing nothing, so that a parser offering ``--label`` choices loads no run
record machinery (:mod:`comparator.store.types` holds the rest of a record's typed parts).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["Label", "LABELS", "is_label"]


class Label(str, Enum):
    """How a run is stored: ``baseline`` (bootstrapped or promoted by a human), or its verdict against
    its baseline, ``passed`` or ``failed`` (a failed run is evidence, never selected as a baseline), or
    ``bisect``: a build a bisection tested (``python -m comparator bisect --store``, ``regress --git-bisect``),
    good or bad, never selected as a baseline unless a human promotes it (an old build is no baseline).

    A ``str``: ``Label.FAILED == "failed"``, and it prints and serializes as its value.
    """

    BASELINE = "baseline"
    PASSED = "passed"
    FAILED = "failed"
    BISECT = "bisect"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of_verdict(cls, passed: bool) -> Label:
        return cls.PASSED if passed else cls.FAILED

    @property
    def selectable(self) -> bool:
        """Whether a run of this label may become a baseline by itself (``baseline`` and ``passed`` runs)."""
        return self in (Label.BASELINE, Label.PASSED)


LABELS: tuple[str, ...] = tuple(label.value for label in Label)
"""The label values, in :class:`Label` order (``--label`` choices)."""


def is_label(v: Any) -> bool:
    """A label as ``run.json`` stores it: one of :data:`LABELS`."""
    return isinstance(v, str) and v in LABELS
