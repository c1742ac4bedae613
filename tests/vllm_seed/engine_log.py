"""Test-only record of every engine start in the processes a test session spawns.

The session's plugin (``tests/engine_starts.py``) names a file in ``DRIFTSCOPE_TEST_ENGINE_LOG``;
``sitecustomize.py`` beside this file (on the ``PYTHONPATH`` of every subprocess a test starts)
wraps the engines' constructors as their modules are imported, and each start appends one JSON
line: the engine, the test that started it (``PYTEST_CURRENT_TEST``, which subprocesses
inherit), the seconds its constructor took (load, compile, KV-cache profiling) and whether it
succeeded. An append of one short line is atomic, so concurrent processes interleave whole lines.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

LOG_ENV = "DRIFTSCOPE_TEST_ENGINE_LOG"


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` is first executed (vLLM is never imported here)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches, self._finding = patches, set()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.patches or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.discard(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patches[name]

        def patched_exec(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = patched_exec  # this module's own loader instance
        return spec


def install(patches: dict[str, Callable[[Any], None]]) -> None:
    """Run each patch when its module is imported (now, for one already imported)."""
    later = {}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            later[name] = patch
    if later:
        sys.meta_path.insert(0, PatchOnImport(later))


def _record(engine: str, seconds: float, ok: bool) -> None:
    line = (
        json.dumps(
            {
                "engine": engine,
                "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                "seconds": seconds,
                "ok": ok,
                "pid": os.getpid(),
            }
        )
        + "\n"
    )
    fd = os.open(os.environ[LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _timed(engine: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "_driftscope_engine_log", False):  # patched already (sitecustomize, then the plugin)
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, ok = time.perf_counter(), False
        try:
            out = fn(*args, **kwargs)
            ok = True
            return out
        finally:
            _record(engine, time.perf_counter() - start, ok)

    wrapper._driftscope_engine_log = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_init(cls_name: str, engine: str) -> Callable[[Any], None]:
    def patch(module: Any) -> None:
        cls = getattr(module, cls_name)
        cls.__init__ = _timed(engine, cls.__init__)

    return patch


def _wrap_factory(name: str, engine: str) -> Callable[[Any], None]:
    def patch(module: Any) -> None:  # a compiled class or a C function: the module attribute becomes a timed wrapper
        setattr(module, name, _timed(engine, getattr(module, name)))

    return patch


def patches() -> dict[str, Callable[[Any], None]]:
    """Module name -> patch run right after it is imported; empty when no session asked for the log."""
    if not os.environ.get(LOG_ENV):
        return {}
    return {
        "vllm.v1.engine.core": _wrap_init("EngineCore", "vllm"),  # one per engine, in-process or in its own core
        # every model load, through Llama or the low-level API (dumper's ggml graph reader)
        "llama_cpp.llama_cpp": _wrap_factory("llama_model_load_from_file", "llama.cpp"),
        "onnxruntime_genai": _wrap_factory("Model", "onnxruntime-genai"),
    }
