"""Errors of the run store: user errors (exit 2) with one actionable line."""

from __future__ import annotations

from dumper.errors import DriftscopeError

from .environment import EnvDifference

__all__ = ["StoreError", "NoBaselineError", "EnvMismatchError"]


class StoreError(DriftscopeError):
    """A run store, or a run in it, cannot be read or written."""


class NoBaselineError(StoreError):
    """No complete, non-failed run with the same model and capture signature exists."""


class EnvMismatchError(StoreError):
    """Comparable runs exist, but none from this environment (torch, CUDA, GPU, ...)."""

    def __init__(self, message: str, differences: tuple[EnvDifference, ...] = ()) -> None:
        super().__init__(message)
        self.differences = differences
