"""The slot of the capture that records now: set by a capture, read by :func:`dumper.hooks.active.dump`.

:class:`dumper.hooks.capture.Capture` takes the slot on entry (:func:`activate`) and gives it
back on exit; :mod:`dumper.hooks.active` reads :data:`capture` on every ``dump()`` call. This
module imports neither of them, so the capture imports it and the active API imports the
capture (to start the ``DRIFTSCOPE_DUMP_DIR`` one) without an import cycle.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Recorder", "activate", "capture"]


class Recorder(Protocol):
    """What the slot holds: what ``dump()`` and ``step()`` call on the active capture."""

    def record(self, name: str, tensor: Any, **meta: Any) -> None: ...

    def step(self) -> None: ...


capture: Recorder | None = None
"""The active capture (``None``: none); read as an attribute, so an idle ``dump()`` costs one call."""


def activate(cap: Recorder | None) -> Recorder | None:
    """Make ``cap`` the capture ``dump()`` records into (``None``: none); return the one it replaces."""
    global capture
    prev, capture = capture, cap
    return prev
