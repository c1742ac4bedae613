"""The hook API: capture self-attention inputs (and residual streams) of a model, and ``dump()`` from anywhere.

Example::

    import dumper
    with dumper.capture(model, "dumps/a", layers="all", points=("input", "residual")):
        model(input_ids)                      # one forward pass
        dumper.dump("my.tensor", x, layer=3)  # explicit record into the same capture

Every top-level ``model(...)`` call is one forward pass; ``dumper.step()`` delimits passes by
hand. What a pass's rows are (positions, sequences) and which argument holds the hidden states
comes from the model's family adapter (:mod:`dumper.hooks.families`: HF by default, vLLM for vLLM's
models). Hooks are removed on exit, also when the body raises; the manifest is written only on
a clean exit that recorded at least one tensor, so an interrupted or empty run never looks
complete. A failure inside a hook is raised as :class:`InternalError` (a driftscope bug), so
that callers can tell it from an error of the model's own code running around it.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import functools
import itertools
import json
import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn

from dumper.errors import CorruptDumpError, DriftscopeError, DumpError, InternalError, UsageError
from dumper.hooks.fingerprint import environment_fingerprint
from dumper.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    TensorRecord,
    write_json_atomic,
    write_manifest,
)
from dumper.hooks.families import FamilyAdapter, PassRows, SharedRows, as_runs, resolve_model, shared_row_tensors
from dumper.hooks.layers import ATTN_INPUT, RESIDUAL, HookTarget, hook_targets
from dumper.settings import env_settings
from dumper.format.validate import check_extra, first_bad_text
from dumper.hooks.writer import ShardWriter

__all__ = ["Capture", "capture", "dump", "step", "active_capture", "ATTN_INPUT", "RESIDUAL"]

_ACTIVE: Capture | None = None
_ENV_DIR: str | None = env_settings().dump_dir
TORCH_STORAGE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                 torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                 torch.uint8: "U8", torch.bool: "BOOL"}
"""torch dtype -> the dump format's dtype name, for every dtype a dump can store."""


def _hook_guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook; anything it raises that is not a :class:`DriftscopeError` is a driftscope bug (InternalError).

    Hooks run inside the model's forward pass, where the run's boundary turns other exceptions
    into "the model's forward failed"; this keeps driftscope's own failures exit 3.
    """
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (DriftscopeError, InternalError):
            raise
        except Exception as e:
            raise InternalError(f"driftscope hook {fn.__name__} failed ({type(e).__name__}: {e})") from e

    return guarded


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _checked_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` as the JSON the manifest will hold, refused now (not at exit) where the reader would refuse it."""
    try:
        out = json.loads(json.dumps(dict(extra or {}), allow_nan=False))
        check_extra(out, "capture(extra=...)")
    except (TypeError, ValueError) as e:
        raise UsageError(f"capture(extra=...): not storable as JSON ({e})") from None
    except CorruptDumpError as e:
        raise UsageError(str(e)) from None
    return out


def _checked_args(name: Any, shape: tuple[int, ...], layer: Any, point: Any, shard_dim: Any,
                  meta: dict[str, Any]) -> tuple[int | None, int | None, dict[str, Any]]:
    """Validate what :meth:`Capture.record` stores beside the data; return (layer, shard_dim, meta) as stored.

    Refused here, in the caller's frame, is everything the reader would refuse in the manifest
    (:mod:`dumper.format.validate`): a name that is not non-empty text, a non-integer layer (numpy and
    torch integer scalars are integers, ``True`` is not), a non-text point, and a tensor of
    rows but no columns, which the reader cannot tell from one declaring 2^31 rows to make the
    aligner allocate (it asks a byte of file per row).
    """
    if type(name) is not str or not name or not name.isprintable() or first_bad_text(name, "name") is not None:
        raise UsageError(f"dump({name!r}): the name must be a non-empty string of printable, valid Unicode")
    if len(shape) > 1 and shape[-1] == 0 and math.prod(shape[:-1]) > 0:
        raise UsageError(f"dump({name!r}): shape {list(shape)} has rows but a last dim of 0; a dump cannot "
                         "hold such a zero-width tensor (skip it: it holds no values)")
    layer, shard_dim = _index(name, "layer", layer), _index(name, "shard_dim", shard_dim)
    if point is not None and (type(point) is not str or first_bad_text(point, "point") is not None):
        raise UsageError(f"dump({name!r}): point must be a string or None, got {point!r}")
    if shard_dim is not None:
        if not -len(shape) <= shard_dim < len(shape):
            raise UsageError(f"dump({name!r}): shard_dim {shard_dim} is out of range for shape {list(shape)}")
        shard_dim %= len(shape)
    stored: dict[str, Any] = {}
    for k, v in meta.items():
        v = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if isinstance(v, float) and not math.isfinite(v) or isinstance(v, str) and first_bad_text(v, k) is not None \
                or first_bad_text(k, k) is not None:
            raise UsageError(f"dump({name!r}): meta {k!r}={v!r} cannot be stored (JSON needs finite numbers "
                             "and valid Unicode text)")
        stored[k] = v
    return layer, shard_dim, stored


def _index(name: str, what: str, v: Any) -> int | None:
    """``v`` as a Python int (any integer scalar, via ``operator.index``), or None; a bool or non-integer raises."""
    if v is None:
        return None
    try:
        if isinstance(v, (bool, np.bool_)) or isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            raise TypeError
        i = operator.index(v)
    except TypeError:
        raise UsageError(f"dump({name!r}): {what} must be an integer or None, got {v!r}") from None
    if not -(1 << 63) <= i < 1 << 63:
        raise UsageError(f"dump({name!r}): {what} {i} is out of the int64 range")
    return i


class Capture:
    """A scoped capture into one dump directory; use :func:`capture` to create it.

    ``model`` may be ``None``: then only explicit :func:`dump` calls record. What is read from
    the model's calls (hidden-state argument, positions, sequences) comes from its family
    adapter (:mod:`dumper.hooks.families`).
    """

    def __init__(self, model: nn.Module | Any | None, out_dir: str | Path, *, layers: str | Sequence[int] | None = None,
                 modules: str | None = None, points: str | Sequence[str] | None = None,
                 model_name: str | None = None, shard_bytes: int = 512 << 20, extra: dict[str, Any] | None = None,
                 identity: dict[str, Any] | None = None, signature: dict[str, Any] | None = None,
                 environment: dict[str, Any] | None = None) -> None:
        self.model, self._family = resolve_model(model)
        model = self.model
        # what the manifest says about the model, the capture and the environment when no
        # nn.Module is hooked (an engine adapter fills them in; see dumper.engines.base)
        self._identity, self._signature, self._environment = identity, signature, dict(environment or {})
        self.out_dir = Path(out_dir)
        self.rank, self.world_size = _dist_rank_world()
        self.extra = _checked_extra(extra)
        if model_name is not None and first_bad_text(model_name, "model_name") is not None:
            raise UsageError(f"capture(model_name={model_name!r}): expected valid Unicode text")
        self._shard_bytes = shard_bytes
        self._targets, self._num_layers = (hook_targets(model, self._family, layers=layers, modules=modules,
                                                        points=points) if model is not None else ([], 0))
        self._model_name = model_name
        self._handles: list[Any] = []
        self._records: list[TensorRecord] = []
        self._writer: ShardWriter | None = None
        self._pass_count = 0
        self._cur_pass: int | None = None
        self._calls: dict[str, int] = {}
        self._depth = 0
        self._rows: PassRows | None = None
        self._prev_active: Capture | None = None
        self._made_dir = False

    @property
    def family(self) -> FamilyAdapter:
        """This capture's model-family adapter (:mod:`dumper.hooks.families`): what it reads from the model's calls."""
        return self._family

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        global _ACTIVE
        if (self.out_dir / MANIFEST_NAME).exists():
            raise DumpError(f"{self.out_dir}: already holds a complete dump; choose another directory")
        try:
            self._made_dir = not self.out_dir.exists()
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DumpError(f"{self.out_dir}: cannot create dump directory ({e.strerror})") from None
        stale = [p.name for p in self.out_dir.glob(f"r{self.rank}-p*.safetensors")]
        if stale:
            raise DumpError(f"{self.out_dir}: holds data files of an unfinished dump ({stale[0]}, ...); "
                            "delete them or choose another directory")
        self._writer = ShardWriter(self.out_dir, self.rank, shard_bytes=self._shard_bytes)
        try:
            if self.model is not None:
                self._handles.append(self.model.register_forward_pre_hook(self._on_model_start, with_kwargs=True))
                self._handles.append(self.model.register_forward_hook(self._on_model_end, always_call=True))
                for target in self._targets:
                    self._handles.append(target.module.register_forward_pre_hook(
                        self._make_input_hook(target), with_kwargs=True))
        except BaseException:
            self._remove_hooks()
            raise
        self._prev_active, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        global _ACTIVE
        try:
            self._remove_hooks()
        finally:
            _ACTIVE = self._prev_active
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
        if not complete:
            return
        records = tuple(replace(r, file=writer.locations[(r.forward_pass, r.key)]) for r in self._records)
        files = dict(writer.files)
        shared = self._family.shared_rows()
        if shared and records:
            records += self._write_shared(records, files, shared)
        part = {"files": files, "tensors": [r.to_json() for r in records]}
        if self.world_size > 1:
            index = self.out_dir / f"index-r{self.rank}.json"
            write_json_atomic(index, part)
            torch.distributed.barrier()
            files, merged = self._read_parts()  # every rank reads them, so every rank sees an empty run
            if self.rank == 0 and merged:
                self._write_manifest(files, merged)
            torch.distributed.barrier()
            if not merged:
                index.unlink(missing_ok=True)
                self._refuse_empty()
        elif not records:
            self._refuse_empty()
        else:
            self._write_manifest(files, records)

    def _write_shared(self, records: tuple[TensorRecord, ...], files: dict[str, int],
                      shared: list[SharedRows]) -> tuple[TensorRecord, ...]:
        """Write the rows prefix-cache hits reused (:meth:`FamilyAdapter.shared_rows`) as the hit sequences'
        own, in one extra pass, so that a hit's positions are complete; ``meta`` says ``shared_prefix``."""
        found = shared_row_tensors(self.out_dir, records, shared)
        if not found:
            return ()
        writer = ShardWriter(self.out_dir, self.rank, shard_bytes=self._shard_bytes)
        forward_pass, self._pass_count = self._pass_count, self._pass_count + 1
        out = []
        for rec, rows, pos, seq in found:
            key = rec.name if rec.call == 0 else f"{rec.name}#{rec.call}"
            writer.put(forward_pass, key, rows)
            out.append(replace(rec, key=key, shape=tuple(int(s) for s in rows.shape), forward_pass=forward_pass,
                               positions=as_runs(pos, len(pos), "positions"),
                               sequence_ids=as_runs(seq, len(seq), "sequence_ids"),
                               meta={**rec.meta, "shared_prefix": True}))
        writer.close()
        files.update(writer.files)
        return tuple(replace(r, file=writer.locations[(forward_pass, r.key)]) for r in out)

    def _refuse_empty(self) -> NoReturn:
        """An exit that recorded nothing writes no manifest: leave no dump (and no directory we made)."""
        if self._made_dir and self.rank == 0:
            try:
                self.out_dir.rmdir()  # only if empty: never delete what someone else put there
            except OSError:
                pass
        hooked = ", ".join(t.name for t in self._targets[:4]) + (" ..." if len(self._targets) > 4 else "")
        raise DumpError(f"{self.out_dir}: the capture recorded no tensors "
                        f"({'hooked ' + hooked + ' never ran' if hooked else 'no module hooked'} "
                        "and nothing called dumper.dump()); no dump was written")

    def _read_parts(self) -> tuple[dict[str, int], tuple[TensorRecord, ...]]:
        files: dict[str, int] = {}
        records: list[TensorRecord] = []
        for r in range(self.world_size):
            part = json.loads((self.out_dir / f"index-r{r}.json").read_text())
            files.update(part["files"])
            records.extend(TensorRecord.from_json(t) for t in part["tensors"])
        return files, tuple(records)

    def _write_manifest(self, files: dict[str, int], records: tuple[TensorRecord, ...]) -> None:
        device = next((p.device for p in self.model.parameters()), None) if self.model is not None else None
        dtype = next((str(p.dtype).replace("torch.", "") for p in self.model.parameters()), None) \
            if self.model is not None else None
        attn = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        signature = {  # layers: decoder layers (the final norm's residual, at layer num_layers, is not one)
            "layers": sorted({t.layer for t in self._targets if t.layer is not None and t.layer < self._num_layers}),
            "modules": [t.name for t in self._targets],
            "points": [p for p in (ATTN_INPUT, RESIDUAL) if any(t.point == p for t in self._targets)],
            "num_layers": self._num_layers,
            "world_size": self.world_size,
            "dtype": dtype,
            **(self._signature or {}),
        }
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            model=self._identity if self._identity is not None else self._family.identity(self._model_name),
            capture_signature=signature,
            environment={**environment_fingerprint(device, attn), **self._family.environment(), **self._environment},
            files=dict(sorted(files.items())),
            tensors=records,
            extra=self.extra,
        )
        write_manifest(self.out_dir, manifest)

    # -- forward passes --------------------------------------------------------------------
    def step(self) -> None:
        """End the current forward pass; the next record starts a new one."""
        if self._cur_pass is not None and self._writer is not None:
            self._writer.end_pass()
        self._cur_pass = None
        self._calls.clear()

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        """Sequence id of each batch row for the following passes (``None``: number them anew).

        Not needed for chunked prefill or decoding over one KV cache: a pass whose rows continue
        the previous pass's rows continues their sequences (see :class:`dumper.hooks.families.HFFamily`).
        """
        self._family.set_sequence_ids(ids)

    def _start_pass(self) -> int:
        self.step()
        self._cur_pass = self._pass_count
        self._pass_count += 1
        return self._cur_pass

    @_hook_guard
    def _on_model_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self._depth == 1:
            self._start_pass()
            self._rows = self._pass_rows(args, kwargs)

    @_hook_guard
    def _on_model_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            rows, self._rows = self._rows, None
            self._family.end_pass(rows)
            self.step()

    def _pass_rows(self, args: tuple, kwargs: dict) -> PassRows | None:
        """Row metadata of a pass from the top-level call's inputs, as the model's family reads them."""
        return self._family.pass_rows(args, kwargs)

    def _make_input_hook(self, target: HookTarget):
        """A pre-hook recording ``target``'s input as ``{name}.{point}``: the attention input, or the residual."""
        point_name, layer, point = f"{target.name}.{target.point}", target.layer, target.point
        read = self._family.residual_input if point == RESIDUAL else self._family.hidden_input

        @_hook_guard
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = read(args, kwargs)
            if not isinstance(hidden, torch.Tensor):
                return
            self._rows = self._family.module_rows(self._rows, kwargs)
            self.record(point_name, hidden, layer=layer, point=point)

        return hook

    # -- recording -------------------------------------------------------------------------
    def record(self, name: str, tensor: torch.Tensor, *, layer: int | None = None, point: str | None = None,
               positions: Any = None, sequence_ids: Any = None, shard_dim: int | None = None, **meta: Any) -> None:
        """Record one tensor into the current forward pass (starting one if needed).

        Without explicit ``positions`` / ``sequence_ids``, a tensor shaped ``[*rows, hidden]`` by
        the current pass's rows (``[batch, seq]`` for HF, ``[tokens]`` for vLLM) inherits the
        pass's row metadata, and only the rows its family keeps are recorded (none: no record).
        """
        if self._writer is None:
            raise UsageError("capture is not active; use it as a context manager")
        if not isinstance(tensor, torch.Tensor):
            raise UsageError(f"dump({name!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in TORCH_STORAGE:
            raise UsageError(f"dump({name!r}): dtype {tensor.dtype} cannot be stored")
        shape = tuple(int(s) for s in tensor.shape)
        layer, shard_dim, meta = _checked_args(name, shape, layer, point, shard_dim, meta)
        ctx = self._rows
        if positions is None and sequence_ids is None and ctx is not None and shape[:-1] == ctx.shape:
            if ctx.empty:
                return
            positions, sequence_ids, tensor = ctx.positions, ctx.sequence_ids, ctx.select(tensor)
            shape = tuple(int(s) for s in tensor.shape)
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        forward_pass = self._cur_pass if self._cur_pass is not None else self._start_pass()
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        key = name if call == 0 else f"{name}#{call}"
        self._writer.put(forward_pass, key, tensor)
        self._records.append(TensorRecord(
            name=name, file="", key=key, shape=shape, dtype=TORCH_STORAGE[tensor.dtype],
            forward_pass=forward_pass, rank=self.rank, call=call, layer=layer, point=point,
            positions=as_runs(positions, rows, "positions"),
            sequence_ids=as_runs(sequence_ids, rows, "sequence_ids"), shard_dim=shard_dim,
            meta=meta,
        ))


def capture(model: nn.Module | Any | None, out_dir: str | Path, *, layers: str | Sequence[int] | None = None,
            modules: str | None = None, points: str | Sequence[str] | None = None, model_name: str | None = None,
            shard_bytes: int = 512 << 20, extra: dict[str, Any] | None = None) -> Capture:
    """Capture self-attention inputs (and, with ``points``, residual streams) of ``model`` into ``out_dir``.

    Args:
        model: a HF causal LM (decoder layers are found automatically), a vLLM model or
            ``vllm.LLM`` running in this process (see :mod:`dumper.engines.vllm_hooks`), a model
            of a family registered in :mod:`dumper.hooks.families`, any module with ``modules=`` given,
            or ``None`` to record only explicit :func:`dump` calls.
        out_dir: the dump directory; it must not already hold a dump.
        layers: layer spec (default ``"first,last,every:8"``), see :func:`dumper.hooks.layers.parse_layer_spec`.
        modules: fnmatch pattern(s) of module names to hook instead of the self-attention modules.
        points: capture points, default ``("input",)``: ``"input"`` records ``{attention}.input``
            (after the layer's input norm), ``"residual"`` records ``model.layers.{i}.residual``
            (the decoder layer's input, before its norm; layer ``i``) and, with the last layer
            selected, ``model.norm.residual`` (the final norm's input; layer ``num_layers``).
        model_name: the model's name or path, recorded in the manifest.
        shard_bytes: largest data file size before a forward pass is split into shards.
        extra: free-form JSON metadata stored in the manifest (e.g. the prompts).
    """
    return Capture(model, out_dir, layers=layers, modules=modules, points=points, model_name=model_name,
                   shard_bytes=shard_bytes, extra=extra)


def active_capture() -> Capture | None:
    """The capture that :func:`dump` records into now, if any."""
    return _ACTIVE


def _env_capture() -> Capture | None:
    """Start the capture that ``DRIFTSCOPE_DUMP_DIR`` asks for, once; ``None`` when it cannot start.

    It runs inside model code (the first :func:`dump` call), so it never raises there: a
    directory that already holds a dump gets a numbered sibling (``DIR.1``, ``DIR.2``, ... the
    first free one), and a directory that cannot be created turns recording off. Either is
    said once on stderr.
    """
    global _ENV_DIR
    assert _ENV_DIR is not None
    base, _ENV_DIR = Path(_ENV_DIR), None
    directory = _free_dump_dir(base, _dist_rank_world()[0])
    if directory != base:
        print(f"driftscope: DRIFTSCOPE_DUMP_DIR={base} already holds a dump; recording to {directory}",
              file=sys.stderr)
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
    cap = _ACTIVE
    if cap is None:
        if _ENV_DIR is None:
            return
        cap = _env_capture()
        if cap is None:
            return
    cap.record(name, tensor, **meta)


def step() -> None:
    """End the active capture's current forward pass (for captures without a model)."""
    if _ACTIVE is not None:
        _ACTIVE.step()
