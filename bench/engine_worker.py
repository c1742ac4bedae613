"""Engines in worker subprocesses for the benchmarks: one engine per process, driven by JSON lines.

A benchmark script runs itself as the worker (``python bench_x.py --worker SPEC``): the worker starts
its engine, answers with :func:`reply` (``{"start": seconds}`` first), then serves one JSON request per
stdin line. The parent holds each worker as a :class:`Worker` (its stderr in ``logs/NAME.log``), so several
engines start side by side and each request's time is measured inside the worker, not across the pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["MARK", "reply", "Worker"]

MARK = "@@bench "
"""Prefix of a worker's answers on its stdout."""
ROOT = Path(__file__).resolve().parents[1]


def reply(obj: dict[str, Any]) -> None:
    """Answer the parent (in the worker)."""
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    """A worker subprocess of ``script`` holding one engine (its stderr in ``logs/NAME.log``)."""

    def __init__(self, name: str, spec: dict[str, Any], logs: Path, script: str | Path) -> None:
        self.name = name
        logs.mkdir(parents=True, exist_ok=True)
        self.log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--worker", json.dumps(spec)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
            cwd=ROOT,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self.start_s: float | None = None
        self.error: str | None = None

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                res = json.loads(line[len(MARK) :])
                if "error" in res:
                    raise RuntimeError(f"{self.name}: {res['error']}\n{res.get('trace', '')}")
                return res
        raise RuntimeError(f"{self.name}: worker exited with {self.proc.wait()} (see {self.log.name})")

    def ready(self) -> bool:
        try:
            self.start_s = self.read()["start"]
        except RuntimeError as e:
            self.error = str(e).splitlines()[0]
            print(f"engine {self.name} FAILED to start: {e}", flush=True)
        return self.error is None

    def run(self, op: str, **req: Any) -> dict[str, Any]:
        """Send request ``op`` (paths as strings) and return the worker's answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps({"op": op, **{k: str(v) if isinstance(v, Path) else v for k, v in req.items()}}) + "\n"
        )
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
