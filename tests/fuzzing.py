"""The harness every fuzz suite shares: hypothesis settings, an open/memory watch, the exit-code rules.

A fuzz case runs a CLI (in-process with :func:`run_main`, or in a child with :func:`run_child`)
on damaged input and checks what every surface promises (:func:`check_outcome`): exit 0, 1 or
2, never 3; no traceback; an exit 2 is one ``error:`` line; no control character reaches the
terminal; no file under a sentinel folder is opened; traced memory stays under :data:`LIMIT`.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

from tests.conftest import subprocess_env

LIMIT = 512 << 20
"""Peak memory (traced in-process, RSS in a child) a hostile input may cost."""
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
"""Derandomized (the same cases on every machine), no example database, no deadline."""

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # once per process; a no-op unless a case is recording


@dataclass
class Watched:
    """What one watched block did: the paths it opened and its traced peak memory."""

    opened: list[str] = field(default_factory=list)
    peak: int = 0

    def opened_under(self, folder: str | os.PathLike[str]) -> list[str]:
        root = os.path.realpath(folder)
        return [p for p in self.opened if os.path.realpath(p) == root or os.path.realpath(p).startswith(root + os.sep)]


@contextlib.contextmanager
def watch() -> Iterator[Watched]:
    """Record every path opened in the block (an audit hook) and its traced peak memory."""
    global _OPENED
    w = Watched()
    _OPENED = w.opened
    tracemalloc.start()
    try:
        yield w
    finally:
        w.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        _OPENED = None


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    watched: Watched


def run_main(main: Callable[[Sequence[str]], int], argv: Sequence[str | os.PathLike[str]]) -> Outcome:
    """Run a CLI's ``main(argv)`` in this process with stdout/stderr captured and the watch on."""
    out, err = io.StringIO(), io.StringIO()
    with watch() as w, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return Outcome(code, out.getvalue(), err.getvalue(), w)


def has_control(text: str) -> bool:
    """A character that would drive a terminal (ESC, BEL, ...): any control character but newline and tab."""
    return any((ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0 for c in text)


def check_outcome(o: Outcome, *, outside: str | os.PathLike[str] | None = None, limit: int = LIMIT) -> int:
    """Assert what every fuzz case promises and return the exit code."""
    text = o.err
    assert o.code in (0, 1, 2), (o.code, text)
    assert "Traceback" not in text and "internal error" not in text, text
    if o.code == 2:
        lines = text.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert not has_control(o.err) and not has_control(o.out), repr((o.out[-300:], o.err[-300:]))
    if outside is not None:
        leaked = o.watched.opened_under(outside)
        assert not leaked, leaked
    assert o.watched.peak < limit, o.watched.peak
    return o.code


_PEAK = (
    "import runpy, sys\nmodule = sys.argv.pop(1)\nsys.argv[0] = module\n"
    "try:\n    runpy.run_module(module, run_name='__main__')\n    rc = 0\n"
    "except SystemExit as e:\n    rc = e.code if isinstance(e.code, int) else 1\n"
    "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
    "print(f'peak-rss-kib {hwm.split()[1]}', file=sys.stderr)\nsys.exit(rc)\n"
)
"""``python -m MODULE ARGS`` that reports its peak RSS on the last stderr line (VmHWM: the high-water
mark of this image, not of the forked copy of the parent that ``ru_maxrss`` would also count)."""


def run_child(
    module: str,
    *args: str | os.PathLike[str],
    timeout: float = 300,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> tuple[int, str, int]:
    """(exit code, stderr without the report line, peak RSS in bytes) of ``python -m module args`` in a child."""
    r = subprocess.run(
        [sys.executable, "-c", _PEAK, module, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        env=subprocess_env(**(env or {})),
    )
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("peak-rss-kib "), r.stderr
    return r.returncode, "\n".join(lines[:-1]), int(lines[-1].split()[1]) * 1024


def json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a parsed JSON ``obj`` (keys and list indices), parents first."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(json_paths(v, prefix + (k,)))
    return out


def get_path(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def set_path(obj: Any, path: tuple, value: Any) -> None:
    get_path(obj, path[:-1])[path[-1]] = value


class Hung(BaseException):
    """Raised by :func:`deadline`: not an Exception, so no ``except Exception`` of library code swallows it
    (a CLI's last guard reports it as an internal error, exit 3: a failed case, never a pass)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block (a blocking open or read included) after ``seconds``."""

    def ring(_signum: int, _frame: Any) -> None:
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` with its bytes: to check that a case changed nothing stored."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def edit_stored(path: Path, key: str, dtype: Any, edit: Callable[[Any], None]) -> None:
    """Edit the values of tensor ``key`` of safetensors file ``path`` in place, as numpy ``dtype`` (flat): the file
    keeps its size and header, so a dump's manifest still vouches for it and only those values are wrong."""
    import json

    import numpy as np

    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    values = np.frombuffer(bytes(raw[8 + n + begin : 8 + n + end]), dtype).copy()
    edit(values)
    raw[8 + n + begin : 8 + n + end] = values.tobytes()
    path.write_bytes(bytes(raw))
