"""The reference engine: HF transformers in this process (:func:`dumper.run.run_dump`)."""

from __future__ import annotations

from ..format import Manifest
from .base import check_engine_args
from ..progress import ProgressFn
from ..run import RunConfig
from ..run import run_dump as _run_dump

__all__ = ["run_dump"]


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Teacher-forced prefill under the hook API (see :func:`dumper.run.run_dump`)."""
    check_engine_args(cfg, {})
    return _run_dump(cfg, progress=progress)
