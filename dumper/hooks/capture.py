"""The hook API's capture: record self-attention inputs (and residual streams, MoE routing) of a model into a dump.

Example::

    import dumper
    with dumper.capture(model, "dumps/a", layers="all", points=("input", "residual")):
        model(input_ids)                      # one forward pass
        dumper.dump("my.tensor", x, layer=3)  # explicit record into the same capture

Every top-level ``model(...)`` call is one forward pass; ``dumper.step()`` delimits passes by
hand (``dumper.dump`` and ``dumper.step`` live in :mod:`dumper.hooks.active`). A pass's rows
(positions, sequences) and the hidden-state argument come from the model's family adapter
(:mod:`dumper.hooks.families`). Hooks are removed on exit, also when the body raises; the
manifest is written only on a clean exit that recorded something, so an interrupted or empty
run never looks complete. A failure inside a hook is an :class:`InternalError` (a driftscope bug).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from dumper.errors import DumpError, UsageError
from dumper.format import FORMAT_VERSION, MANIFEST_NAME, Manifest, TensorRecord, write_manifest
from dumper.format.dtypes import torch_codes
from dumper.format.points import CACHE_POINTS, K_CACHE, V_CACHE, record_name
from dumper.format.sketch import SketchSpec
from dumper.format.validate import first_bad_text
from dumper.hooks.checks import checked_extra, checked_record_args, hook_guard
from dumper.hooks.current import Recorder, activate
from dumper.hooks.families import FamilyAdapter, resolve_model
from dumper.hooks.fingerprint import environment_fingerprint
from dumper.hooks.layers import POINTS, ROUTER, HookTarget, hook_targets
from dumper.hooks.parts import dist_rank_world, join_under_barrier, write_part
from dumper.hooks.routing import check_router_hookable, router_meta, router_records
from dumper.hooks.rows import PassRows, as_runs, write_shared_rows
from dumper.hooks.sketch import Sketcher, sketch_for_record
from dumper.hooks.tap import TapPoint, check_counts, is_compiled, match_targets, tap_of, unwrap_compiled
from dumper.hooks.writer import ShardWriter

__all__ = ["Capture"]

_STORAGE_CODES = torch_codes()
"""torch dtype -> the dump format's dtype code, for every dtype a dump can store."""


class Capture:
    """A scoped capture into one dump directory; use :func:`capture` to create it.

    ``model`` may be ``None``: then only explicit :func:`dumper.dump` calls record. ``family``
    overrides the model's family adapter (:mod:`dumper.hooks.families`).

    An engine's worker drives a capture itself: ``hooks=False`` registers no hooks (the owner
    calls :meth:`pass_start` / :meth:`pass_end` around each pass) and ``part=True`` ends it
    with this rank's part (:mod:`dumper.hooks.parts`) instead of a manifest; the caller that
    joins the parts starts its own records at ``first_pass`` and takes theirs with :meth:`adopt`.
    """

    def __init__(
        self,
        model: nn.Module | Any | None,
        out_dir: str | Path,
        *,
        layers: str | Sequence[int] | None = None,
        modules: str | None = None,
        points: str | Sequence[str] | None = None,
        model_name: str | None = None,
        shard_bytes: int = 512 << 20,
        extra: dict[str, Any] | None = None,
        identity: dict[str, Any] | None = None,
        signature: dict[str, Any] | None = None,
        environment: dict[str, Any] | None = None,
        family: FamilyAdapter | None = None,
        hooks: bool = True,
        part: bool = False,
        first_pass: int = 0,
        sketch: SketchSpec | None = None,
    ) -> None:
        # a torch.compile wrapper: passes start and end at its call, the capture points are its module's
        self._outer = model if isinstance(model, nn.Module) and is_compiled(model) else None
        self.model, self._family = (
            (model, family)
            if family is not None
            else resolve_model(unwrap_compiled(model) if self._outer is not None else model)
        )
        self._hooked, self._part = hooks, part
        model = self.model
        # the manifest's model, capture and environment where no nn.Module is hooked (set by dumper.engines.base)
        self._identity, self._signature, self._environment = identity, signature, dict(environment or {})
        self.out_dir = Path(out_dir)
        self.rank, self.world_size = dist_rank_world()
        self.extra = checked_extra(extra)
        if self._outer is not None or (self.model is not None and self._family.compiled_reason()):
            self.extra.setdefault("compiled", True)  # the comparator notes a side that ran compiled
        if model_name is not None and first_bad_text(model_name, "model_name") is not None:
            raise UsageError(f"capture(model_name={model_name!r}): expected valid Unicode text")
        self._shard_bytes, self._sketcher = shard_bytes, Sketcher(sketch) if sketch is not None else None
        self._targets, self._num_layers = (
            hook_targets(model, self._family, layers=layers, modules=modules, points=points)
            if model is not None
            else ([], 0)
        )
        self._cache_targets = [t for t in self._targets if t.point in CACHE_POINTS]
        self._targets = [t for t in self._targets if t.point not in CACHE_POINTS]
        self._cache = self._family.cache_reader(self._cache_targets) if self._cache_targets else None
        self._tap = tap_of(model) if model is not None else None
        self._tapped = self._tap_points() if model is not None else []
        self._model_name = model_name
        self._handles: list[Any] = []
        self._records: list[TensorRecord] = []
        self._adopted: tuple[dict[str, int], list[TensorRecord]] = ({}, [])
        self._writer: ShardWriter | None = None
        self._pass_count, self._cur_pass, self._calls = first_pass, None, {}  # type: ignore[var-annotated]
        self._rows: PassRows | None = None
        self._prev_active: Recorder | None = None
        self._depth, self._made_dir = 0, False
        self._pass_meta: dict[str, Any] = {}

    def _tap_points(self) -> list[tuple[HookTarget, TapPoint]]:
        """Each hidden-state target and the tap point that records it; a compiled model without a tap is refused."""
        reason = "torch.compile" if self._outer is not None else self._family.compiled_reason()
        if self._tap is not None:
            return match_targets(self._tap, self._targets)
        check_router_hookable(self._targets, hooked=self._hooked, compiled=reason)
        if reason is not None:
            raise UsageError(
                f"the model runs compiled ({reason}), where module hooks do not run; install "
                f"driftscope's tap before it compiles ({self._family.tap_hint()})"
            )
        return []

    @property
    def family(self) -> FamilyAdapter:  # what it reads from the model's calls (:mod:`dumper.hooks.families`)
        return self._family

    @property
    def records(self) -> tuple[TensorRecord, ...]:
        """The records written so far (their ``file`` is filled in when the capture ends)."""
        return tuple(self._records)

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        if (self.out_dir / MANIFEST_NAME).exists():
            raise DumpError(f"{self.out_dir}: already holds a complete dump; choose another directory")
        try:
            self._made_dir = not self.out_dir.exists()
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DumpError(f"{self.out_dir}: cannot create dump directory ({e.strerror})") from None
        stale = [p.name for p in self.out_dir.glob(f"r{self.rank}-p*.safetensors")]
        if stale:
            raise DumpError(
                f"{self.out_dir}: holds data files of an unfinished dump ({stale[0]}, ...); "
                "delete them or choose another directory"
            )
        self._writer = ShardWriter(self.out_dir, self.rank, shard_bytes=self._shard_bytes)
        try:
            if self.model is not None and self._hooked:
                top = self._outer if self._outer is not None else self.model
                self._handles.append(top.register_forward_pre_hook(self._on_model_start, with_kwargs=True))
                self._handles.append(top.register_forward_hook(self._on_model_end, always_call=True))
                for target in self._targets if self._tap is None else ():
                    self._handles.append(
                        target.module.register_forward_hook(
                            functools.partial(self._on_router, target), with_kwargs=True
                        )
                        if target.point == ROUTER
                        else self._hook(target)
                    )
        except BaseException:
            self._remove_hooks()
            raise
        if self._hooked:
            self._prev_active = activate(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._remove_hooks()
        finally:
            if self._hooked:
                activate(self._prev_active)
            self._finish(complete=exc_type is None)

    def close(self) -> None:
        """Finish an un-scoped capture (used for ``DRIFTSCOPE_DUMP_DIR``)."""
        self.__exit__(None, None, None)

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _finish(self, *, complete: bool) -> None:
        if self._writer is None:
            return
        self.step()
        writer, self._writer = self._writer, None
        writer.close()
        if not complete:  # no manifest; and no directory we made, where nothing was written
            self._remove_made_dir()
            return
        if self._cache is not None:
            self.extra["kv_cache"] = {**self._cache.layout(), "readback": self._cache.ledger.summary()}
        records = tuple(replace(r, file=writer.locations[(r.forward_pass, r.key)]) for r in self._records) + tuple(
            self._adopted[1]
        )
        files = {**writer.files, **self._adopted[0]}
        shared = self._family.shared_rows()
        if shared and records:  # the rows prefix-cache hits reused, as one extra pass of the hits' own
            found, found_files = write_shared_rows(
                self.out_dir,
                records,
                shared,
                rank=self.rank,
                forward_pass=self._pass_count,
                shard_bytes=self._shard_bytes,
            )
            self._pass_count += bool(found)
            records += found
            files.update(found_files)
        if self._part:
            write_part(
                self.out_dir,
                self.rank,
                files,
                records,
                world_size=self.world_size,
                signature=self._signature_of(),
                identity=self._family.identity(self._model_name),
                environment=self._environment_of(),
                extra=self.extra,
            )
        elif self.world_size > 1:
            if not self._join_ranks(files, records):
                self._refuse_empty()
        elif not records:
            self._refuse_empty()
        else:
            self._write_manifest(files, records)

    def _join_ranks(self, files: dict[str, int], records: tuple[TensorRecord, ...]) -> bool:  # (dumper.hooks.remote)
        return join_under_barrier(self.out_dir, self.rank, self.world_size, files, records, self._write_manifest)

    def _refuse_empty(self) -> NoReturn:
        """An exit that recorded nothing writes no manifest: leave no dump (and no directory we made)."""
        self._remove_made_dir()
        hooked = ", ".join(t.name for t in self._targets[:4]) + (" ..." if len(self._targets) > 4 else "")
        raise DumpError(
            f"{self.out_dir}: the capture recorded no tensors "
            f"({'hooked ' + hooked + ' never ran' if hooked else 'no module hooked'} "
            "and nothing called dumper.dump()); no dump was written"
        )

    def _remove_made_dir(self) -> None:
        if self._made_dir and self.rank == 0:
            with contextlib.suppress(OSError):
                self.out_dir.rmdir()  # only if empty: never delete what someone else put there

    def adopt(self, files: dict[str, int], records: Sequence[TensorRecord]) -> None:
        """Take records another process wrote (their data files already in this dump's directory)."""
        self._adopted[0].update(files)
        self._adopted[1].extend(records)

    def _signature_of(self) -> dict[str, Any]:
        dtype = (
            next((str(p.dtype).replace("torch.", "") for p in self.model.parameters()), None)
            if self.model is not None
            else None
        )
        return {  # layers: decoder layers (the final norm's residual, at layer num_layers, is not one)
            "layers": sorted({t.layer for t in self._targets if t.layer is not None and t.layer < self._num_layers}),
            "modules": [t.name for t in self._targets if t.point != ROUTER],  # the cache points hook none
            "points": [
                p
                for p in POINTS
                if any(t.point == p for t in (*self._targets, *self._cache_targets))  # and what an engine routed:
                or p == ROUTER
                and any(r.point == ROUTER for r in self._records)
            ],
            "num_layers": self._num_layers,
            "world_size": self.world_size,
            "dtype": dtype,
            **(self._signature or {}),
            **({"sketch": self._sketcher.spec.to_json()} if self._sketcher is not None else {}),
        }

    def _environment_of(self) -> dict[str, Any]:
        device = next((p.device for p in self.model.parameters()), None) if self.model is not None else None
        attn = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        return {**environment_fingerprint(device, attn), **self._family.environment(), **self._environment}

    def _write_manifest(self, files: dict[str, int], records: tuple[TensorRecord, ...]) -> None:
        model = self._identity if self._identity is not None else self._family.identity(self._model_name)
        write_manifest(
            self.out_dir,
            Manifest(
                format_version=FORMAT_VERSION,
                created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                model=model,
                capture_signature=self._signature_of(),
                environment=self._environment_of(),
                files=dict(sorted(files.items())),
                tensors=records,
                extra=self.extra,
            ),
        )

    # -- forward passes --------------------------------------------------------------------
    def step(self) -> None:
        """End the current forward pass; the next record starts a new one."""
        if self._cur_pass is not None and self._writer is not None:
            self._writer.end_pass()
        self._cur_pass = None
        self._calls.clear()

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        """Sequence id of each batch row for the following passes (``None``: as ``families.HFFamily`` infers them)."""
        self._family.set_sequence_ids(ids)

    def set_pass_meta(self, meta: dict[str, Any] | None) -> None:
        """Meta every following record carries until changed (``None``: none), e.g. a decode step's."""
        self._pass_meta = dict(meta or {})

    def _start_pass(self) -> int:
        self.step()
        self._cur_pass, self._pass_count = self._pass_count, self._pass_count + 1
        return self._cur_pass

    def pass_start(self, args: tuple, kwargs: dict) -> None:
        """A forward pass of the model begins (for an owner driving a ``hooks=False`` capture)."""
        self._on_model_start(self.model, args, kwargs)

    def pass_end(self) -> None:
        """The forward pass :meth:`pass_start` began has ended: read the tap, close the pass."""
        self._on_model_end(self.model, (), None)

    @hook_guard
    def _on_model_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self._depth == 1:
            self._start_pass()
            self._rows = self._pass_rows(args, kwargs)
            if self._tap is not None:
                self._tap.clear()  # a point that does not run in this pass records nothing

    @hook_guard
    def _on_model_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            if self._tap is not None:
                self._read_tap()
            if self._cache is not None:
                self._read_cache(output)
            rows, self._rows = self._rows, None
            self._family.end_pass(rows)
            self.step()

    def _read_tap(self) -> None:
        """Record what the tap copied during the pass that just ended (outside any compiled graph)."""
        assert self._tap is not None
        counts = check_counts(self._tap)
        ctx = self._rows
        for target, point in self._tapped:
            rows = self._tap.read(counts, point)
            if rows.shape[0] == 0:
                continue
            if ctx is not None and math.prod(ctx.shape) == rows.shape[0]:
                rows = rows.view(*ctx.shape, rows.shape[-1])
            self.record(target.record, rows, layer=target.layer, point=target.point)
        for prefix, layer, parts, meta in self._tap.router_parts(self._targets, ctx and math.prod(ctx.shape)):
            self.record_router(prefix, layer, parts, scores_meta=meta)

    def _read_cache(self, output: Any) -> None:
        """Record what the pass wrote into the KV cache of the selected layers (:mod:`dumper.hooks.kv_cache`)."""
        assert self._cache is not None
        wanted = {t.point for t in self._cache_targets}
        for got in self._cache.read(self._rows, output):
            for point, rows in ((K_CACHE, got.k), (V_CACHE, got.v)):
                if point not in wanted:
                    continue
                labels = {} if got.labels is None else {"positions": got.labels[0], "sequence_ids": got.labels[1]}
                meta = {"cache_hits": got.hits} if got.hits else {}
                self.record(
                    record_name(got.name, point),
                    rows,
                    layer=got.layer,
                    point=point,
                    shard_dim=rows.dim() - 1 if got.sharded else None,
                    **labels,
                    **meta,
                )

    def _pass_rows(self, args: tuple, kwargs: dict) -> PassRows | None:
        """Row metadata of a pass from the top-level call's inputs, as the model's family reads them."""
        return self._family.pass_rows(args, kwargs)

    def _hook(self, target: HookTarget) -> Any:
        """Hook ``target`` to record its point as ``target.record`` (:meth:`FamilyAdapter.point_value`): a pre-hook
        for an input, a forward hook for an output (``attn_output``, ``mlp_output``). Returns the handle."""
        name = target.record
        layer = target.layer
        point = target.point
        value = self._family.point_value

        @hook_guard
        def hook(module: nn.Module, args: tuple, kwargs: dict, *output: Any) -> None:
            hidden = value(point, args, kwargs, *output)
            if not isinstance(hidden, torch.Tensor):
                return
            self._rows = self._family.module_rows(self._rows, kwargs)
            self.record(name, hidden, layer=layer, point=point)

        add = target.module.register_forward_hook if target.output else target.module.register_forward_pre_hook
        return add(hook, with_kwargs=True)

    @hook_guard
    def _on_router(self, target: HookTarget, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A router's forward hook: record what ``target.read`` reads of its call; returns None (reads only)."""
        self.record_router(
            target.name, target.layer, target.read(args, kwargs, output), scores_meta=router_meta(module)
        )  # type: ignore[misc]

    # -- recording -------------------------------------------------------------------------
    def record(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        layer: int | None = None,
        point: str | None = None,
        positions: Any = None,
        sequence_ids: Any = None,
        shard_dim: int | None = None,
        **meta: Any,
    ) -> None:
        """Record one tensor into the current forward pass (starting one if needed).

        Without explicit ``positions`` / ``sequence_ids``, a tensor shaped ``[*rows, hidden]`` by
        the current pass's rows (``[batch, seq]`` for HF, ``[tokens]`` for vLLM) inherits the
        pass's row metadata, and only the rows its family keeps are recorded (none: no record).
        """
        if self._writer is None:
            raise UsageError("capture is not active; use it as a context manager")
        if not isinstance(tensor, torch.Tensor):
            raise UsageError(f"dump({name!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _STORAGE_CODES:
            raise UsageError(f"dump({name!r}): dtype {tensor.dtype} cannot be stored")
        shape = tuple(int(s) for s in tensor.shape)
        meta = {**self._pass_meta, **meta} if self._pass_meta else meta
        layer, shard_dim, meta = checked_record_args(name, shape, layer, point, shard_dim, meta)
        ctx, owned = self._rows, False  # owned: a fresh tensor of ours, which the writer takes without a copy
        if positions is None and sequence_ids is None and ctx is not None and shape[:-1] == ctx.shape:
            if ctx.empty:
                return
            positions, sequence_ids, tensor, owned = (
                ctx.positions,
                ctx.sequence_ids,
                ctx.select(tensor),
                ctx.keep is not None,
            )
            shape = tuple(int(s) for s in tensor.shape)
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        forward_pass = self._cur_pass if self._cur_pass is not None else self._start_pass()
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        key = name if call == 0 else f"{name}#{call}"
        tensor, companions, sketched = sketch_for_record(
            self._sketcher, tensor, key, point=point, shard_dim=shard_dim, code=_STORAGE_CODES[tensor.dtype]
        )
        self._writer.put(forward_pass, key, tensor, companions=companions, owned=owned or sketched is not None)
        self._records.append(
            TensorRecord(
                name=name,
                file="",
                key=key,
                shape=tuple(int(s) for s in tensor.shape),
                dtype=_STORAGE_CODES[tensor.dtype],
                forward_pass=forward_pass,
                rank=self.rank,
                call=call,
                layer=layer,
                point=point,
                positions=as_runs(positions, rows, "positions"),
                sequence_ids=as_runs(sequence_ids, rows, "sequence_ids"),
                shard_dim=shard_dim,
                meta=meta,
                sketch=sketched,
            )
        )

    def record_router(
        self,
        prefix: str,
        layer: int,
        parts: dict[str, torch.Tensor],
        *,
        positions: Any = None,
        sequence_ids: Any = None,
        scores_meta: dict[str, int] | None = None,
    ) -> None:
        """Record MoE layer ``layer``'s routing ``parts`` as ``{prefix}.router.*`` (``routing.router_records``;
        ``scores_meta``: ``routing.router_meta``), rows labelled by ``positions`` and ``sequence_ids``, else as
        :meth:`record` does."""
        shape = self._rows.shape if self._rows is not None and positions is None else None
        for name, point, tensor, meta in router_records(prefix, parts, shape, scores_meta):
            self.record(name, tensor, layer=layer, point=point, positions=positions, sequence_ids=sequence_ids, **meta)
