"""pytest plugin: count the real engine starts of a session and hold every test that starts one to
``@pytest.mark.engine`` (the markers themselves are registered in ``pyproject.toml``).

At start-up the plugin names a log file in ``DRIFTSCOPE_TEST_ENGINE_LOG`` and puts
``tests/vllm_seed`` (whose ``sitecustomize.py`` writes the log, see ``engine_log.py`` there)
first on ``PYTHONPATH``; subprocesses built with :func:`tests.conftest.subprocess_env` keep it.
After each test, the starts it made (in any process) are read back: a test without the
``engine`` marker that started one fails, so the quick tier (``-m "not engine and not slow"``)
stays free of engine starts. A test that skips for want of CUDA without the ``gpu`` marker
fails too, so ``.ci/gpu-check`` (``-m gpu``) runs every CUDA-only test. The terminal summary
prints the starts and their seconds per engine and per module, so a change that adds starts
shows it. Under xdist (``-n 2``) every worker logs into the controller's file, which prints the summary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

SITE_DIR = Path(__file__).resolve().parent / "vllm_seed"
LOG_ENV = "DRIFTSCOPE_TEST_ENGINE_LOG"


class EngineStarts:
    """The session's log of engine starts and what was read of it so far."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.by_test = path, 0, defaultdict(list)

    def read_new(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(whole)
        for line in whole.decode().splitlines():
            rec = json.loads(line)
            self.by_test[rec["test"].rsplit(" (", 1)[0]].append(rec)

    def all(self) -> list[dict]:
        return [rec for recs in self.by_test.values() for rec in recs]


_KEY = pytest.StashKey[EngineStarts]()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") and os.environ.get(LOG_ENV):  # an xdist worker: the controller's log,
        log = Path(os.environ[LOG_ENV])  # where the summary reads every worker's starts
    else:
        log = Path(tempfile.mkdtemp(prefix="driftscope-engine-starts-")) / "starts.jsonl"
        os.environ[LOG_ENV] = str(log)  # this session's own, also inside a pytest run by a test
    path = os.environ.get("PYTHONPATH", "")
    if str(SITE_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), path) if p)
    config.stash[_KEY] = EngineStarts(log)
    # vLLM 0.32's CPU build saves an AOT-compiled graph it cannot load back ("'function' object has no attribute
    # 'finalize_loading'"), so every engine start compiled its graph again; its older compile cache (the same
    # graph through inductor, keyed by the same engine config) loads: ~10 s less per compiled start here.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    spec = importlib.util.spec_from_file_location("_driftscope_engine_log", SITE_DIR / "engine_log.py")
    engine_log = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_log)
    engine_log.install(engine_log.patches())  # starts in this process too (its sitecustomize ran before the log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if (
        report.skipped
        and "cuda" in str(report.longrepr).lower()
        and item.get_closest_marker("gpu") is None
        and not _has_cuda()
    ):
        report.outcome = "failed"  # .ci/gpu-check runs `-m gpu`: a CUDA-only test it would miss is a bug
        report.longrepr = f"{item.nodeid} skips for want of CUDA without @pytest.mark.gpu: mark it"
    if report.when != "teardown":
        return report
    starts = item.config.stash[_KEY]
    starts.read_new()
    mine = starts.by_test.get(item.nodeid, [])
    if mine and item.get_closest_marker("engine") is None and report.passed:
        engines = sorted({rec["engine"] for rec in mine})
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started {len(mine)} engine(s) ({', '.join(engines)}) without "
            "@pytest.mark.engine: mark it (or its module) so the quick tier leaves it out"
        )
    return report


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    starts = config.stash[_KEY]
    starts.read_new()
    recs = starts.all()
    write = terminalreporter.write_line
    total = sum(r["seconds"] for r in recs)
    terminalreporter.section("engine starts")
    write(f"{len(recs)} engine starts, {total:.1f} s in their constructors")
    per_engine, per_module = defaultdict(list), defaultdict(list)
    for r in recs:
        per_engine[r["engine"]].append(r["seconds"])
        per_module[r["test"].split("::", 1)[0] or "(outside a test)"].append(r["seconds"])
    for name, secs in sorted(per_engine.items()):
        write(f"  {name}: {len(secs)} starts, {sum(secs):.1f} s")
    for name, secs in sorted(per_module.items(), key=lambda kv: -sum(kv[1])):
        write(f"  {name}: {len(secs)} starts, {sum(secs):.1f} s")
