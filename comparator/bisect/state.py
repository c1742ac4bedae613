"""The work directory of a bisection: each build's dump, log and report, and the state ``--resume`` reads.

Layout of ``--work DIR``::

    DIR/bisect.json            the plan (builds, command, baseline) and every judged build, rewritten
                               atomically after each run: an interrupted bisection loses the run in flight only
    DIR/runs/007/              build 7's dump (``{out}``), made afresh before its command runs
    DIR/logs/007.log           what its command printed (stdout and stderr)
    DIR/reports/007.json       its report against the baseline (a judged build)

A state file is read as untrusted input: a field of the wrong type, or a plan that differs from the
one asked for (other builds, command or baseline), is one line and exit 2, never a silent restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comparator.bisect.types import BuildRun
from dumper.errors import UsageError
from dumper.format import write_json_atomic
from dumper.format.files import printable

__all__ = ["STATE_NAME", "Plan", "open_work", "save_state", "out_dir", "log_path", "report_path"]

STATE_NAME = "bisect.json"
_VERSION = 1
_MAX_STATE_BYTES = 64 << 20


@dataclass(frozen=True)
class Plan:
    """What a bisection is: the builds in order, the command template, and the baseline it judges against."""

    builds: tuple[str, ...]
    command: str
    baseline: str
    """The baseline dump directory, or ``store URL`` (the store's run id is added once it is chosen)."""

    def fields(self) -> dict[str, Any]:
        """The plan as the state file holds it (a resumed bisection must have the same)."""
        return {"builds": list(self.builds), "command": self.command, "baseline": self.baseline}


def out_dir(work: Path, index: int) -> Path:
    return work / "runs" / f"{index:03d}"


def log_path(work: Path, index: int) -> Path:
    return work / "logs" / f"{index:03d}.log"


def report_path(work: Path, index: int) -> Path:
    return work / "reports" / f"{index:03d}.json"


def save_state(work: Path, plan: Plan, tested: list[BuildRun], baseline_run: str | None = None) -> None:
    """Write the state (atomically): the plan, the store baseline chosen (if any) and every judged build."""
    write_json_atomic(
        work / STATE_NAME,
        {"version": _VERSION, **plan.fields(), "baseline_run": baseline_run, "tested": [r.to_json() for r in tested]},
    )


def _load(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > _MAX_STATE_BYTES:
            raise UsageError(f"{path}: {path.stat().st_size} bytes, too large for a bisection state")
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a bisection state ({e})") from None
    if not isinstance(d, dict) or d.get("version") != _VERSION or not isinstance(d.get("tested"), list):
        raise UsageError(f"{path}: not a bisection state of this driftscope (version {_VERSION})")
    return d


def _resumed(path: Path, d: dict[str, Any], plan: Plan) -> tuple[dict[int, BuildRun], str | None]:
    for key, want in plan.fields().items():
        if d.get(key) != want:
            raise UsageError(
                f"{path}: the bisection there has other {key} than this one asks for; resume it with "
                f"the same --builds, --run and baseline, or choose another --work"
            )
    done: dict[int, BuildRun] = {}
    for item in d["tested"]:
        try:
            run = BuildRun.from_json(item)
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"{path}: a tested build that does not read ({printable(str(e))[:200]})") from None
        if not 0 <= run.index < len(plan.builds) or plan.builds[run.index] != run.build or run.index in done:
            raise UsageError(f"{path}: tested build {run.index} is not build {run.index} of this bisection")
        done[run.index] = run
    run_id = d.get("baseline_run")
    return done, run_id if isinstance(run_id, str) else None


def open_work(work: Path, plan: Plan, *, resume: bool) -> tuple[dict[int, BuildRun], str | None]:
    """The builds judged so far and the store baseline chosen (``--resume``), or a fresh work directory.

    A work directory that holds a bisection is refused without ``resume`` (its runs would be lost),
    and ``resume`` without one is refused too.
    """
    path = work / STATE_NAME
    if path.is_file():
        if not resume:
            raise UsageError(
                f"{work}: holds a bisection already ({STATE_NAME}); pass --resume to go on with it, "
                "or choose another --work"
            )
        return _resumed(path, _load(path), plan)
    if resume:
        raise UsageError(f"{work}: no bisection to resume (no {STATE_NAME})")
    work.mkdir(parents=True, exist_ok=True)
    save_state(work, plan, [])
    return {}, None
