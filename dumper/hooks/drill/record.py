"""Record every op a module dispatches, in order, each judged at once against its float64 reference.

:class:`OpRecorder` is a ``TorchDispatchMode``: it sees every aten op and every custom op (vLLM's
``_C`` kernels, its opaque attention op) the module's forward dispatches, without changing any of
them (each runs exactly as it would; the recorder only reads). Module hooks keep the path of the
innermost submodule running (``model.layers.2.mlp.down_proj``), so each op is named by where it ran.
Right after an op returns, it runs again on its own inputs in float64 (:mod:`dumper.hooks.drill.
reference`) and its error is measured per token row against what rounding predicts
(:mod:`dumper.hooks.drill.rounding`); the first op beyond ``factor`` times its rounding keeps its
inputs, output and reference for a standalone repro (:mod:`dumper.hooks.drill.repro`).

Example::

    rec = OpRecorder(half_path="model.layers.2.mlp", positions=range(n), tokens=[20])
    with rec.watch(model.model.layers[2].mlp, "model.layers.2.mlp"), rec:
        model.model.layers[2].mlp(x)
    rec.entries[0].op, rec.first.entry.ratio      # "aten.linear.default", 340.0
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dumper.errors import error_reason
from dumper.format.drill import OpEntry, TensorMeta
from dumper.hooks.drill.reference import (
    NOT_JUDGED,
    UNINITIALIZED,
    OpCall,
    judged_outputs,
    reference_for,
    written_args,
)
from dumper.hooks.drill.rounding import row_ratios, token_dim

__all__ = [
    "OpRecorder",
    "ReproCase",
    "DEFAULT_FACTOR",
    "ROWS_BUDGET",
    "encode_value",
    "tensor_meta",
    "half_module",
    "write_log",
]

DEFAULT_FACTOR = 16.0
"""An op is far beyond its rounding at this many times it (a clean half of the real checkpoint stays within a few)."""
ROWS_BUDGET = 1 << 20
"""Bytes of one op's output rows at the tokens of interest the log stores; a larger op keeps its hash and stats."""


@dataclass
class ReproCase:
    """The first op beyond its rounding, with everything a standalone repro needs."""

    entry: OpEntry
    func: Any
    args: tuple
    kwargs: dict
    """The op's arguments as it received them (written tensors as they were before the call), cloned."""
    observed: list[torch.Tensor]
    reference: list[torch.Tensor]
    mags: list[torch.Tensor | None]
    row: int | None
    """The row (along the first output's token dimension) of the largest ratio."""


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(t.stride()))


def encode_value(v: Any) -> Any:
    """A non-tensor argument as JSON: numbers, strings, None and lists as they are, a dtype as ``{"dtype": ...}``,
    anything else as its ``repr`` (not replayable)."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": str(v)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.memory_format | torch.layout):
        return {"enum": str(v).removeprefix("torch.")}
    if isinstance(v, list | tuple) and not any(isinstance(x, torch.Tensor) for x in v):
        return [encode_value(x) for x in v]
    return {"repr": repr(v)[:200]}


def _call_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Every argument the op got, in schema order (defaults left out where not given)."""
    out = list(args)
    for a in func._schema.arguments[len(args) :]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
    return out


def _input_metas(func: Any, args: tuple, kwargs: dict) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """Each argument's :class:`TensorMeta` (a list of tensors: one each) or value, and which of them the op writes."""
    metas: list[Any] = []
    writes: list[int] = []
    written = {i for i, _ in written_args(func)}
    for i, v in enumerate(_call_args(func, args, kwargs)):
        if isinstance(v, torch.Tensor):
            if i in written:
                writes.append(len(metas))
            metas.append(tensor_meta(v))
        elif isinstance(v, list | tuple) and any(isinstance(x, torch.Tensor) for x in v):
            metas.extend(tensor_meta(x) if isinstance(x, torch.Tensor) else {"value": encode_value(x)} for x in v)
        else:
            metas.append({"value": encode_value(v)})
    return tuple(metas), tuple(writes)


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(memoryview(data.numpy())).hexdigest()[:16]


def _stats(t: torch.Tensor) -> dict[str, float]:
    """Mean and largest magnitude over the finite elements, and how many are not finite (integers: all finite)."""
    x = t.detach().to(torch.float64)
    finite = torch.isfinite(x)
    vals = x[finite]
    return {
        "mean": float(vals.mean()) if vals.numel() else 0.0,
        "absmax": float(vals.abs().max()) if vals.numel() else 0.0,
        "nonfinite": float((~finite).sum()),
    }


def _aliases(outs: list[torch.Tensor], args: tuple) -> bool:
    """Whether every output shares memory with an input (a view; ``aten.to`` is one only when it changes nothing)."""
    ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return all(o.untyped_storage().data_ptr() in ptrs for o in outs)


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list | tuple):
        return type(v)(_clone(x) for x in v)
    return v


@dataclass
class OpRecorder(TorchDispatchMode):
    """Records and judges every op dispatched while it is entered (see the module docstring).

    ``positions``: the position of each row of the drilled forward (row ``i`` of a token dimension is
    position ``positions[i]``); ``tokens``: the positions whose rows the log keeps; ``state``: what the
    engine adapter knows that ops do not show (:class:`~dumper.hooks.drill.reference.OpCall`).
    """

    half_path: str
    positions: list[int]
    tokens: list[int]
    factor: float = DEFAULT_FACTOR
    state: dict[str, Any] = field(default_factory=dict)
    entries: list[OpEntry] = field(default_factory=list)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    first: ReproCase | None = None
    _stack: list[tuple[str, nn.Module]] = field(default_factory=list)
    _slots: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        super().__init__()
        self.positions = [int(p) for p in self.positions]
        row_of = {p: i for i, p in enumerate(self.positions)}
        missing = [t for t in self.tokens if t not in row_of]
        if missing:
            raise ValueError(f"tokens {missing} are not among the drilled positions")
        self._token_rows = torch.tensor([row_of[t] for t in self.tokens], dtype=torch.long)

    @contextlib.contextmanager
    def watch(self, module: nn.Module, prefix: str) -> Iterator[None]:
        """Keep the path of the innermost submodule of ``module`` (named under ``prefix``) running, while inside."""
        handles = []
        for name, m in module.named_modules(prefix=prefix):

            def enter(mod: nn.Module, args: Any, name: str = name) -> None:
                self._stack.append((name, mod))

            def leave(mod: nn.Module, args: Any, out: Any) -> None:
                if self._stack:
                    self._stack.pop()

            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()

    def __torch_dispatch__(self, func: Any, types: Iterable[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        writes = written_args(func)
        before_args, before_kwargs = args, kwargs
        if writes:
            positions, names = {i for i, _ in writes}, {n for _, n in writes}
            before_args = tuple(_clone(a) if i in positions else a for i, a in enumerate(args))
            before_kwargs = {k: _clone(v) if k in names else v for k, v in kwargs.items()}
        result = func(*args, **kwargs)
        self._record(func, args, kwargs, before_args, before_kwargs, result)
        return result

    def _record(self, func: Any, args: tuple, kwargs: dict, pre_args: tuple, pre_kwargs: dict, result: Any) -> None:
        path, module = self._stack[-1] if self._stack else (self.half_path, None)
        slot = self._slots[path]
        self._slots[path] += 1
        index = len(self.entries)
        name = func._schema.name
        outs = judged_outputs(func, args, kwargs, result)
        n = len(self.positions)
        first = outs[0] if outs else None
        uninit = name in UNINITIALIZED
        dim = token_dim(first.shape, n) if first is not None else None
        ratio: float | None = None
        ratio_token: int | None = None
        size = 1
        ratios0: torch.Tensor | None = None
        judged: tuple[list[torch.Tensor], list[torch.Tensor | None], int | None] | None = None
        if uninit:
            reference = "none: memory not yet written"
        elif func.is_view and _aliases(outs, args):
            reference = "none: a view (exact)"
        elif name in NOT_JUDGED:
            reference = f"none: {NOT_JUDGED[name]}"
        elif not any(o.is_floating_point() for o in outs):
            reference = "none: no floating output"
        elif (ref := reference_for(func)) is None:
            reference = f"none: no float64 reference for {name} (dumper.hooks.drill.register_reference adds one)"
        else:
            try:
                vals, mags, size = ref.fn(OpCall(func, pre_args, pre_kwargs, module=module, state=self.state))
                if len(vals) != len(outs):
                    raise ValueError(f"{len(vals)} reference outputs for the op's {len(outs)}")
                ratio, ratio_token, ratios0, worst_row = self._judge(outs, vals, mags, size, n)
                reference = ref.name
                judged = (vals, list(mags), worst_row)
            except Exception as e:  # noqa: BLE001 - a reference that cannot run is reported, not fatal
                reference = f"none: the float64 reference failed ({error_reason(e)})"
        entry = self._entry(
            index, func, path, slot, args, kwargs, outs, dim, uninit, reference, ratio, ratio_token, size
        )
        self.entries.append(entry)
        self._keep_rows(index, first, dim, ratios0)
        if judged is not None and self.first is None and not ratio <= self.factor:
            vals, mags, worst_row = judged
            self.first = ReproCase(
                entry,
                func,
                _clone(pre_args),
                _clone(pre_kwargs),
                [o.detach().clone() for o in outs],
                [v.detach() for v in vals],
                mags,
                worst_row,
            )

    def _entry(
        self,
        index: int,
        func: Any,
        path: str,
        slot: int,
        args: tuple,
        kwargs: dict,
        outs: list[torch.Tensor],
        dim: int | None,
        uninit: bool,
        reference: str,
        ratio: float | None,
        ratio_token: int | None,
        size: int,
    ) -> OpEntry:
        first = outs[0] if outs else None
        inputs, writes = _input_metas(func, args, kwargs)
        return OpEntry(
            index=index,
            op=str(func),
            path=path,
            slot=slot,
            inputs=inputs,
            writes=writes,
            outputs=tuple(tensor_meta(o) for o in outs),
            token_dim=dim if not uninit else None,
            hash=None if first is None or uninit or reference.endswith("(exact)") else _digest(first),
            stats={} if first is None or uninit or reference.endswith("(exact)") else _stats(first),
            rows=None,
            reference=reference,
            ratio=ratio,
            ratio_token=ratio_token,
            size=max(1, int(size)),
        )

    def _judge(
        self, outs: list[torch.Tensor], vals: list[torch.Tensor], mags: list, size: int, n: int
    ) -> tuple[float, int | None, torch.Tensor | None, int | None]:
        """The op's largest row ratio over its floating outputs, the position of that row, the first output's
        per-row ratios (None: no token dimension) and the row of the largest ratio."""
        worst, token, row, first_rows = -1.0, None, None, None
        for j, (o, v) in enumerate(zip(outs, vals, strict=False)):
            if not o.is_floating_point():
                continue
            dim = token_dim(o.shape, n)
            r = row_ratios(o, v, mags[j] if j < len(mags) else None, size, dim)
            if j == 0 and dim is not None:
                first_rows = r
            i = int(torch.argmax(torch.nan_to_num(r, nan=math.inf)))
            value = float(r[i])
            if value > worst or math.isnan(value):
                worst = value
                token = self.positions[i] if dim is not None else None
                row = i if dim is not None else None
        return worst, token, first_rows, row

    def _keep_rows(self, index: int, first: torch.Tensor | None, dim: int | None, ratios: torch.Tensor | None) -> None:
        if ratios is not None:
            self.rows[f"op{index}.ratio"] = ratios.to("cpu", torch.float32)
        if first is None or dim is None or self.entries[index].hash is None:
            return
        picked = first.detach().index_select(dim, self._token_rows.to(first.device)).movedim(dim, 0)
        if picked.numel() * picked.element_size() > ROWS_BUDGET:
            return
        key = f"op{index}"
        self.rows[key] = picked.to("cpu", non_blocking=False).contiguous()
        entry = self.entries[index]
        self.entries[index] = OpEntry(**{**entry.__dict__, "rows": key})


def half_module(model: nn.Module, layer: int, half: str, family: Any, label: str) -> tuple[str, str, nn.Module]:
    """The decoder stack's name, the path and the module of one half (``attn`` or ``mlp``) of decoder layer ``layer``,
    named as ``family`` (:class:`~dumper.hooks.families.FamilyAdapter`) names its children; refused in one line
    (``label``: the model, as the message names it) when the model has no such layer or child."""
    from dumper.errors import UsageError
    from dumper.format.drill import HALF_NAMES
    from dumper.hooks.layers import find_decoder_layers, named_child

    stack_name, layers = find_decoder_layers(model, family.attention_names)
    if layer >= len(layers):
        raise UsageError(f"drill --layer {layer}: {label} has {len(layers)} decoder layers")
    names = family.attention_names if half == "attn" else family.mlp_names
    child = named_child(layers[layer], names)
    if child is None:
        raise UsageError(f"drill: layer {layer} of {label} has no {HALF_NAMES[half]} child ({', '.join(names)})")
    return f"{stack_name}.{layer}.{child[0]}", child[1]


def write_log(out: str | Path, header: dict[str, Any], recorder: OpRecorder) -> Path:
    """Write ``recorder``'s log to directory ``out`` (:mod:`dumper.format.drill`): rows first, ``drill.json`` last,
    in a temporary directory renamed into place (:func:`~dumper.format.atomic.atomic_dir`), so an interrupted drill
    leaves nothing that looks finished. Refused when ``out`` exists and is not empty."""
    import json

    from safetensors.torch import save_file

    from dumper.format.atomic import atomic_dir
    from dumper.format.drill import DRILL_FORMAT, DRILL_NAME, DRILL_VERSION, ROWS_NAME

    with atomic_dir(out, "--out") as tmp:
        save_file(recorder.rows, str(tmp / ROWS_NAME))
        body = {
            "format": DRILL_FORMAT,
            "version": DRILL_VERSION,
            **header,
            "factor": recorder.factor,
            "tokens": list(recorder.tokens),
            "ops": [e.to_json() for e in recorder.entries],
        }
        (tmp / DRILL_NAME).write_text(json.dumps(body, indent=1))
    return Path(out)
