"""The calls that record into the active capture from anywhere: :func:`dump` and :func:`step`.

:class:`dumper.hooks.capture.Capture` makes itself active on entry and gives the place back on
exit (the slot is :mod:`dumper.hooks.current`, which the capture imports instead of this module,
so that this one may import the capture without a cycle). With none active, :func:`dump` costs one function call, unless
``DRIFTSCOPE_DUMP_DIR`` is set: then the first call starts a model-less capture into that
directory, written at interpreter exit.
"""

from __future__ import annotations

import atexit
import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dumper.errors import DriftscopeError, DumpError
from dumper.format import MANIFEST_NAME
from dumper.hooks import current
from dumper.settings import env_settings

if TYPE_CHECKING:
    import torch

    from dumper.hooks.capture import Capture

__all__ = ["dump", "step", "active_capture"]

_ENV_DIR: str | None = env_settings().dump_dir


def active_capture() -> Capture | None:
    """The capture that :func:`dump` records into now, if any (only a :class:`Capture` takes the slot)."""
    return cast("Capture | None", current.capture)


def _env_capture() -> Capture | None:
    """Start the capture that ``DRIFTSCOPE_DUMP_DIR`` asks for, once; ``None`` when it cannot start.

    It runs inside model code (the first :func:`dump` call), so it never raises there: a
    directory that already holds a dump gets a numbered sibling (``DIR.1``, ``DIR.2``, ... the
    first free one), and a directory that cannot be created turns recording off. Either is
    said once on stderr.
    """
    from dumper.hooks.capture import Capture  # torch: only once a dump is asked for
    from dumper.hooks.parts import dist_rank_world

    global _ENV_DIR
    assert _ENV_DIR is not None
    base, _ENV_DIR = Path(_ENV_DIR), None
    directory = _free_dump_dir(base, dist_rank_world()[0])
    if directory != base:
        print(f"driftscope: DRIFTSCOPE_DUMP_DIR={base} already holds a dump; recording to {directory}", file=sys.stderr)
    cap = Capture(None, directory)
    try:
        cap.__enter__()
    except DumpError as e:
        print(f"driftscope: DRIFTSCOPE_DUMP_DIR: {e}; dumper.dump() records nothing", file=sys.stderr)
        return None
    atexit.register(_close_env_capture, cap)
    return cap


def _free_dump_dir(base: Path, rank: int) -> Path:
    """``base``, or the first of ``base.1``, ``base.2``, ... that holds neither a manifest nor this rank's data."""
    if base.name in ("", ".", ".."):
        base = base.resolve()

    def taken(d: Path) -> bool:
        return (d / MANIFEST_NAME).exists() or next(d.glob(f"r{rank}-p*.safetensors"), None) is not None

    if not taken(base):
        return base
    return next(d for n in itertools.count(1) if not taken(d := base.with_name(f"{base.name}.{n}")))


def _close_env_capture(cap: Capture) -> None:
    """Write the ``DRIFTSCOPE_DUMP_DIR`` dump at interpreter exit; a failure is one line, not a traceback."""
    try:
        cap.close()
    except DriftscopeError as e:
        print(f"driftscope: DRIFTSCOPE_DUMP_DIR: {e}", file=sys.stderr)


def dump(name: str, tensor: torch.Tensor, **meta: Any) -> None:
    """Record ``tensor`` under ``name`` into the active capture (or ``DRIFTSCOPE_DUMP_DIR``).

    A no-op costing one function call when nothing is active. Keywords ``layer``, ``point``,
    ``positions``, ``sequence_ids`` (one per row of ``tensor`` viewed as ``[rows, last dim]``)
    and ``shard_dim`` (the dim this rank holds a slice of) are stored as metadata; other
    keywords as free meta. A ``[batch, seq, hidden]`` tensor recorded during a hooked forward
    pass inherits that pass's positions and sequence ids (reshape per-head tensors to
    ``[batch, seq, heads * head_dim]`` first; other shapes need explicit ``positions``).
    """
    cap = current.capture
    if cap is None:
        if _ENV_DIR is None:
            return
        cap = _env_capture()
        if cap is None:
            return
    cap.record(name, tensor, **meta)


def step() -> None:
    """End the active capture's current forward pass (for captures without a model)."""
    if current.capture is not None:
        current.capture.step()
