"""Run ids: ``<UTC time to the nanosecond>Z-<6 random hex digits>``, e.g. ``20261130T094716.302031123Z-a1b2c3``.

Fixed width, so ids sort by creation time, and two writers starting in the same nanosecond
still get different ids.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, timezone

__all__ = ["new_run_id", "is_run_id", "run_id_time"]

_RUN_ID = re.compile(r"(\d{8}T\d{6})\.(\d{9})Z-[0-9a-f]{6}", re.ASCII)


def new_run_id(now_ns: int | None = None) -> tuple[str, str]:
    """A fresh run id and its creation time as a UTC ISO string."""
    ns = time.time_ns() if now_ns is None else now_ns
    t = datetime.fromtimestamp(ns // 1_000_000_000, tz=timezone.utc)
    run_id = f"{t:%Y%m%dT%H%M%S}.{ns % 1_000_000_000:09d}Z-{os.urandom(3).hex()}"
    created = t.replace(microsecond=(ns % 1_000_000_000) // 1000).isoformat()
    return run_id, created


def is_run_id(name: object) -> bool:
    return isinstance(name, str) and _RUN_ID.fullmatch(name) is not None


def run_id_time(run_id: str) -> float | None:
    """Creation time (epoch seconds) encoded in a run id, or ``None`` for something else."""
    m = _RUN_ID.fullmatch(run_id)
    if m is None:
        return None
    t = datetime.strptime(m.group(1), "%Y%m%dT%H%M%S").replace(tzinfo=timezone.utc)
    return t.timestamp() + int(m.group(2)) / 1e9
