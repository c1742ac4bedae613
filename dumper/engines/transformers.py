"""The reference engine: HF transformers in this process (:func:`dumper.prefill.run.run_dump`)."""

from __future__ import annotations

from dumper.engines.base import EngineArg, check_engine_args
from dumper.format import Manifest
from dumper.prefill.run import RunConfig
from dumper.prefill.run import run_dump as _run_dump
from dumper.progress import ProgressFn

__all__ = ["ENGINE_ARGS", "run_dump"]

ENGINE_ARGS: dict[str, EngineArg] = {}
"""``--engine transformers`` takes no ``--engine-arg``: its settings are ``run``'s own options."""


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Teacher-forced prefill under the hook API (see :func:`dumper.prefill.run.run_dump`)."""
    check_engine_args(cfg, ENGINE_ARGS)
    return _run_dump(cfg, progress=progress)
