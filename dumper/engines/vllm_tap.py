"""driftscope's tap inside vLLM: installed by vLLM's own model loader, before vLLM compiles the model.

vLLM compiles its model (torch.compile; CUDA graphs on a GPU) during engine start-up, so a
capture has to be in the model before that: :func:`register`, a ``vllm.general_plugins``
entry point that vLLM loads in every process it starts (the engine core, each TP worker),
wraps the model loader so that a model loaded with

    additional_config={"driftscope": {"layers": "all"}}        # LLM(...), or
    vllm serve CKPT --additional-config '{"driftscope": {"layers": "all"}}'

gets the tap (:mod:`dumper.hooks.tap`) at the chosen layers, sized by the engine's token
budget per step (``max_num_batched_tokens``). ``additional_config`` is part of vLLM's compile
cache key, so a tapped and an untapped engine never share a compiled graph. Without the
``driftscope`` key the loader is unchanged and nothing is tapped.

Keys of ``additional_config["driftscope"]``: ``layers`` (a layer spec, default
:data:`~dumper.hooks.layers.DEFAULT_LAYERS`) and ``points`` (default ``input``). With
``DRIFTSCOPE_VLLM_SPOOL`` set as well, the tapped model records the requests driftscope's client
marks, in whichever process it runs (:mod:`dumper.engines.vllm_spool`), and an entry the model
refuses is also left in that directory, for the client that started the engine to raise
(:func:`take_load_failure`): vLLM reports a failed engine process only as "initialization failed".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dumper import errors
from dumper.errors import DriftscopeError, UsageError
from dumper.settings import env_settings

__all__ = ["TAP_KEY", "register", "tap_config", "tap_spec", "install_engine_tap", "take_load_failure"]

TAP_KEY = "driftscope"
"""The ``additional_config`` key that asks vLLM's loader for the tap."""
_KEYS = ("layers", "points")
_PATCHED = "_driftscope_tap_loader"
_FAILED = "tap-failed-"
"""Name prefix of the file a vLLM process leaves in the spool root when the tap refused its model."""
_LOG = logging.getLogger("vllm.driftscope")
"""A child of vLLM's logger: printed by vLLM's handler, at vLLM's level (``VLLM_LOGGING_LEVEL``)."""


def tap_config(layers: str | Sequence[int] | None, points: str | Sequence[str] | None = None) -> dict[str, Any]:
    """The ``additional_config`` entry that taps ``layers`` (and ``points``) of the model vLLM loads."""
    spec: dict[str, Any] = {"layers": layers if isinstance(layers, str) or layers is None else [int(i) for i in layers]}
    if points is not None:
        spec["points"] = points if isinstance(points, str) else list(points)
    return {TAP_KEY: {k: v for k, v in spec.items() if v is not None}}


def tap_spec(additional_config: Any) -> dict[str, Any] | None:
    """The checked ``driftscope`` entry of a vLLM ``additional_config`` (``None``: no tap asked for)."""
    if not isinstance(additional_config, dict) or TAP_KEY not in additional_config:
        return None
    spec = additional_config[TAP_KEY]
    if not isinstance(spec, dict):
        raise UsageError(f"additional_config {TAP_KEY!r}: expected an object with keys {', '.join(_KEYS)}, "
                         f"got {str(spec)[:80]!r}")
    unknown = sorted(str(k) for k in spec if k not in _KEYS)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UsageError(f"additional_config {TAP_KEY!r}: unknown key {unknown[0][:40]!r}{more}; "
                         f"it takes {', '.join(_KEYS)}")
    for key in _KEYS:
        value = spec.get(key)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, list) and all(type(v) is (int if key == "layers" else str) for v in value)):
            raise UsageError(f"additional_config {TAP_KEY!r}.{key}: expected a spec string or a list, got {value!r}")
    return spec


def install_engine_tap(model: Any, vllm_config: Any, spec: dict[str, Any]) -> Any:
    """Tap ``model`` as ``spec`` says, with room for the engine's token budget per step.

    Logs one INFO line through vLLM's logger (``VLLM_LOGGING_LEVEL=INFO`` shows it), so that the
    tap of an engine in another process can be seen; a spec the model refuses (a layer out of
    range) is a :class:`UsageError` naming the ``additional_config`` entry.
    """
    from dumper.engines.vllm_hooks import VllmFamily
    from dumper.hooks.tap import install_tap

    budget = int(vllm_config.scheduler_config.max_num_batched_tokens)
    try:
        tap = install_tap(model, layers=spec.get("layers"), points=spec.get("points"), max_tokens=budget,
                          family=VllmFamily(model))
    except UsageError as e:
        raise UsageError(f"additional_config {TAP_KEY!r}: {e}") from None
    _LOG.info("driftscope: tapped %d points of %s (%.1f MiB sink, budget %d tokens)", len(tap.points),
              type(model).__name__, tap.nbytes / 2**20, budget)
    return tap


def _leave_load_failure(e: DriftscopeError) -> None:
    """Write ``e`` into the spool root (``DRIFTSCOPE_VLLM_SPOOL``), where the client that started this engine reads it."""
    root = env_settings().vllm_spool
    if root and Path(root).is_dir():
        try:
            (Path(root) / f"{_FAILED}{os.getpid()}.json").write_text(
                json.dumps({"type": type(e).__name__, "message": str(e)[:1000]}))
        except OSError:  # the error is in vLLM's log all the same
            pass


def take_load_failure(root: Path) -> DriftscopeError | None:
    """The error the tap raised in a vLLM process whose spool root is ``root`` (None: none); every such file is removed.

    Called before an engine starts (to drop what an earlier one left) and after it failed to start.
    """
    found: DriftscopeError | None = None
    for path in sorted(root.glob(f"{_FAILED}*.json")):
        try:
            d = json.loads(path.read_text())
            kind = getattr(errors, str(d["type"]), None)
            kind = kind if isinstance(kind, type) and issubclass(kind, DriftscopeError) else errors.ModelError
            found = found or kind(" ".join(str(d["message"]).split()))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        path.unlink(missing_ok=True)
    return found


def register() -> None:
    """The ``vllm.general_plugins`` entry point: wrap vLLM's model loader (once per process)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, _PATCHED, False):
        return

    def load_model(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = original(self, vllm_config, model_config, prefix)
        try:
            spec = tap_spec(getattr(vllm_config, "additional_config", None))
            if spec is not None and model_config is vllm_config.model_config:  # the served model, not a drafter
                install_engine_tap(model, vllm_config, spec)
                from dumper.engines.vllm_spool import install_recorder

                install_recorder(model, spec, vllm_config)  # with DRIFTSCOPE_VLLM_SPOOL set: record marked requests
        except DriftscopeError as e:
            _leave_load_failure(e)
            raise
        return model

    setattr(load_model, _PATCHED, True)
    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]
