"""Run a bisection for real: each build's command in a shell, its dump judged as ``python -m comparator`` judges it.

A build's command is the ``--run`` template with ``{build}`` replaced by the build's line and
``{out}`` by a fresh dump directory under the work directory, both shell-quoted. Its output goes to
the build's log. The build is a **skip** when the command exits non-zero (named with its exit code
and the last line it printed), is killed at the timeout (with its whole process group), or leaves
no dump that compares; otherwise :func:`comparator.hidden.compare.compare_dumps` judges the dump
against the baseline with the caller's :class:`~comparator.config.CompareConfig`: good when the
report passes, bad when not.

The baseline is a dump directory, or a run store's current baseline (``store``): the run
:func:`comparator.store.select.select_baseline` picks for the first build's dump (its model, capture
signature and environment), judged with the noise stored with it. With a store, every judged build
is stored there labelled ``bisect`` with its build line (:class:`~comparator.store.Label`): ``store
ls`` lists them, and ``regress`` never takes one as a baseline unless it is promoted.

Example::

    from comparator.bisect.run import bisect_builds
    result = bisect_builds("dumps/gold", ["venv-a", "venv-b", "venv-c"],
                           "{build}/bin/python -m dumper run --out {out} --quiet", "bisect-work")
    result.first_bad, result.verdict["first_divergent"]
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from comparator.bisect.search import bisect
from comparator.bisect.state import Plan, log_path, open_work, out_dir, report_path, save_state
from comparator.bisect.types import BAD, GOOD, SKIP, BisectResult, BuildRun
from comparator.config import CompareConfig
from comparator.hidden.compare import compare_dumps
from comparator.hidden.types import Report
from comparator.outcome import headline
from comparator.store import Label, RunStore
from comparator.store.select import select_baseline
from comparator.store.types import RunSummary
from dumper.errors import DriftscopeError, UsageError
from dumper.format import Manifest, load_manifest, write_json_atomic
from dumper.format.files import printable

__all__ = ["render", "run_command", "bisect_builds"]

_LAST_LINE = 300


def render(template: str, build: str, out: Path) -> str:
    """The shell command of one build: ``{build}`` and ``{out}`` replaced, shell-quoted."""
    return template.replace("{build}", shlex.quote(build)).replace("{out}", shlex.quote(str(out)))


def _last_line(log: Path) -> str:
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
        lines = [x.strip() for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    return printable(lines[-1])[:_LAST_LINE] if lines else ""


def run_command(command: str, log: Path, timeout: float | None) -> tuple[int | None, str]:
    """Run ``command`` in a shell (its own process group), output to ``log``: (exit code or None at the timeout,
    the last line it printed). The whole group is killed at the timeout, and on an interrupt before re-raising."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            command, shell=True, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        except BaseException:
            _kill(proc)
            raise
        if code is None:
            _kill(proc)
    return code, _last_line(log)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class _Baseline:
    """The baseline: a dump directory, or chosen from a store for the first dump judged (then kept open)."""

    path: Path | None
    store: RunStore | None
    model: str | None
    run_id: str | None
    stack: contextlib.ExitStack
    allow_env_mismatch: bool = False
    cache_dir: str | None = None
    config: CompareConfig | None = None

    def resolve(self, manifest: Manifest, dump: Path, config: CompareConfig) -> tuple[Path, CompareConfig]:
        """The baseline's directory and the config to judge by (with a store's baseline, its stored noise).

        A store's baseline is chosen for ``manifest`` (the first judged dump's) once; no baseline there raises.
        """
        if self.path is not None:
            return self.path, self.config or config
        assert self.store is not None
        if self.run_id is None:
            model = self.model or manifest.model.get("name")
            base = select_baseline(
                self.store,
                str(model),
                manifest.capture_signature,
                manifest.environment,
                allow_env_mismatch=self.allow_env_mismatch,
            )
            if base is None:
                raise UsageError(
                    f"{self.store.url}: no baseline of model {model!r} with the capture signature of "
                    f"{dump}; bootstrap one with python -m comparator regress DUMP --store "
                    f"{self.store.url} --bootstrap"
                )
            self.run_id = base.run_id
        record = self.store.get(self.run_id)
        self.model = self.model or record.model
        noise = self.store.noise(record)
        self.path = self.stack.enter_context(self.store.local_dump(record.run_id, self.cache_dir))
        self.config = replace(config, noise=noise.noise if noise is not None else None)
        return self.path, self.config


@dataclass
class _Judge:
    """Runs and judges one build (``index -> BuildRun``), writing its log and report under the work directory."""

    plan: Plan
    work: Path
    baseline: _Baseline
    config: CompareConfig
    timeout: float | None

    def __call__(self, index: int) -> BuildRun:
        build, out = self.plan.builds[index], out_dir(self.work, index)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        code, last = run_command(render(self.plan.command, build, out), log_path(self.work, index), self.timeout)
        skip = lambda why: BuildRun(index, build, SKIP, code, time.perf_counter() - start, headline=why)  # noqa: E731
        if code is None:
            return skip(f"timed out after {self.timeout:g} s; last line: {last}")
        if code != 0:
            return skip(f"exit {code}: {last}")
        try:
            manifest = load_manifest(out)
        except DriftscopeError as e:
            return skip(f"no usable dump: {printable(str(e))[:_LAST_LINE]}")
        base, config = self.baseline.resolve(manifest, out, self.config)  # no baseline: the bisection stops
        try:
            report = compare_dumps(base, out, config)
        except DriftscopeError as e:
            return skip(f"no usable dump: {printable(str(e))[:_LAST_LINE]}")
        report = replace(report, baseline=str(base), target=str(out))
        report_path(self.work, index).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(report_path(self.work, index), report.to_json())
        fd = report.first_divergent
        run_id = self._store(out, report, build)
        return BuildRun(
            index,
            build,
            GOOD if report.passed else BAD,
            code,
            time.perf_counter() - start,
            first_divergent=None if fd is None else fd.to_json(),
            headline=headline(report),
            run_id=run_id,
        )

    def _store(self, out: Path, report: Report, build: str) -> str | None:
        st, b = self.baseline.store, self.baseline
        if st is None or b.model is None:
            return None
        rec = st.put(
            out,
            model=b.model,
            label=Label.BISECT,
            baseline_run=b.run_id,
            build=build,
            summary=RunSummary.of_report(report),
            report=report.to_json(),
        )
        return rec.run_id


def _read_builds(builds: Sequence[str]) -> tuple[str, ...]:
    out = tuple(builds)
    if any(not b or b != b.strip() or "\n" in b for b in out):
        raise UsageError("a build is one non-empty line without surrounding spaces")
    return out


def bisect_builds(
    baseline: str | os.PathLike[str] | None,
    builds: Sequence[str],
    command: str,
    work: str | os.PathLike[str],
    *,
    store: str | RunStore | None = None,
    model: str | None = None,
    config: CompareConfig | None = None,
    timeout: float | None = None,
    resume: bool = False,
    allow_env_mismatch: bool = False,
    cache_dir: str | None = None,
    on_run: Callable[[BuildRun, int], None] | None = None,
) -> BisectResult:
    """Bisect ``builds`` (oldest first) with ``command`` against ``baseline`` (a dump directory) or ``store``'s
    current baseline; judged builds are kept in ``work`` (and ``resume`` goes on from there). The result's
    ``verdict`` is the first bad build's whole report JSON."""
    if (baseline is None) == (store is None):
        raise UsageError("bisect judges against a baseline dump or a run store's baseline: give exactly one")
    if "{out}" not in command:
        raise UsageError(f"--run {command!r} has no {{out}}: each build's command must write its dump there")
    if timeout is not None and not timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout}")
    config = config or CompareConfig.resolve()
    st = (store if isinstance(store, RunStore) else RunStore(store)) if store is not None else None
    if baseline is not None:
        load_manifest(baseline)  # an unusable baseline is exit 2 before any build runs
    plan = Plan(_read_builds(builds), command, str(baseline) if baseline is not None else f"store {st.url}")  # type: ignore[union-attr]
    root = Path(work)
    done, run_id = open_work(root, plan, resume=resume)
    with contextlib.ExitStack() as stack:
        base = _Baseline(
            Path(baseline) if baseline is not None else None, st, model, run_id, stack, allow_env_mismatch, cache_dir
        )
        judge = _Judge(plan, root, base, config, timeout)
        tested = list(done.values())

        def ran(run: BuildRun, left: int) -> None:
            tested.append(run)
            save_state(root, plan, tested, base.run_id)
            if on_run is not None:
                on_run(run, left)

        result = bisect(plan.builds, judge, done=done, on_run=ran)
    verdict = None
    if result.first_bad is not None and report_path(root, result.first_bad).is_file():
        verdict = json.loads(report_path(root, result.first_bad).read_text(encoding="utf-8"))
    return replace(result, verdict=verdict)
