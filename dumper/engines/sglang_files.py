"""Reading SGLang's dumper files safely: find them by the tags in their names, load each one with
``torch.load(weights_only=True, mmap=True)``, and refuse anything that is not tensors.

SGLang's dumper (``sglang.srt.debug_utils.dumper``) writes one ``torch.save`` file per tensor,
``step=S___rank=R___dump_index=I___name=NAME___...[___layer_id=L].pt``, each holding
``{"value": ..., "meta": {...}}``. No pickled object is ever built: a file that
``weights_only`` loading refuses, a plain pickle, or a value other than a tensor, a dict or a
list of tensors is a :class:`CorruptDumpError` naming the file. :mod:`dumper.engines.sglang`
turns what is read here into a driftscope dump.
"""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dumper.errors import CorruptDumpError, DumpError
from dumper.format import MANIFEST_NAME
from dumper.format.files import regular_file_in

__all__ = ["AUX_NAMES", "SglangFile", "is_sglang_dump", "index_files", "load_value", "tensors_of", "aux_field",
           "same_field"]

AUX_NAMES = frozenset({"input_ids", "positions", "seq_lens", "req_pool_indices", "rids"})
"""Names SGLang's core mode dumps from each forward's batch: row metadata, not compared."""
_INT = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True)
class SglangFile:
    """One SGLang dumper file, indexed by the tags in its name (nothing read yet)."""

    path: Path
    step: int
    rank: int
    index: int
    name: str
    layer: int | None


def _tags(file_name: str) -> dict[str, str] | None:
    """The tags of an SGLang dumper file name, or None when it is not one."""
    if not file_name.endswith(".pt"):
        return None
    tags = dict(part.partition("=")[::2] for part in file_name[:-3].split("___"))
    ok = all(_INT.fullmatch(tags.get(k, "")) for k in ("step", "rank", "dump_index")) and tags.get("name")
    return tags if ok else None


def is_sglang_dump(path: str | os.PathLike[str], *, depth: int = 1) -> bool:
    """Whether ``path`` holds SGLang dumper files (or, one level down, runs of them) and no manifest."""
    p = Path(path)
    if not p.is_dir() or os.path.lexists(p / MANIFEST_NAME):
        return False
    with os.scandir(p) as entries:
        subdirs = []
        for e in entries:
            if _tags(e.name) is not None:
                return True
            if depth and e.is_dir(follow_symlinks=False):
                subdirs.append(e.path)
    return any(is_sglang_dump(d, depth=0) for d in subdirs)


def index_files(src: Path) -> list[SglangFile]:
    """Every dumper file of ``src`` sorted by (step, rank, dump_index); other ``.pt`` names are refused."""
    if not src.is_dir():
        raise DumpError(f"{src}: no such SGLang dump directory")
    out = []
    with os.scandir(src) as entries:
        names = sorted(e.name for e in entries if e.name.endswith(".pt"))
    for name in names:
        tags = _tags(name)
        if tags is None or not tags["name"].isprintable():
            raise CorruptDumpError(f"{src / name}: not an SGLang dumper file name (step=S___rank=R___dump_index=I"
                                   "___name=NAME...pt)")
        layer = tags.get("layer_id", "")
        out.append(SglangFile(src / name, int(tags["step"]), int(tags["rank"]), int(tags["dump_index"]), tags["name"],
                         int(layer) if _INT.fullmatch(layer) else None))
    if not out:
        runs = sorted(d.name for d in src.iterdir() if d.is_dir() and is_sglang_dump(d, depth=0))
        hint = f"; it holds SGLang runs, pass one of: {', '.join(runs[:5])}" if runs else ""
        raise DumpError(f"{src}: no SGLang dumper files (*.pt){hint}")
    return sorted(out, key=lambda f: (f.step, f.rank, f.index))


def load_value(f: SglangFile) -> Any:
    """The value stored in ``f``, loaded with ``weights_only=True``; its meta must agree with its name."""
    regular_file_in(f.path.parent, f.path.name, missing="file vanished while it was read")
    if not zipfile.is_zipfile(f.path):  # torch.save writes a zip; checked first, as mmap fails obscurely
        with open(f.path, "rb") as fh:
            pickled = fh.read(1) == b"\x80"
        what = "a plain pickle or legacy torch.save file" if pickled else "truncated, or not a torch.save zip archive"
        raise CorruptDumpError(f"{f.path}: not a file torch.load(weights_only=True) accepts ({what})")
    try:
        obj = torch.load(f.path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - the trust boundary: any failure to load is a refused file
        raise CorruptDumpError(f"{f.path}: not a file torch.load(weights_only=True) accepts ({_reason(e)})") from None
    if not (isinstance(obj, dict) and "value" in obj and set(obj) <= {"value", "meta"}):
        return obj  # older dumpers saved the bare value
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise CorruptDumpError(f"{f.path}: its meta is a {type(meta).__name__}, not a dict")
    for key, want in (("step", f.step), ("rank", f.rank), ("dump_index", f.index), ("name", f.name)):
        if key in meta and meta[key] != want:
            raise CorruptDumpError(f"{f.path}: its name says {key}={want!r} but its meta says {meta[key]!r}")
    return obj["value"]


def _reason(e: Exception) -> str:
    """The line of a ``torch.load`` error that says what is wrong, without its advice to unpickle anyway."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith(
        ("Weights only load failed", "Check the documentation"))]
    text = lines[0] if lines else type(e).__name__
    return text.split(". ")[0].rstrip(".")[:200]


def tensors_of(value: Any, f: SglangFile) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a value: a tensor, or a dict or list of tensors; anything else is refused."""
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) \
        if isinstance(value, (list, tuple)) and value else [(None, value)]
    for key, t in items:
        if key is not None and not str(key).isprintable():
            raise CorruptDumpError(f"{f.path}: holds a dict key {str(key)!r} that cannot name a tensor")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
            what = t.layout if isinstance(t, torch.Tensor) else type(t).__name__
            raise CorruptDumpError(f"{f.path}: holds {what}{'' if key is None else f' at {key!r}'}, "
                                   "not a tensor or a dict of tensors")
    return [(f.name if key is None else f"{f.name}.{key}", t) for key, t in items]


def aux_field(value: Any, f: SglangFile) -> Any:
    """A root-forward field: a 1-D integer tensor as int64 numpy, or ``rids`` as a list of strings."""
    if f.name == "rids" and isinstance(value, (list, tuple)) and all(isinstance(r, (str, int)) for r in value):
        return [str(r) for r in value]
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point() or value.is_complex():
        what = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CorruptDumpError(f"{f.path}: {f.name} must be a 1-D integer tensor, got {what}")
    return value.to(torch.int64).numpy()


def same_field(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) else a == b
