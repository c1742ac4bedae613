"""The drill log: every op one half of a decoder layer dispatched, in order, each judged against a float64 reference.

``python -m dumper drill`` (:mod:`dumper.jobs.drill`) writes a directory::

    drill.json        the header and one entry per op (written last: a log without it is incomplete)
    ops.safetensors   per op: its output rows at the tokens of interest (``op{i}``, token first) and,
                      for an op whose output has a token dimension, its error-to-rounding ratio per row
                      (``op{i}.ratio``, float32 [n])

An op entry (:class:`OpEntry`) names the op (``aten.mm.default``, ``_C.silu_and_mul.default``), the module
path it ran under (``model.layers.2.mlp.down_proj``) and its slot (its position among that path's ops),
its inputs and outputs (shape, dtype, stride; a non-tensor argument as its value), a hash and statistics
of its first output, and its judgement: the largest ratio of its error against its own float64
reference to the rounding its dtype predicts for an op of that size, and the token of that row
(:mod:`dumper.hooks.drill.rounding`). :func:`load_drill` checks all of it and refuses a bad log
with one line naming the file and the field.

Example::

    from dumper.format.drill import load_drill
    log = load_drill("drills/b")
    bad = log.first_beyond()          # the first op far beyond its rounding, or None
    print(log.summary())              # "layer 2 MLP: aten.mm (model.layers.2.mlp.down_proj, ...) is 340x ..."
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dumper.errors import CorruptDumpError, DumpError, IncompleteDumpError

__all__ = [
    "DRILL_FORMAT",
    "DRILL_VERSION",
    "DRILL_NAME",
    "ROWS_NAME",
    "HALF_NAMES",
    "TensorMeta",
    "OpEntry",
    "DrillLog",
    "load_drill",
    "read_rows",
    "describe_op",
]

DRILL_FORMAT = "driftscope-drill"
DRILL_VERSION = 1
DRILL_NAME = "drill.json"
ROWS_NAME = "ops.safetensors"
HALF_NAMES = {"attn": "attention", "mlp": "MLP"}
"""``--half`` values and how a verdict line names them."""
_DTYPES = {"float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument or result as the op saw it: shape, dtype (torch's name without ``torch.``) and strides."""

    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "stride": list(self.stride)}

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "tensor", path: Path = Path(DRILL_NAME)) -> TensorMeta:
        """The inverse of :meth:`to_json`, checked: :class:`CorruptDumpError` naming ``path`` and ``where``."""
        return _meta(path, where, raw)

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.shape))}]"


Arg = TensorMeta | dict[str, Any]
"""An op argument: a tensor's :class:`TensorMeta`, or ``{"value": ...}`` for anything else (its JSON value or repr)."""


@dataclass(frozen=True)
class OpEntry:
    """One dispatched op and its judgement against its float64 reference."""

    index: int
    op: str
    path: str
    slot: int
    inputs: tuple[Arg, ...]
    outputs: tuple[TensorMeta, ...]
    token_dim: int | None
    """The dimension of the first output that runs over the drilled tokens (None: it has none, e.g. a weight's view)."""
    hash: str | None
    """sha256 (16 hex digits) of the first output's bytes; None: no output tensor."""
    stats: dict[str, float]
    """The first output's ``mean``, ``absmax`` (over finite elements) and ``nonfinite`` (count)."""
    rows: str | None
    """The key in ``ops.safetensors`` of the first output's rows at the log's tokens of interest, token dimension
    first (None: not stored: no token dimension)."""
    reference: str
    """``float64`` (the op again on upcast inputs), ``float64 (NAME)`` (a registered reference), or ``none: WHY``."""
    ratio: float | None
    """The largest per-row error-to-rounding ratio (inf: a non-finite output where the reference is finite);
    None: not judged (see ``reference``)."""
    ratio_token: int | None
    """The position of the row with ``ratio`` (None: no token dimension)."""
    size: int = 1
    """The reduction length the rounding model used (a GEMM's K, an attention's keys; 1: elementwise)."""
    writes: tuple[int, ...] = ()
    """Which of ``inputs`` the op writes (an out-variant kernel's ``out``, an in-place op's ``self``)."""

    @property
    def judged(self) -> bool:
        return self.ratio is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "path": self.path,
            "slot": self.slot,
            "inputs": [a.to_json() if isinstance(a, TensorMeta) else a for a in self.inputs],
            "outputs": [o.to_json() for o in self.outputs],
            "token_dim": self.token_dim,
            "hash": self.hash,
            "stats": {k: _json_float(v) for k, v in self.stats.items()},
            "rows": self.rows,
            "reference": self.reference,
            "ratio": _json_float(self.ratio),
            "ratio_token": self.ratio_token,
            "size": self.size,
            "writes": list(self.writes),
        }

    @classmethod
    def from_json(cls, raw: Any, *, index: int = 0, path: Path = Path(DRILL_NAME)) -> OpEntry:
        """The inverse of :meth:`to_json`, checked (rows against a rows file: :func:`load_drill`)."""
        return _entry(path, index, raw, None, 0)

    @property
    def short_name(self) -> str:
        """``aten.mm`` for ``aten.mm.default``: the overload is dropped where it is ``default``."""
        return self.op[: -len(".default")] if self.op.endswith(".default") else self.op


def describe_op(op: OpEntry) -> str:
    """``aten.mm (model.layers.2.mlp.down_proj, [41, 1536] x [1536, 576], bfloat16)``: the op, where, on what."""
    read = [a for i, a in enumerate(op.inputs) if isinstance(a, TensorMeta) and a.shape and i not in op.writes]
    shapes = " x ".join(map(str, read)) or "no tensors"
    dtype = op.outputs[0].dtype if op.outputs else "-"
    return f"{op.short_name} ({op.path}, {shapes}, {dtype})"


def _json_float(v: float | None) -> float | str | None:
    """A float for JSON: ``"inf"``/``"nan"`` spelled out (a drill's ratio can be infinite, and must read back so)."""
    if v is None:
        return None
    return v if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")


@dataclass(frozen=True)
class DrillLog:
    """A drill directory, checked (:func:`load_drill`)."""

    path: Path
    header: dict[str, Any]
    ops: tuple[OpEntry, ...]
    tokens: tuple[int, ...] = field(default=())
    """The positions whose rows every op stored (``ops.safetensors``)."""

    @property
    def factor(self) -> float:
        return float(self.header["factor"])

    @property
    def layer(self) -> int:
        return int(self.header["layer"])

    @property
    def half(self) -> str:
        return str(self.header["half"])

    def first_beyond(self, factor: float | None = None) -> OpEntry | None:
        """The first op whose ratio is over ``factor`` (default: the log's); a NaN ratio counts as over."""
        limit = self.factor if factor is None else factor
        return next((o for o in self.ops if o.ratio is not None and not o.ratio <= limit), None)

    def summary(self, factor: float | None = None) -> str:
        """The drill's verdict in one line (see ``docs/localize.md``)."""
        limit = self.factor if factor is None else factor
        where = f"layer {self.layer} {HALF_NAMES.get(self.half, self.half)}"
        judged = [o for o in self.ops if o.judged]
        bad = self.first_beyond(limit)
        if bad is None:
            worst = max((o.ratio for o in judged if o.ratio is not None), default=0.0)
            return (
                f"{where}: no op beyond {limit:g}x its rounding ({len(judged)} of {len(self.ops)} ops judged, "
                f"the largest {worst:.2g}x)"
            )
        before = [o for o in judged if o.index < bad.index]
        at = f" at token {bad.ratio_token}" if bad.ratio_token is not None else ""
        ratio = "inf" if bad.ratio is None or not math.isfinite(bad.ratio) else f"{bad.ratio:.3g}"
        if before:
            worst = max(o.ratio for o in before if o.ratio is not None)
            tail = f"; the {len(before)} ops before it are within {worst:.2g}x"
        else:
            tail = "; it is the first op judged"
        return f"{where}: {describe_op(bad)} is {ratio}x its rounding{at}{tail}"

    def rows(self, op: OpEntry) -> np.ndarray | None:
        """The first output of ``op`` at the log's tokens (token first), float64; None where none is stored."""
        if op.rows is None:
            return None
        rows = read_rows(self.path, op.rows)
        if rows.dtype.kind == "f" and op.stats.get("nonfinite", 0.0) == 0.0 and not np.isfinite(rows).all():
            raise CorruptDumpError(
                f"{self.path / ROWS_NAME}: {op.rows} holds NaN or Inf, but {DRILL_NAME} says op {op.index}'s "
                "output is finite (nonfinite 0)"
            )
        return rows


def _bad(path: Path, what: str) -> CorruptDumpError:
    return CorruptDumpError(f"{path}: not a usable drill log ({what})")


def _int(v: Any) -> bool:
    return type(v) is int


def _meta(path: Path, where: str, v: Any) -> TensorMeta:
    if not isinstance(v, dict) or set(v) != {"shape", "dtype", "stride"}:
        raise _bad(path, f"{where} is not a tensor's shape, dtype and stride")
    shape, stride, dtype = v["shape"], v["stride"], v["dtype"]
    if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"{where}.shape {shape!r} is not a list of sizes")
    if not isinstance(stride, list) or len(stride) != len(shape) or not all(_int(s) for s in stride):
        raise _bad(path, f"{where}.stride {stride!r} does not match its shape {shape}")
    if dtype not in _DTYPES and not (isinstance(dtype, str) and dtype.startswith(("float8", "complex", "uint"))):
        raise _bad(path, f"{where}.dtype {dtype!r} is not a torch dtype")
    return TensorMeta(tuple(shape), dtype, tuple(stride))


def _ratio(path: Path, where: str, v: Any) -> float | None:
    if v is None:
        return None
    if v == "inf":
        return math.inf
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise _bad(path, f"{where} {v!r} is not a ratio (a number >= 0, 'inf' or null)")
    return float(v)


def _entry(path: Path, i: int, raw: Any, keys: dict[str, tuple[int, ...]] | None, tokens: int) -> OpEntry:
    """Op ``i`` of a log, every field checked; with ``keys`` (the rows file's tensors and shapes), its rows too."""
    where = f"ops[{i}]"
    need = {"index", "op", "path", "slot", "inputs", "outputs", "token_dim", "hash", "stats", "rows", "reference"}
    if not isinstance(raw, dict) or not need <= set(raw):
        missing = sorted(need - set(raw)) if isinstance(raw, dict) else ["all"]
        raise _bad(path, f"{where} lacks {', '.join(missing)}")
    if raw["index"] != i:
        raise _bad(path, f"{where}.index is {raw['index']!r}, not {i}: ops must be listed in dispatch order")
    for k in ("op", "path", "reference"):
        if not isinstance(raw[k], str) or not raw[k]:
            raise _bad(path, f"{where}.{k} is not a name")
    if not _int(raw["slot"]) or raw["slot"] < 0:
        raise _bad(path, f"{where}.slot {raw['slot']!r} is not a position")
    if not isinstance(raw["inputs"], list) or not isinstance(raw["outputs"], list):
        raise _bad(path, f"{where}.inputs/outputs are not lists")
    inputs = tuple(
        _meta(path, f"{where}.inputs[{j}]", a) if isinstance(a, dict) and "shape" in a else _value(path, where, j, a)
        for j, a in enumerate(raw["inputs"])
    )
    outputs = tuple(_meta(path, f"{where}.outputs[{j}]", o) for j, o in enumerate(raw["outputs"]))
    token_dim = raw["token_dim"]
    if token_dim is not None and (not _int(token_dim) or not outputs or not 0 <= token_dim < len(outputs[0].shape)):
        raise _bad(path, f"{where}.token_dim {token_dim!r} is not a dimension of its first output")
    stats = raw["stats"]
    if not isinstance(stats, dict) or not all(isinstance(k, str) for k in stats):
        raise _bad(path, f"{where}.stats is not an object")
    parsed = {}
    for k, v in stats.items():
        if isinstance(v, str) and v in ("inf", "-inf", "nan"):
            parsed[k] = float(v)
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            parsed[k] = float(v)
        else:
            raise _bad(path, f"{where}.stats.{k} {v!r} is not a number")
    rows = raw["rows"]
    if rows is not None and not isinstance(rows, str):
        raise _bad(path, f"{where}.rows {rows!r} is not a key")
    if rows is not None and keys is not None:
        shape = keys.get(rows)
        if shape is None:
            raise _bad(path, f"{where}.rows names {rows!r}, which {ROWS_NAME} does not hold")
        if token_dim is None:
            raise _bad(path, f"{where}.rows is set but its output has no token dimension")
        want = (tokens, *[n for d, n in enumerate(outputs[0].shape) if d != token_dim])
        if tuple(shape) != want:
            raise _bad(path, f"{ROWS_NAME}[{rows}] has shape {list(shape)}, not {list(want)} ({where}'s rows)")
    ratio = _ratio(path, f"{where}.ratio", raw.get("ratio"))
    token = raw.get("ratio_token")
    if token is not None and (not _int(token) or token < 0):
        raise _bad(path, f"{where}.ratio_token {token!r} is not a position")
    size = raw.get("size", 1)
    if not _int(size) or size < 1:
        raise _bad(path, f"{where}.size {size!r} is not a reduction length")
    writes = raw.get("writes", [])
    if not isinstance(writes, list) or not all(_int(w) and 0 <= w < len(inputs) for w in writes):
        raise _bad(path, f"{where}.writes {writes!r} is not a list of input indices")
    digest = raw["hash"]
    if digest is not None and not isinstance(digest, str):
        raise _bad(path, f"{where}.hash is not a string")
    return OpEntry(
        index=i,
        op=raw["op"],
        path=raw["path"],
        slot=raw["slot"],
        inputs=inputs,
        outputs=outputs,
        token_dim=token_dim,
        hash=digest,
        stats=parsed,
        rows=rows,
        reference=raw["reference"],
        ratio=ratio,
        ratio_token=token,
        size=size,
        writes=tuple(writes),
    )


def _value(path: Path, where: str, j: int, a: Any) -> dict[str, Any]:
    if not isinstance(a, dict) or set(a) != {"value"}:
        raise _bad(path, f"{where}.inputs[{j}] is neither a tensor nor a value")
    return a


def _safetensors_keys(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in ``path`` (a safetensors file), from its header alone."""
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > path.stat().st_size - 8:
                raise ValueError("header length past the file's end")
            header = json.loads(f.read(n))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptDumpError(f"{path}: not a safetensors file ({e})") from None


def load_drill(path: str | Path) -> DrillLog:
    """The drill log in directory ``path``, every field checked; :class:`DumpError` naming the file otherwise."""
    root = Path(path)
    meta = root / DRILL_NAME
    if not root.is_dir():
        raise DumpError(f"{root}: no such drill directory")
    if not meta.is_file():
        raise IncompleteDumpError(f"{meta}: missing; {root} is not a finished drill (python -m dumper drill writes it)")
    try:
        raw = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptDumpError(f"{meta}: not JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != DRILL_FORMAT:
        raise _bad(meta, f"format is not {DRILL_FORMAT!r}")
    if raw.get("version") != DRILL_VERSION:
        raise _bad(meta, f"version {raw.get('version')!r}, this driftscope reads {DRILL_VERSION}")
    for k, kind in (("layer", int), ("half", str), ("factor", float), ("tokens", list), ("ops", list)):
        v = raw.get(k)
        ok = (_int(v) and v >= 0) if kind is int else isinstance(v, kind) or (kind is float and _int(v))
        if not ok:
            raise _bad(meta, f"{k} is missing or not a {kind.__name__}")
    if raw["half"] not in HALF_NAMES:
        raise _bad(meta, f"half {raw['half']!r} is not one of {', '.join(HALF_NAMES)}")
    if not math.isfinite(raw["factor"]) or raw["factor"] <= 0:
        raise _bad(meta, f"factor {raw['factor']!r} is not a positive number")
    tokens = raw["tokens"]
    if not all(_int(t) and t >= 0 for t in tokens):
        raise _bad(meta, "tokens is not a list of positions")
    rows_file = root / ROWS_NAME
    keys = _safetensors_keys(rows_file) if rows_file.exists() else {}
    ops = tuple(_entry(meta, i, op, keys, len(tokens)) for i, op in enumerate(raw["ops"]))
    if not ops:
        raise _bad(meta, "it lists no op")
    return DrillLog(root, raw, ops, tuple(tokens))


def read_rows(root: Path, key: str) -> np.ndarray:
    """Tensor ``key`` of a drill's ``ops.safetensors``, as float64 when it holds floats."""
    import torch
    from safetensors import safe_open

    path = root / ROWS_NAME
    try:
        with safe_open(str(path), framework="pt") as f:
            t = f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors on a corrupt file
        raise CorruptDumpError(f"{path}: cannot read {key} ({e})") from None
    return t.to(torch.float64).numpy() if t.is_floating_point() else t.numpy()
