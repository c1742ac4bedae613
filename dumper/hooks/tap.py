"""The graph-safe tap: capture inside compiled code (torch.compile, vLLM's compiled model, CUDA graphs).

Module hooks that record in Python cannot run inside compiled code: torch.compile traces
them into the graph (a graph break, or an error under ``fullgraph=True``), a hook added
after compilation is never called, and a CUDA-graph replay runs no Python at all. The tap
is instead one operator, ``torch.ops.driftscope.tap``, that compilers keep in the graph as
an opaque call mutating its inputs: it copies a tapped module's hidden-state input, viewed
as ``[rows, hidden]``, into one preallocated *sink* ``[points, capacity, hidden]`` and
writes the row count into ``count[point]``. Both are buffers that live for the model's
lifetime, so a CUDA graph records the copy into them at capture and repeats it at every
replay. The capture reads the rows back after the forward pass, outside the graph, with
the pass's row metadata (:mod:`dumper.hooks.capture`).

The tap is installed by :func:`install_tap` *before* the model is compiled (``dumper.tap``
for a model of your own, ``python -m dumper run --compile``; vLLM's loader for a vLLM
model: :mod:`dumper.engines.vllm.tap`). It only reads its input: the model's outputs are
those of the same build without it, which ``--observer-check`` verifies bit for bit.

Example::

    dumper.tap(model, layers="all", max_tokens=4096)    # before torch.compile
    compiled = torch.compile(model)
    with dumper.capture(compiled, "dumps/compiled"):
        compiled(input_ids)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dumper.errors import InternalError, UsageError
from dumper.format.points import CACHE_POINTS, record_name
from dumper.hooks.families import resolve_model
from dumper.hooks.layers import ROUTER, HookTarget, hook_targets
from dumper.hooks.router_tap import RouterEntry, RouterProbe, RouterTap, hook_router
from dumper.hooks.routing import router_meta, router_shape

__all__ = [
    "tap",
    "Tap",
    "TapPoint",
    "install_tap",
    "tap_of",
    "remove_tap",
    "is_compiled",
    "unwrap_compiled",
    "available_bytes",
    "match_targets",
    "check_counts",
]

_ATTR = "_driftscope_tap"
"""The attribute of a tapped model that holds its :class:`Tap`."""
_MISMATCH = -1
"""``count`` of a point whose input did not fit the sink (another width or dtype than the model's)."""


@torch.library.custom_op("driftscope::tap", mutates_args=("sink", "count"))
def _tap_op(x: torch.Tensor, sink: torch.Tensor, count: torch.Tensor, slot: int) -> None:
    """Copy ``x`` (viewed as ``[rows, hidden]``) into ``sink[slot]`` and its row count into ``count[slot]``.

    Rows past the sink's capacity are not copied; the count still says how many there were,
    so the reader refuses the pass instead of keeping part of it.
    """
    if x.dim() == 0 or x.shape[-1] != sink.shape[-1] or x.dtype != sink.dtype:
        count[slot].fill_(_MISMATCH)
        return
    rows = x.reshape(-1, x.shape[-1])
    n = min(int(rows.shape[0]), int(sink.shape[1]))
    sink[slot, :n].copy_(rows[:n])
    count[slot].fill_(int(rows.shape[0]))


@_tap_op.register_fake
def _tap_fake(x: torch.Tensor, sink: torch.Tensor, count: torch.Tensor, slot: int) -> None:
    return None


@dataclass(frozen=True)
class TapPoint:
    """One tapped point: the capture's name for it, its layer and point, and its sink slot."""

    name: str
    layer: int | None
    point: str
    slot: int

    @property
    def record(self) -> str:
        """The name its rows are recorded under, as the module hooks name them (:attr:`HookTarget.record`)."""
        return record_name(self.name, self.point)


class Tap:
    """The sink, the row counts and the hooks of one tapped model; see :func:`install_tap`."""

    def __init__(
        self,
        points: Sequence[TapPoint],
        capacity: int,
        hidden: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.points = tuple(points)
        self.capacity, self.hidden, self.num_layers = capacity, hidden, num_layers
        self.sink = torch.zeros(len(self.points), capacity, hidden, dtype=dtype, device=device)
        self.count = torch.zeros(len(self.points), dtype=torch.int64, device=device)
        self.handles: list[Any] = []
        self.routers: RouterTap | None = None
        """The MoE routers' probes, with the ``router`` point (:mod:`dumper.hooks.router_tap`)."""
        self._host_counts: list[int] | None = None  # :attr:`count` of the last pass, read once

    @property
    def nbytes(self) -> int:
        """Bytes the sinks hold."""
        return self.sink.numel() * self.sink.element_size() + (self.routers.nbytes if self.routers else 0)

    def clear(self) -> None:
        """Before a pass: a point or router that does not run in it records nothing."""
        self.count.zero_()
        self._host_counts = None
        if self.routers is not None:
            self.routers.clear()

    def router_parts(
        self, targets: Sequence[HookTarget], tokens: int | None
    ) -> list[tuple[str, int, dict[str, torch.Tensor], dict[str, int]]]:
        """The last pass's routing of the ``router`` targets among ``targets`` (:meth:`RouterTap.parts`)."""
        wanted = {t.name for t in targets if t.point == ROUTER}
        return self.routers.parts(tokens, only=wanted) if wanted and self.routers is not None else []

    def names(self) -> list[str]:
        """The record names of every tapped point, in slot order."""
        return [p.record for p in self.points]

    def read(self, counts: Sequence[int], point: TapPoint) -> torch.Tensor:
        """The rows ``point`` saw in the last forward pass (a view of the sink; copy before the next pass).

        ``counts`` is :attr:`count` on the host, read once per pass.
        """
        n = int(counts[point.slot])
        if n == _MISMATCH:
            raise UsageError(
                f"{point.record}: its input is not [..., {self.hidden}] {str(self.sink.dtype)[6:]}, "
                "the model's hidden width and dtype the tap stores"
            )
        if n > self.capacity:
            raise UsageError(
                f"{point.record}: a forward pass of {n} rows is more than the tap's capacity of "
                f"{self.capacity} (install it with a larger max_tokens, or run smaller batches)"
            )
        return self.sink[point.slot, :n]


def tap_of(model: Any) -> Tap | None:
    """The :class:`Tap` installed on ``model`` (or on the module a compiled wrapper holds), if any."""
    tap = getattr(unwrap_compiled(model), _ATTR, None) if isinstance(model, nn.Module) else None
    return tap if isinstance(tap, Tap) else None


def is_compiled(model: Any) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (``OptimizedModule``), where module hooks never run."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles (``model`` itself when it is not one)."""
    return getattr(model, "_orig_mod", model) if is_compiled(model) else model


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CUDA: the driver's free bytes; CPU: MemAvailable), or None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", "rb") as f:
                for line in f:
                    if line.startswith(b"MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "hf_config", None)):
        size = getattr(cfg, "hidden_size", None)
        if type(size) is int and size > 0:
            return size
    raise UsageError(f"{type(model).__name__}: the tap needs the model's hidden size (config.hidden_size)")


def install_tap(
    model: nn.Module,
    *,
    layers: str | Sequence[int] | None = None,
    modules: str | None = None,
    points: str | Sequence[str] | None = None,
    max_tokens: int,
    family: Any = None,
) -> Tap:
    """Tap ``model``'s capture points (chosen as :func:`dumper.capture` chooses them) before it is compiled.

    ``max_tokens`` is the most rows one forward pass feeds a tapped module (HF: batch × sequence;
    vLLM: the engine's token budget per step). The sink is ``points × max_tokens × hidden`` in
    the model's dtype on its device; one that does not fit in free memory is refused here,
    before the run. Installing twice, or on a compiled wrapper, is refused: the graph that
    was compiled would not see the change.
    """
    if is_compiled(model):
        raise UsageError(
            "dumper.tap(): call it on the model before torch.compile (the compiled graph would not "
            "see a tap added afterwards)"
        )
    if tap_of(model) is not None:
        raise UsageError("dumper.tap(): this model is already tapped")
    if type(max_tokens) is not int or max_tokens <= 0:
        raise UsageError(f"dumper.tap(max_tokens={max_tokens!r}): expected a positive integer")
    module, adapter = resolve_model(model) if family is None else (model, family)
    targets, num_layers = hook_targets(module, adapter, layers=layers, modules=modules, points=points)
    param = next(module.parameters(), None)
    if param is None:
        raise UsageError(f"{type(module).__name__}: has no parameters to take the tap's dtype and device from")
    hidden = _hidden_size(module)
    routers = [t for t in targets if t.point == ROUTER]
    targets = [t for t in targets if t.point != ROUTER and t.point not in CACHE_POINTS]  # the cache is read after
    tap_points = [TapPoint(t.name, t.layer, t.point, i) for i, t in enumerate(targets)]
    shapes = [router_shape(t.module) for t in routers]
    need = len(tap_points) * max_tokens * hidden * param.element_size() + sum(
        max_tokens * (e * torch.finfo(dt).bits // 8 + 12 * k) for e, k, dt in shapes
    )
    free = available_bytes(param.device)
    if free is not None and need > free:
        raise UsageError(
            f"the tap needs {need / 2**20:.0f} MiB ({len(tap_points)} points × {max_tokens} tokens × "
            f"{hidden} × {param.element_size()} B) on {param.device}, and {free / 2**20:.0f} MiB are "
            "free; select fewer layers or lower the token budget"
        )
    tap = Tap(tap_points, max_tokens, hidden, num_layers, param.dtype, param.device)
    for target, point in zip(targets, tap_points):
        tap.handles.append(_hook(target, point.slot, tap, adapter))
    if routers:
        tap.routers = RouterTap(
            [
                RouterEntry(
                    t.name,
                    t.layer,
                    RouterProbe(e, k, capacity=max_tokens, dtype=dt, device=param.device),  # type: ignore[arg-type]
                    t.read,
                    router_meta(t.module),
                )
                for t, (e, k, dt) in zip(routers, shapes)
            ],
            max_tokens,
        )
        tap.routers.handles += [hook_router(t.module, e.probe) for t, e in zip(routers, tap.routers.probes)]
    setattr(module, _ATTR, tap)
    return tap


def tap(
    model: nn.Module,
    *,
    layers: str | Sequence[int] | None = None,
    points: str | Sequence[str] | None = None,
    max_tokens: int = 8192,
) -> Tap:
    """Tap ``model`` before ``torch.compile`` so that :func:`dumper.capture` can record inside the compiled model.

    ``layers`` and ``points`` choose as :func:`dumper.capture` does (a capture may then take any
    subset); ``max_tokens`` bounds the rows (batch × sequence) of one forward pass.
    """
    return install_tap(model, layers=layers, points=points, max_tokens=max_tokens)


def _hook(target: HookTarget, slot: int, tap: Tap, adapter: Any) -> Any:
    """A hook calling the tap op on what ``target``'s point reads (its input, or for ``attn_output`` and
    ``mlp_output`` its output: a forward hook): pure tensor code, traced into the graph."""
    # The sink and counts are buffers of the tapped module, so that a compiler lifts them as the
    # module's state (vLLM's cached, ahead-of-time compiled graph takes them from the module). A module
    # with two points (the MLP's input and output) holds them once.
    target.module.register_buffer("_driftscope_sink", tap.sink, persistent=False)
    target.module.register_buffer("_driftscope_count", tap.count, persistent=False)
    point = target.point

    def hook(module: nn.Module, args: tuple, kwargs: dict, *output: Any) -> None:
        x = adapter.point_value(point, args, kwargs, *output)
        if isinstance(x, torch.Tensor):
            torch.ops.driftscope.tap(x, module._driftscope_sink, module._driftscope_count, slot)

    add = target.module.register_forward_hook if target.output else target.module.register_forward_pre_hook
    return add(hook, with_kwargs=True)


def remove_tap(model: nn.Module) -> None:
    """Take the tap off ``model`` (eager use only: a graph compiled with it keeps calling it)."""
    module = unwrap_compiled(model)
    tap = getattr(module, _ATTR, None)
    if not isinstance(tap, Tap):
        return
    for handle in tap.handles:
        handle.remove()
    if tap.routers is not None:
        tap.routers.remove(module)
    for m in module.modules():
        for name in ("_driftscope_sink", "_driftscope_count"):
            m._buffers.pop(name, None)
    delattr(module, _ATTR)


def match_targets(tap: Tap, targets: Sequence[HookTarget]) -> list[tuple[HookTarget, TapPoint]]:
    """Each hidden-state target and the tap point that records it; a target the tap does not hold (a router
    it has no probe for included) is refused."""
    by_name = {(p.name, p.point): p for p in tap.points}
    by_name.update({(name, ROUTER): None for name in (tap.routers.names() if tap.routers else ())})  # type: ignore
    missing = [t.record for t in targets if (t.name, t.point) not in by_name]
    if missing:
        held = (
            ", ".join(p.record for p in tap.points[:3])
            + (" ..." if len(tap.points) > 3 else "")
            + (f" and the routers of {len(tap.routers.probes)} MoE layers" if tap.routers else "")
        )
        raise UsageError(
            f"{missing[0]}{' ...' if len(missing) > 1 else ''}: not tapped (the model's tap holds "
            f"{held}); capture a subset of those, or tap the others before the model compiles"
        )
    return [(t, by_name[(t.name, t.point)]) for t in targets if t.point != ROUTER]  # type: ignore[misc]


def check_counts(tap: Tap) -> list[int]:
    """The row counts of the last pass, on the host: one device sync per pass, however many captures read them
    (several captures in flight in one vLLM engine step share it)."""
    if tap._host_counts is None:
        counts = tap.count.tolist()
        if len(counts) != len(tap.points):
            raise InternalError("the tap's row counts do not match its points")
        tap._host_counts = counts
    return tap._host_counts
