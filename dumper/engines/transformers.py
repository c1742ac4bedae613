"""The reference engine: HF transformers in this process (:func:`dumper.jobs.run.run_dump`)."""

from __future__ import annotations

from dumper.format import Manifest
from dumper.engines.base import check_engine_args
from dumper.progress import ProgressFn
from dumper.jobs.run import RunConfig
from dumper.jobs.run import run_dump as _run_dump

__all__ = ["run_dump"]


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Teacher-forced prefill under the hook API (see :func:`dumper.jobs.run.run_dump`)."""
    check_engine_args(cfg, {})
    return _run_dump(cfg, progress=progress)
