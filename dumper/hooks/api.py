"""The hook API's entry point: :func:`capture` into a local dump directory or an fsspec URL.

A local directory gets a :class:`~dumper.hooks.capture.Capture`; a URL (``s3://bucket/prefix``)
a :class:`~dumper.hooks.remote.RemoteCapture`, which stages locally and sends each rank's files
there, the manifest last.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dumper.errors import UsageError
from dumper.format.sketch import SketchSpec
from dumper.hooks.capture import Capture
from dumper.hooks.remote import capture_class

__all__ = ["capture"]


def capture(
    model: nn.Module | Any | None,
    out_dir: str | Path,
    *,
    layers: str | Sequence[int] | None = None,
    modules: str | None = None,
    points: str | Sequence[str] | None = None,
    model_name: str | None = None,
    shard_bytes: int = 512 << 20,
    extra: dict[str, Any] | None = None,
    sketch: int | None = None,
    sketch_seed: int | None = None,
) -> Capture:
    """Capture self-attention inputs (and, with ``points``, residual streams) of ``model`` into ``out_dir``.

    Args:
        model: a HF causal LM (decoder layers found automatically), a vLLM model or ``vllm.LLM`` in this process
            (:mod:`dumper.engines.vllm.hooks`), a model of a family in :mod:`dumper.hooks.families`, any module
            with ``modules=`` given, or ``None`` to record only explicit :func:`dumper.dump` calls.
        out_dir: the dump directory, or an fsspec URL (:mod:`dumper.hooks.remote`); it must not already hold a dump.
        layers: layer spec (default ``"first,last,every:8"``), see :func:`dumper.hooks.layers.parse_layer_spec`.
        modules: fnmatch pattern(s) of module names to hook instead of the self-attention modules.
        points: capture points (:mod:`dumper.format.points`), default ``("input",)``: also ``"residual"``,
            ``"attn_output"``, ``"mlp_input"``, ``"mlp_output"`` (inside a layer) and ``"router"``.
        model_name: the model's name or path, recorded in the manifest. extra: free-form JSON metadata stored in
            the manifest (e.g. the prompts). shard_bytes: largest data file before a pass is split into shards.
        sketch: store rows as ``sketch``-dim seeded projections and exact squared norms (:mod:`dumper.format.sketch`).
    """
    if sketch is None and sketch_seed is not None:
        raise UsageError("capture(sketch_seed=...) needs sketch=K")
    spec = SketchSpec(k=sketch, seed=sketch_seed or 0) if sketch is not None else None
    return capture_class(out_dir)(
        model,
        out_dir,
        layers=layers,
        modules=modules,
        points=points,
        model_name=model_name,
        shard_bytes=shard_bytes,
        extra=extra,
        sketch=spec,
    )
