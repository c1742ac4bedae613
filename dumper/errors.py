"""Exceptions shared by the dumper and the comparator.

Two roots, as Polygraphy does it: :class:`DriftscopeError` is a *user* error (bad input,
a broken dump, bad arguments) that the CLIs turn into one line on stderr and a distinct
exit code; :class:`InternalError` is a bug in driftscope and is deliberately not its
subclass. The CLIs report it, and any other unexpected exception, as one line asking for a
bug report and exit :data:`EXIT_INTERNAL` (the traceback only with ``--debug`` or
``DRIFTSCOPE_DEBUG=1``), so a crash never reads as a divergence.
"""

from __future__ import annotations

__all__ = [
    "DriftscopeError",
    "UsageError",
    "DumpError",
    "IncompleteDumpError",
    "CorruptDumpError",
    "NotComparableError",
    "ModelMismatchError",
    "ModelError",
    "InternalError",
    "EXIT_OK",
    "EXIT_DIVERGED",
    "EXIT_UNUSABLE",
    "EXIT_INTERNAL",
    "error_reason",
]

EXIT_OK = 0
"""Every matched tensor passed."""
EXIT_DIVERGED = 1
"""At least one matched tensor diverged."""
EXIT_UNUSABLE = 2
"""The input cannot be used: bad arguments, a broken dump, nothing to compare."""
EXIT_INTERNAL = 3
"""A bug in driftscope: an exception that is not a :class:`DriftscopeError`."""


class DriftscopeError(Exception):
    """An error the user can act on; the CLIs print ``str(err)`` and exit with ``exit_code``."""

    exit_code: int = EXIT_UNUSABLE


class UsageError(DriftscopeError):
    """Bad arguments or options."""


class DumpError(DriftscopeError):
    """A dump directory cannot be read or written."""


class IncompleteDumpError(DumpError):
    """A dump directory without its manifest: the run never finished."""


class CorruptDumpError(DumpError):
    """A dump whose manifest or tensor files are unreadable, truncated or inconsistent."""


class ModelError(DriftscopeError):
    """A model cannot be loaded or run: a broken config, an unsupported architecture, a failing forward."""


class NotComparableError(DriftscopeError):
    """Two dumps cannot be compared: nothing matched, or shapes cannot be aligned."""


class ModelMismatchError(NotComparableError):
    """The two dumps come from different models (architecture, sizes or config differ)."""


class InternalError(RuntimeError):
    """A bug in driftscope (not a user error): the CLIs exit :data:`EXIT_INTERNAL` on it."""


def error_reason(e: BaseException) -> str:
    """One line for an exception raised by model code: its type and its message, joined and cut to 300 characters."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
