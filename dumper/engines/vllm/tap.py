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
marks, in whichever process it runs (:mod:`dumper.engines.vllm.spool`), and an entry the model
refuses is also left in that directory, for the client that started the engine to raise
(:func:`take_load_failure`): vLLM reports a failed engine process only as "initialization failed".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dumper import errors
from dumper.engines.vllm.hooks import VllmFamily
from dumper.errors import DriftscopeError, UsageError
from dumper.format import ROUTER_POINT
from dumper.format.remote import is_url, listed, read_small, remove_prefix, write_small
from dumper.format.sketch import SketchSpec
from dumper.hooks.layers import find_decoder_layers, parse_layer_spec
from dumper.hooks.router_tap import PROBE_NAME, RouterEntry, RouterProbe, RouterTap
from dumper.settings import env_settings

__all__ = [
    "TAP_KEY",
    "register",
    "tap_config",
    "tap_spec",
    "install_engine_tap",
    "take_load_failure",
    "split_points",
    "sketch_of",
    "install_router_tap",
    "router_tap_of",
    "moe_layers",
]

TAP_KEY = "driftscope"
"""The ``additional_config`` key that asks vLLM's loader for the tap."""
_KEYS = ("layers", "points", "sketch")
_PATCHED = "_driftscope_tap_loader"
_FAILED = "tap-failed-"
"""Name prefix of the file a vLLM process leaves in the spool root when the tap refused its model."""
_LOG = logging.getLogger("vllm.driftscope")
"""A child of vLLM's logger: printed by vLLM's handler, at vLLM's level (``VLLM_LOGGING_LEVEL``)."""


def tap_config(
    layers: str | Sequence[int] | None, points: str | Sequence[str] | None = None, *, sketch: SketchSpec | None = None
) -> dict[str, Any]:
    """The ``additional_config`` entry that taps ``layers`` (and ``points``, stored as ``sketch``) of the model vLLM
    loads."""
    spec: dict[str, Any] = {"layers": layers if isinstance(layers, str) or layers is None else [int(i) for i in layers]}
    if points is not None:
        spec["points"] = points if isinstance(points, str) else list(points)
    if sketch is not None:
        spec["sketch"] = sketch.to_json()
    return {TAP_KEY: {k: v for k, v in spec.items() if v is not None}}


def tap_spec(additional_config: Any) -> dict[str, Any] | None:
    """The checked ``driftscope`` entry of a vLLM ``additional_config`` (``None``: no tap asked for)."""
    if not isinstance(additional_config, dict) or TAP_KEY not in additional_config:
        return None
    spec = additional_config[TAP_KEY]
    if not isinstance(spec, dict):
        raise UsageError(
            f"additional_config {TAP_KEY!r}: expected an object with keys {', '.join(_KEYS)}, got {str(spec)[:80]!r}"
        )
    unknown = sorted(str(k) for k in spec if k not in _KEYS)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UsageError(
            f"additional_config {TAP_KEY!r}: unknown key {unknown[0][:40]!r}{more}; it takes {', '.join(_KEYS)}"
        )
    if spec.get("sketch") is not None:
        sketch_of(spec)
    for key in _KEYS[:2]:
        value = spec.get(key)
        if (
            value is not None
            and not isinstance(value, str)
            and not (isinstance(value, list) and all(type(v) is (int if key == "layers" else str) for v in value))
        ):
            raise UsageError(f"additional_config {TAP_KEY!r}.{key}: expected a spec string or a list, got {value!r}")
    return spec


def sketch_of(spec: dict[str, Any]) -> SketchSpec | None:
    """The projection a checked ``driftscope`` entry asks for (None: full rows); a bad one is one UsageError line."""
    raw = spec.get("sketch")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(raw) <= {"kind", "k", "seed"}:
        raise UsageError(f"additional_config {TAP_KEY!r}.sketch: expected an object of k, seed (and kind), got {raw!r}")
    return SketchSpec.from_json(raw)


def split_points(points: str | Sequence[str] | None) -> tuple[str | list[str] | None, bool]:
    """(``points`` without ``router``, for the hidden-state tap; whether ``router`` was among them).

    vLLM records the router next to the ``input`` point, never alone (``--points input,router``).
    """
    names = [p.strip() for p in points.split(",")] if isinstance(points, str) else list(points or ())
    if ROUTER_POINT not in names:
        return points, False
    rest = [p for p in names if p != ROUTER_POINT]
    if not rest:
        raise UsageError(
            f"capture point {ROUTER_POINT!r}: vLLM records it beside the 'input' point; ask for input,{ROUTER_POINT}"
        )
    return rest, True


def install_engine_tap(model: Any, vllm_config: Any, spec: dict[str, Any]) -> Any:
    """Tap ``model`` as ``spec`` says, with room for the engine's token budget per step.

    Logs one INFO line through vLLM's logger (``VLLM_LOGGING_LEVEL=INFO`` shows it), so that the
    tap of an engine in another process can be seen; a spec the model refuses (a layer out of
    range, the router point of a dense model) is a :class:`UsageError` naming the ``additional_config`` entry.
    """
    from dumper.hooks.tap import install_tap

    budget = int(vllm_config.scheduler_config.max_num_batched_tokens)
    try:
        points, router = split_points(spec.get("points"))
        tap = install_tap(model, layers=spec.get("layers"), points=points, max_tokens=budget, family=VllmFamily(model))
        routed = install_router_tap(model, layers=spec.get("layers"), capacity=budget) if router else None
    except UsageError as e:
        raise UsageError(f"additional_config {TAP_KEY!r}: {e}") from None
    _LOG.info(
        "driftscope: tapped %d points of %s (%.1f MiB sink, budget %d tokens)",
        len(tap.points),
        type(model).__name__,
        tap.nbytes / 2**20,
        budget,
    )
    if routed is not None:
        _LOG.info(
            "driftscope: tapped the router of %d MoE layers (%.1f MiB sink)", len(routed.probes), routed.nbytes / 2**20
        )
    return tap


def _leave_load_failure(e: DriftscopeError) -> None:
    """Write ``e`` into the spool root (``DRIFTSCOPE_VLLM_SPOOL``), where the client that started this engine reads
    it."""
    root = env_settings().vllm_spool
    text = json.dumps({"type": type(e).__name__, "message": str(e)[:1000]})
    try:
        if root and is_url(root):  # ranks on other hosts: the URL spool is what the client can read
            write_small(f"{root.rstrip('/')}/{_FAILED}{os.getpid()}.json", text.encode())
        elif root and Path(root).is_dir():
            (Path(root) / f"{_FAILED}{os.getpid()}.json").write_text(text)
    except (OSError, DriftscopeError):  # the error is in vLLM's log all the same
        pass


def take_load_failure(root: Path | str) -> DriftscopeError | None:
    """The error the tap raised in a vLLM process whose spool root is ``root`` (None: none); every such file is removed.

    Called before an engine starts (to drop what an earlier one left) and after it failed to start.
    """
    found: DriftscopeError | None = None
    if isinstance(root, str):
        return _take_remote_failure(root)
    for path in sorted(root.glob(f"{_FAILED}*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found = found or _failure_of(path.read_bytes())
        path.unlink(missing_ok=True)
    return found


def _failure_of(raw: bytes) -> DriftscopeError:
    d = json.loads(raw)
    kind = getattr(errors, str(d["type"]), None)
    kind = kind if isinstance(kind, type) and issubclass(kind, DriftscopeError) else errors.ModelError
    return kind(" ".join(str(d["message"]).split()))


def _take_remote_failure(root: str) -> DriftscopeError | None:
    """:func:`take_load_failure` of a URL spool."""
    found: DriftscopeError | None = None
    for name in listed(root, f"{_FAILED}*.json"):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            found = found or _failure_of(read_small(f"{root}/{name}") or b"")
        remove_prefix(f"{root}/{name}")
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
                from dumper.engines.vllm.spool import install_recorder

                # with DRIFTSCOPE_VLLM_SPOOL set: record marked requests (the router beside the hidden-state points)
                install_recorder(
                    model,
                    {**spec, "points": split_points(spec.get("points"))[0]},
                    vllm_config,
                    router=router_tap_of(model),
                )
        except DriftscopeError as e:
            _leave_load_failure(e)
            raise
        return model

    setattr(load_model, _PATCHED, True)
    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]


# -- MoE routing: the ``router`` point -------------------------------------------------------------
#
# vLLM's fused-MoE layers (``FusedMoEFactory`` -> ``MoERunner``) take the gate's logits and call
# ``runner.router.select_experts(...) -> (topk_weights, topk_ids)`` inside ``_forward_impl``; the
# expert kernel then applies exactly those. On CPU the runner calls ``_moe_forward`` as plain Python
# (not the ``vllm.moe_forward`` custom op), so vLLM's torch.compile traces the selection (top-k and
# softmax) into the compiled graph, where no Python hook runs at serve time. The probe therefore
# wraps the router's ``select_experts`` before vLLM compiles the model and hands what it returned to
# one opaque op that copies it into buffers (:class:`dumper.hooks.router_tap.RouterProbe`, as the
# hidden-state tap does); the compiled graph keeps the call. A monolithic kernel that routes inside
# itself (some GPU paths) shows nothing: refused.

_ROUTER_ATTR = "_driftscope_router"
"""The attribute of a tapped model that holds its :class:`RouterTap`."""


def _moe_runner(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(name in ``layer``, module) of the layer's first fused-MoE runner: a module whose ``router`` selects experts."""
    for name, m in layer.named_modules():
        if callable(getattr(getattr(m, "router", None), "select_experts", None)):
            return name, m
    return None


def _logits_dtype(layer: nn.Module, name: str, runner: nn.Module) -> torch.dtype:
    """The dtype the layer's gate computes its logits in: the runner's gate or its sibling ``gate``."""
    parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
    gate = getattr(runner, "gate", None) or getattr(parent, "gate", None)
    out = getattr(gate, "out_dtype", None)
    weight = getattr(gate, "weight", None)
    if isinstance(out, torch.dtype):
        return out
    return weight.dtype if isinstance(weight, torch.Tensor) else next(runner.parameters()).dtype


def moe_layers(model: nn.Module, layers: str | Sequence[int] | None) -> list[tuple[str, int, nn.Module, nn.Module]]:
    """(``model.layers.{i}``, i, decoder layer, MoE runner) of every selected layer that is MoE.

    None among them is a :class:`UsageError` naming the model and the layers; so is a layer whose
    kernel routes inside itself (monolithic) or under expert-placement load balancing (EPLB).
    """
    list_name, layer_list = find_decoder_layers(model, VllmFamily.attention_names)
    keep = parse_layer_spec(layers, len(layer_list))
    found = []
    for i in (i for i in keep if not isinstance(layer_list[i], nn.Identity)):
        hit = _moe_runner(layer_list[i])
        if hit is None:
            continue
        prefix = f"{list_name}.{i}" if list_name else str(i)
        if getattr(hit[1], "is_monolithic", False) or getattr(hit[1].router, "eplb_state", None) is not None:
            raise UsageError(
                f"capture point {ROUTER_POINT!r}: {prefix} runs a fused-MoE kernel that chooses experts "
                "inside itself (monolithic) or remaps them (EPLB); its choice is not visible to capture"
            )
        found.append((prefix, i, layer_list[i], hit[1]))
    if not found:
        raise UsageError(
            f"capture point {ROUTER_POINT!r}: {type(model).__name__} has no MoE layer among layers "
            f"{keep} (no fused-MoE router there); capture the 'input' point instead"
        )
    return found


def _probe(layer: nn.Module, runner: nn.Module, capacity: int) -> RouterProbe:
    """A probe for ``runner``, its child, with its router's ``select_experts`` wrapped to call it."""
    router = runner.router
    name = next(n for n, m in layer.named_modules() if m is runner)
    param = next(runner.parameters(), None)
    probe = RouterProbe(
        int(router.global_num_experts),
        int(router.top_k),
        capacity=capacity,
        dtype=_logits_dtype(layer, name, runner),
        device=param.device if param is not None else "cpu",
    )
    runner.add_module(PROBE_NAME, probe)  # its buffers are the model's: compiled code lifts them as its state
    select = router.select_experts

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        weights, ids = select(*args, **kwargs)
        probe(kwargs["router_logits"] if "router_logits" in kwargs else args[1], ids, weights)
        return weights, ids

    router.select_experts = select_experts
    return probe


def install_router_tap(model: nn.Module, *, layers: str | Sequence[int] | None, capacity: int) -> RouterTap:
    """Probe every selected MoE layer of ``model`` before vLLM compiles it; ``capacity``: tokens per pass."""
    if router_tap_of(model) is not None:
        raise UsageError("the router point of this vLLM model is already tapped")
    probes = [
        RouterEntry(prefix, i, _probe(layer, runner, capacity))
        for prefix, i, layer, runner in moe_layers(model, layers)
    ]
    tap = RouterTap(probes, capacity)
    setattr(model, _ROUTER_ATTR, tap)
    return tap


def router_tap_of(model: Any) -> RouterTap | None:
    """The :class:`RouterTap` installed on ``model``, if any."""
    tap = getattr(model, _ROUTER_ATTR, None)
    return tap if isinstance(tap, RouterTap) else None
