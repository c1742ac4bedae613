"""A progress bar for long work: on stderr, only on a terminal, only once the work has run for a second.

Short jobs and CI logs stay clean: nothing is drawn when stderr is not a TTY, when the caller
disables it (``--quiet``), or when the work ends within ``delay`` seconds. The bar is rich's
``Progress(transient=True)``, so it disappears once done and leaves the terminal as it was.

Example::

    from dumper.progress import progress_bar
    with progress_bar(True, "dumping", unit="tokens") as progress:
        for done in range(1, 101):
            work()
            progress(done, 100)          # ProgressFn: (done, total) -> None
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only where a bar may be drawn: a quiet or piped run never loads it
    from rich.console import Console
    from rich.progress import Progress

__all__ = ["ProgressFn", "progress_bar", "DELAY_S"]

ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``: ``done`` of ``total`` units finished."""

DELAY_S = 1.0
"""Seconds of work before a bar is drawn."""


def _noop(done: int, total: int) -> None:
    pass


class _LazyBar:
    """Records the latest (done, total); a timer draws the bar once ``delay`` has passed."""

    def __init__(self, console: Console, description: str, unit: str) -> None:
        self._lock = threading.Lock()
        self._state: tuple[int, int | None] = (0, None)
        self._bar: Progress | None = None
        self._task = None
        self._closed = False
        self._console, self._description, self._unit = console, description, unit

    def update(self, done: int, total: int) -> None:
        with self._lock:
            self._state = (done, total)
            if self._bar is not None:
                self._bar.update(self._task, completed=done, total=total)

    def start(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with self._lock:
            if self._closed:
                return
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(self._unit),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self._console,
                transient=True,
            )
            done, total = self._state
            self._task = self._bar.add_task(self._description, total=total, completed=done)
            self._bar.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._bar is not None:
                self._bar.stop()


@contextmanager
def progress_bar(
    enabled: bool, description: str, *, unit: str = "", delay: float = DELAY_S, console: Console | None = None
) -> Iterator[ProgressFn]:
    """Yield a :data:`ProgressFn` that drives a transient bar on stderr.

    Args:
        enabled: False (e.g. ``--quiet``) yields a function that does nothing.
        description: text left of the bar ("comparing", "dumping").
        unit: text after the ``done/total`` count ("tensors", "tokens").
        delay: seconds before the bar appears (default :data:`DELAY_S`); work that ends sooner
            draws nothing.
        console: where to draw (default: a stderr console); no bar unless it is a terminal.
    """
    if enabled and console is None:
        from rich.console import Console

        console = Console(file=sys.stderr)
    if not enabled or not console.is_terminal:
        yield _noop
        return
    bar = _LazyBar(console, description, unit)
    timer = threading.Timer(delay, bar.start)
    timer.daemon = True
    timer.start()
    try:
        yield bar.update
    finally:
        timer.cancel()
        bar.close()
