"""What both CLIs share: an argument parser whose errors are one line, and the error-to-exit mapping."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .errors import EXIT_UNUSABLE, DriftscopeError, UsageError

__all__ = ["Parser", "guarded_main"]


class Parser(argparse.ArgumentParser):
    """``argparse`` that raises :class:`UsageError` (one line, exit 2) instead of printing usage."""

    def error(self, message: str) -> None:
        raise UsageError(f"{self.prog}: {message}")


def guarded_main(run: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call ``run(argv)``; user errors become one line on stderr and their exit code, no traceback."""
    try:
        return run(argv)
    except DriftscopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
