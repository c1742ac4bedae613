"""Replay's MoE routing: record each replayed layer's routing, and on request force the baseline's expert choice.

When the baseline holds the ``router`` point (``python -m dumper run --points residual,router``),
every replayed MoE layer records its own router point too (logits, ids, weights as applied), so
the comparator's routing verdict shows which tokens a layer routes differently on the
baseline's own input. With ``force_routing`` (:data:`FORCE_MODES`), each replayed router's
output is replaced, for every token, by the baseline's choice for the same (sequence,
position), and the forced values are what the dump records (0 flips by construction):

- ``"ids"``: the baseline's expert ids, weighted as the router under test weights them from its
  own logits (:func:`dumper.hooks.router_weights.combine_weights`, each family's own weight math);
- ``"all"``: the baseline's expert ids and combine weights (cast to the router's weight dtype).

A layer that still differs with its experts forced differs by its math (attention, the experts,
and with ``ids`` the combine weights), not by its choice of experts.

Example::

    from dumper.jobs.replay import ReplayConfig, replay
    replay(ReplayConfig(model="ckpt/", baseline="dumps/base", out="dumps/forced", force_routing="ids"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from dumper.errors import NotComparableError, UsageError
from dumper.format import ROUTER_CHOICE_POINT, ROUTER_IDS, ROUTER_LOGITS, ROUTER_WEIGHTS, DumpReader, Manifest
from dumper.format.points import RESIDUAL
from dumper.format.routing import LayerRecords, LayerRows, key_parts, read_layer, row_key
from dumper.format.routing import router_records as baseline_router_records
from dumper.hooks.capture import Capture
from dumper.hooks.layers import ROUTER
from dumper.hooks.router_weights import combine_weights
from dumper.hooks.routing import Reader, find_routers, has_router, known_families, router_meta
from dumper.prefill.presets import model_label

__all__ = [
    "FORCE_MODES",
    "check_force",
    "check_model_routes",
    "baseline_routing",
    "routed_layers",
    "check_baseline_rows",
    "LayerRouting",
    "layer_routing",
]

FORCE_MODES = ("ids", "all")
"""``force_routing`` values: the baseline's ids (weights from the router under test), or its ids and weights."""


def check_force(manifest: Manifest, where: str, mode: str | None) -> None:
    """Refuse an unknown ``mode``, or forcing a baseline without the router point (read from the manifest only)."""
    if mode is None:
        return
    if mode not in FORCE_MODES:
        raise UsageError(f"force_routing {mode!r}: expected one of {', '.join(FORCE_MODES)}")
    if not any(r.point == ROUTER_CHOICE_POINT for r in manifest.tensors):
        raise UsageError(
            f"{where}: the baseline holds no {ROUTER!r} point, so there is no expert choice to force; "
            f"re-run it with `python -m dumper run ... --points {RESIDUAL},{ROUTER} --layers all`"
        )


def check_model_routes(
    model: nn.Module, mode: str | None, routing: dict[int, LayerRecords], layers: dict[int, nn.Module], where: str
) -> None:
    """Refuse forcing (``mode``) on a dense model, or on a replayed MoE layer (of ``layers``, by index) whose
    routing the baseline (``where``) did not record (``routing``: :func:`baseline_routing`)."""
    if mode is None:
        return
    if not has_router(model):
        raise UsageError(
            f"{model_label(model)}: --force-routing {mode}: {type(model).__name__} has no MoE router "
            f"driftscope reads (known: {known_families()}); replay a dense model without it"
        )
    missing = [k for k, layer in layers.items() if find_routers(layer) and k not in routing]
    if missing:
        raise UsageError(
            f"{where}: the baseline records no routing of MoE layer(s) {missing}; re-run it with "
            f"`--points {RESIDUAL},{ROUTER} --layers all` to force their experts"
        )


def baseline_routing(reader: DumpReader) -> dict[int, LayerRecords]:
    """The baseline's routing records by decoder layer (from its manifest; none: no router point)."""
    return baseline_router_records(reader)


def routed_layers(routing: dict[int, LayerRecords], layers: dict[int, nn.Module]) -> list[int]:
    """The replayed ``layers`` whose routing replay records: MoE layers whose routing the baseline holds."""
    return [k for k, layer in layers.items() if k in routing and find_routers(layer)]


def check_baseline_rows(
    reader: DumpReader,
    routing: dict[int, LayerRecords],
    layers: dict[int, nn.Module],
    forced: dict[int, dict[int, int]] | None = None,
) -> dict[int, LayerRows]:
    """The routing rows of every replayed MoE layer (of ``layers``, by index) whose routing the baseline holds, read
    and checked before the replay runs anything, not partway through it: one router per layer, every row readable
    (expert ids distinct and in range, the parts covering the same rows) and, when forcing (``forced``: layer ->
    sequence -> rows replayed), a row for every replayed token. :func:`layer_routing` hooks with these rows."""
    out = {}
    for k in routed_layers(routing, layers):
        if len(find_routers(layers[k])) > 1:
            raise UsageError(
                f"replay: decoder layer {k} holds {len(find_routers(layers[k]))} routers; replay records one per layer"
            )
        rows = read_layer(reader, routing[k])
        for s, n in (forced or {}).get(k, {}).items():
            lost = np.setdiff1d(row_key(s, np.arange(n)), rows.keys)
            if lost.size:
                raise NotComparableError(
                    f"{reader.directory}: the baseline's routing of layer {k} has no row for "
                    f"position {key_parts(lost[0])[1]} of sequence {s}; forcing needs one for "
                    "every replayed token"
                )
        out[k] = rows
    return out


class LayerRouting:
    """One replayed layer's router: a forward hook that forces its choice (``mode``) and keeps what it returned.

    Call :meth:`begin` with the sequence id and row count before each call of the layer; the
    router must see exactly that sequence's rows, in position order ``0..n-1`` (as replay feeds them).
    """

    def __init__(
        self, module: nn.Module, read: Reader, entry: LayerRecords, base: LayerRows, mode: str | None, where: str
    ) -> None:
        self.module, self.read, self.entry, self.base, self.mode, self.where = module, read, entry, base, mode, where
        self.parts: list[dict[str, torch.Tensor]] = []
        self._rows: np.ndarray | None = None  # indices into base of the current sequence's positions 0..n-1

    def begin(self, sequence: int, n: int) -> None:
        """The next router call routes positions ``0..n-1`` of baseline sequence ``sequence``."""
        if self.mode is None:
            return
        want = row_key(sequence, np.arange(n))
        at = np.searchsorted(self.base.keys, want)
        # check_baseline_rows refused a forced replay whose baseline lacks any of these rows
        assert at.size == 0 or (at[-1] < self.base.keys.size and np.array_equal(self.base.keys[at], want))
        self._rows = at

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        parts = self.read(args, kwargs, output)  # checks the (logits, weights, ids) shapes
        forced = self.mode is not None
        if forced:
            parts = {**parts, **self._forced(parts)}
        self.parts.append({name: t.detach().clone() for name, t in parts.items()})
        return (parts[ROUTER_LOGITS], parts[ROUTER_WEIGHTS], parts[ROUTER_IDS]) if forced else None

    def _forced(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The baseline's ids (and, with ``all``, weights) of the current rows, in the router's dtypes."""
        logits = parts[ROUTER_LOGITS]
        weights = parts[ROUTER_WEIGHTS]
        ids = parts[ROUTER_IDS]
        assert self._rows is not None  # begin() found the sequence's baseline rows
        base_ids = self.base.ids[self._rows]  # [n, k] int64
        if base_ids.shape != tuple(ids.shape) or base_ids.max(initial=0) >= logits.shape[1]:
            raise NotComparableError(
                f"{self.where}: layer {self.entry.layer} routes {list(ids.shape)} (tokens, top-k) "
                f"over {logits.shape[1]} experts; the baseline's {list(base_ids.shape)} choice "
                "does not fit it"
            )
        new_ids = torch.from_numpy(base_ids).to(ids.device, ids.dtype)
        if self.mode == "all":
            new_weights = torch.from_numpy(self.base.weights[self._rows]).to(weights.device, weights.dtype)
        else:
            new_weights = combine_weights(self.module, logits, new_ids).to(weights.dtype)
        return {ROUTER_IDS: new_ids, ROUTER_WEIGHTS: new_weights}

    def record(self, cap: Capture, positions: np.ndarray, sequence_ids: np.ndarray) -> None:
        """Record every call's routing as the baseline names it, rows labelled as the replayed residual's."""
        joined = {name: torch.cat([p[name] for p in self.parts]) for name in self.parts[0]} if self.parts else {}
        cap.record_router(
            self.entry.prefix,
            self.entry.layer,
            joined,
            positions=positions,
            sequence_ids=sequence_ids,
            scores_meta=router_meta(self.module),
        )


@contextlib.contextmanager
def layer_routing(
    reader: DumpReader, entry: LayerRecords | None, base: LayerRows | None, layer: nn.Module, mode: str | None
) -> Iterator[list[LayerRouting]]:
    """Hook the router of a replayed decoder ``layer`` whose routing the baseline recorded (``entry``, its rows
    ``base`` from :func:`check_baseline_rows`, which also refused a layer of several routers).

    Yields one :class:`LayerRouting` per router (none: a dense layer, or ``entry`` None); the hooks
    are removed on exit.
    """
    routers = find_routers(layer) if entry is not None else []
    if entry is None or not routers:
        yield []
        return
    assert len(routers) == 1 and base is not None  # check_baseline_rows read this layer's rows
    module, read = routers[0]
    hook = LayerRouting(module, read, entry, base, mode, str(reader.directory))
    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield [hook]
    finally:
        handle.remove()
