"""Errors of the run store: user errors (exit 2) with one actionable line."""

from __future__ import annotations

from comparator.store.environment import EnvDifference
from dumper.errors import DriftscopeError

__all__ = ["StoreError", "UnsafePathError", "CorruptRunError", "NoBaselineError", "EnvMismatchError"]


class StoreError(DriftscopeError):
    """A run store, or a run in it, cannot be read or written."""


class UnsafePathError(StoreError):
    """A path from a run record, a store listing or a manifest leaves the store (``..``, an
    absolute path, a symlink out), or names something that must not be opened (a directory
    where a file belongs, a FIFO, a device): refused, never followed."""


class CorruptRunError(StoreError):
    """A run whose folder, ``run.json`` or ``COMPLETE`` marker is unreadable or inconsistent."""


class NoBaselineError(StoreError):
    """No complete, non-failed run with the same model and capture signature exists."""


class EnvMismatchError(StoreError):
    """Comparable runs exist, but none from this environment (torch, CUDA, GPU, ...)."""

    def __init__(self, message: str, differences: tuple[EnvDifference, ...] = ()) -> None:
        super().__init__(message)
        self.differences = differences
