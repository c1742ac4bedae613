"""The graph-safe router tap: each MoE layer's routing copied into buffers by one opaque op.

A router's choice is taken inside the model's forward; in compiled code (torch.compile, vLLM's
compiled model, CUDA graphs) no Python hook records it. As :mod:`dumper.hooks.tap` does for
hidden states, a :class:`RouterProbe` per MoE layer is installed *before* compilation and called
with what the router returned, ``(logits, ids, weights)``: the ``driftscope::router_tap`` op copies
them into the probe's buffers and writes the row count, and compilers keep the call. After the
pass, :meth:`RouterTap.parts` reads them back, outside the graph.

Who calls the probe is the engine's: HF routers get a forward hook (:func:`hook_router`, installed
by :func:`dumper.hooks.tap.install_tap` for the ``router`` point), vLLM's fused-MoE routers a
wrapped ``select_experts`` (:mod:`dumper.engines.vllm.tap`). The probe only reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dumper.errors import DumpError, UsageError
from dumper.format import ROUTER_IDS, ROUTER_LOGITS, ROUTER_WEIGHTS

__all__ = ["RouterProbe", "RouterEntry", "RouterTap", "hook_router", "PROBE_NAME"]

PROBE_NAME = "_driftscope_router"
"""The probe's child name under the module that calls it (a router, or vLLM's MoE runner)."""
_MISMATCH = -1
"""``count`` of a probe whose input did not fit its buffers (another shape or logits dtype)."""


@torch.library.custom_op("driftscope::router_tap", mutates_args=("logits_sink", "ids_sink", "weights_sink", "count"))
def _router_tap_op(
    logits: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    logits_sink: torch.Tensor,
    ids_sink: torch.Tensor,
    weights_sink: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Copy one MoE layer's routing of a pass into its sinks and the row count into ``count`` (-1: it does not fit)."""
    rows, k = int(logits.shape[0]) if logits.dim() == 2 else -1, int(ids_sink.shape[-1])
    if (
        rows < 0
        or logits.shape[-1] != logits_sink.shape[-1]
        or logits.dtype != logits_sink.dtype
        or tuple(ids.shape) != (rows, k)
        or tuple(weights.shape) != (rows, k)
    ):
        count.fill_(_MISMATCH)
        return
    n = min(rows, int(logits_sink.shape[0]))
    logits_sink[:n].copy_(logits[:n])
    ids_sink[:n].copy_(ids[:n])  # int32 -> int64, exact
    weights_sink[:n].copy_(weights[:n])  # a half weight widens to float32 exactly
    count.fill_(rows)


@_router_tap_op.register_fake
def _router_tap_fake(
    logits: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    logits_sink: torch.Tensor,
    ids_sink: torch.Tensor,
    weights_sink: torch.Tensor,
    count: torch.Tensor,
) -> None:
    return None


class RouterProbe(nn.Module):
    """Called as ``probe(logits, ids, weights)`` with what one MoE layer's router returned, every pass.

    It copies them, up to ``capacity`` tokens, into its buffers through the ``driftscope::router_tap``
    op, which compiled code keeps. Its buffers are the model's (non-persistent), so a compiler
    lifts them as the model's state.
    """

    def __init__(
        self,
        experts: int,
        top_k: int,
        *,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity = experts, top_k, capacity
        self.register_buffer("logits_sink", torch.zeros(capacity, experts, dtype=dtype, device=device), False)
        self.register_buffer("ids_sink", torch.zeros(capacity, top_k, dtype=torch.int64, device=device), False)
        self.register_buffer("weights_sink", torch.zeros(capacity, top_k, dtype=torch.float32, device=device), False)
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64, device=device), False)

    def forward(self, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        torch.ops.driftscope.router_tap(
            logits, ids, weights, self.logits_sink, self.ids_sink, self.weights_sink, self.count
        )


@dataclass(frozen=True)
class RouterEntry:
    """One probed MoE layer: its record prefix (``model.layers.3``), layer, probe, and how its parts are read.

    ``read`` (a :data:`dumper.hooks.routing.Reader`) turns ``(logits, weights, ids)`` back into the
    routing parts as the eager hook would (DeepSeek-V3 adds its selection scores); None: the three as
    they are. ``meta`` goes with the scores (:func:`dumper.hooks.routing.router_meta`).
    """

    prefix: str
    layer: int
    probe: RouterProbe
    read: Any = None
    meta: dict[str, int] = field(default_factory=dict)


class RouterTap:
    """The router probes of one tapped model, read after each pass."""

    def __init__(self, probes: Sequence[RouterEntry], capacity: int) -> None:
        self.probes, self.capacity = tuple(probes), capacity
        self.handles: list[Any] = []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for e in self.probes for b in e.probe.buffers())

    def names(self) -> list[str]:
        """The record prefixes of the probed layers."""
        return [e.prefix for e in self.probes]

    def clear(self) -> None:
        """Before a pass: a layer that does not run in it records nothing."""
        for e in self.probes:
            e.probe.count.zero_()

    def parts(
        self, tokens: int | None = None, only: set[str] | None = None
    ) -> list[tuple[str, int, dict[str, torch.Tensor], dict[str, int]]]:
        """(prefix, layer, parts as views of the sinks, scores meta) of every probed layer the last pass ran.

        ``tokens``: the pass's token count; a probe that saw another count (none: a compiled graph
        that does not write the probe's buffers) is refused instead of leaving a silent hole.
        ``only``: the prefixes a capture asked for (default: all).
        """
        entries = [e for e in self.probes if only is None or e.prefix in only]
        counts = torch.cat([e.probe.count for e in entries]).tolist() if entries else []  # one sync per pass
        out = []
        for e, n in zip(entries, counts):
            p = e.probe
            if n == _MISMATCH:
                raise UsageError(
                    f"{e.prefix}: its router output is not [tokens, {p.experts}] "
                    f"{str(p.logits_sink.dtype)[6:]} logits with [tokens, {p.top_k}] choices, "
                    "what the router tap stores"
                )
            if n > self.capacity:
                raise UsageError(
                    f"{e.prefix}: a pass of {n} tokens is more than the router tap's capacity of {self.capacity}"
                )
            if tokens is not None and n != tokens:
                raise DumpError(
                    f"{e.prefix}: the router tap saw {n} of the pass's {tokens} tokens (the model "
                    "routed them where the tap does not see it)"
                )
            if n:
                logits = p.logits_sink[:n]
                ids = p.ids_sink[:n]
                weights = p.weights_sink[:n]
                parts = (
                    e.read((), {}, (logits, weights, ids))
                    if e.read is not None
                    else {ROUTER_LOGITS: logits, ROUTER_IDS: ids, ROUTER_WEIGHTS: weights}
                )
                out.append((e.prefix, e.layer, parts, e.meta))
        return out

    def remove(self, model: nn.Module) -> None:
        """Take the hooks and probes off ``model`` (eager use only: a graph compiled with them keeps calling them)."""
        for handle in self.handles:
            handle.remove()
        for m in model.modules():
            m._modules.pop(PROBE_NAME, None)


def hook_router(module: nn.Module, probe: RouterProbe) -> Any:
    """Make ``probe`` a child of the HF router ``module`` and call it from a forward hook with what it returned.

    transformers 5.x routers return ``(logits, weights, ids)``; the hook is pure tensor code that
    returns None (the output stays as it was), so torch.compile traces it into the graph.
    """
    module.add_module(PROBE_NAME, probe)

    def post(m: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 3:
            getattr(m, PROBE_NAME)(output[0], output[2], output[1])

    return module.register_forward_hook(post)
