"""Hold what an engine writes to stderr, so that a start or a run that fails ends in driftscope's one line.

An engine that starts processes of its own (vLLM's engine core, its workers, Ray's actors) has
them print their tracebacks to the stderr they inherit: a tap refused inside a worker reaches
the terminal as a page of vLLM's and Ray's tracebacks above driftscope's one-line error.
:func:`held_stderr` points file descriptor 2 at a pipe while the engine starts, so that this
process and every process started meanwhile write there; a thread reads the pipe. A start that
succeeds has what was held written out, and everything after passes through as it comes. A start
that raises drops it (written out under ``--debug`` / ``DRIFTSCOPE_DEBUG=1``), as the CLIs drop a
failed run's warnings (:func:`dumper.cli.common.guarded_main`).

The engine's processes keep writing to the start's pipe: a later block given that :class:`Relay`
holds it again, with this process's fd 2, and ends it as its own. A run whose engine died (a
worker killed mid-capture) shuts the engine down inside such a block: what the survivors print
while they fail and stop (the engine core's traceback) is dropped with the block's error, never
printed after driftscope's line, however the processes' and this process's timing falls.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from dumper.settings import env_settings

__all__ = ["Relay", "held_stderr"]


class Relay:
    """Drains the pipe: holds its text, then writes it to ``target`` (pass), or drops it (drop)."""

    def __init__(self, read_fd: int, target: int) -> None:
        self.read_fd, self.target = read_fd, target
        self.mode, self.held = "hold", bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="driftscope-held-stderr", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except OSError:
                return
            if not chunk:  # every writer gone
                os.close(self.read_fd)
                return
            with self.lock:
                if self.mode == "hold":
                    self.held += chunk
                elif self.mode == "pass":
                    self._write(chunk)

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            os.write(self.target, data)

    def hold(self) -> None:
        """Hold again what comes from now on, after :meth:`end` passed it (dropped stays dropped)."""
        with self.lock:
            if self.mode == "pass":
                self.mode = "hold"

    def end(self, mode: str) -> None:
        """Stop holding: write what was held and pass the rest (``pass``), or drop both (``drop``)."""
        with self.lock:
            if mode == "pass" and self.mode != "drop":
                self._write(bytes(self.held))
            if self.mode != "drop":
                self.mode, self.held = mode, bytearray()


@contextlib.contextmanager
def held_stderr(engine: Relay | None = None) -> Iterator[Relay]:
    """Hold fd 2 of this process, and of the processes it starts in the block, until the block ends (see above).

    Yields the block's relay, which the processes started in it keep writing to; ``engine``, such a relay
    of an earlier block (an engine's start), is held for this block too and ended as it is.
    """
    sys.stderr.flush()
    saved = os.dup(2)  # kept open: the relay writes the engine's later output there
    read_fd, write_fd = os.pipe()
    relay = Relay(read_fd, saved)
    if engine is not None:
        engine.hold()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    ok = False
    try:
        yield relay
        ok = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # this process writes to the real stderr again; its children keep the pipe
        mode = "pass" if ok or env_settings().debug else "drop"
        for held in (relay, engine):
            if held is not None:
                held.end(mode)
