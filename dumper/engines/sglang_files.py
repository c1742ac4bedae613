"""Reading SGLang's dumper files safely: find them by the tags in their names, load each one with
``torch.load(weights_only=True, mmap=True)``, and refuse anything that is not tensors.

SGLang's dumper (``sglang.srt.debug_utils.dumper``) writes one ``torch.save`` file per tensor,
``step=S___rank=R___dump_index=I___name=NAME___...[___layer_id=L].pt``, each holding
``{"value": ..., "meta": {...}}``. No pickled object is ever built: a file that
``weights_only`` loading refuses, a plain pickle, or a value other than a tensor, a dict or a
list of tensors is a :class:`CorruptDumpError` naming the file. Before torch maps a file, its
zip is checked byte by byte (:mod:`dumper.engines.torch_archive`), so only a tensor's own
stored bytes are ever read as that tensor; a file that changes while it is read is refused.
Text from a file (its name, keys, tags) reaches a message only through
:func:`~dumper.format.files.printable` or :func:`~dumper.format.files.show`.
:mod:`dumper.engines.sglang` turns what is read here into a driftscope dump.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dumper.engines.torch_archive import check_archive
from dumper.errors import CorruptDumpError, DumpError
from dumper.format import MANIFEST_NAME
from dumper.format.files import printable, regular_file_in, show

__all__ = [
    "AUX_NAMES",
    "SglangFile",
    "is_sglang_dump",
    "index_files",
    "load_value",
    "tensors_of",
    "aux_field",
    "same_field",
]

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

    @property
    def shown(self) -> str:
        """The file's path for a message: its control characters escaped."""
        return printable(str(self.path))


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
        raise DumpError(f"{printable(str(src))}: no such SGLang dump directory")
    out = []
    with os.scandir(src) as entries:
        names = sorted(e.name for e in entries if e.name.endswith(".pt"))
    for name in names:
        tags = _tags(name)
        if tags is None or not tags["name"].isprintable():
            raise CorruptDumpError(
                f"{printable(str(src / name))}: not an SGLang dumper file name "
                "(step=S___rank=R___dump_index=I___name=NAME...pt)"
            )
        layer = tags.get("layer_id", "")
        out.append(
            SglangFile(
                src / name,
                int(tags["step"]),
                int(tags["rank"]),
                int(tags["dump_index"]),
                tags["name"],
                int(layer) if _INT.fullmatch(layer) else None,
            )
        )
    if not out:
        runs = sorted(d.name for d in src.iterdir() if d.is_dir() and is_sglang_dump(d, depth=0))
        hint = f"; it holds SGLang runs, pass one of: {printable(', '.join(runs[:5]))}" if runs else ""
        raise DumpError(f"{printable(str(src))}: no SGLang dumper files (*.pt){hint}")
    return sorted(out, key=lambda f: (f.step, f.rank, f.index))


def load_value(f: SglangFile) -> Any:
    """The value stored in ``f``, loaded with ``weights_only=True``; its meta must agree with its name."""
    regular_file_in(f.path.parent, f.path.name, missing="file vanished while it was read")
    before = check_archive(f.path, f.shown)  # torch.load(mmap=True) trusts the zip's framing: checked first
    try:
        with warnings.catch_warnings():  # a file's pickle protocol, say, is no warning for the terminal
            warnings.simplefilter("ignore")
            obj = torch.load(f.path, map_location="cpu", weights_only=True, mmap=True)
        after = os.stat(f.path)
    except Exception as e:  # noqa: BLE001 - the trust boundary: any failure to load is a refused file
        raise CorruptDumpError(
            f"{f.shown}: not a file torch.load(weights_only=True) accepts ({printable(_reason(e))})"
        ) from None
    if _identity(before) != _identity(after):
        raise CorruptDumpError(f"{f.shown}: changed while it was read; refusing it")
    if not (isinstance(obj, dict) and "value" in obj and set(obj) <= {"value", "meta"}):
        return obj  # older dumpers saved the bare value
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise CorruptDumpError(f"{f.shown}: its meta is a {type(meta).__name__}, not a dict")
    for key, want in (("step", f.step), ("rank", f.rank), ("dump_index", f.index), ("name", f.name)):
        if key in meta and meta[key] != want:
            raise CorruptDumpError(f"{f.shown}: its name says {key}={show(want)} but its meta says {show(meta[key])}")
    return obj["value"]


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _reason(e: Exception) -> str:
    """The line of a ``torch.load`` error that says what is wrong, without its advice to unpickle anyway."""
    lines = [
        ln.strip()
        for ln in str(e).splitlines()
        if ln.strip() and not ln.startswith(("Weights only load failed", "Check the documentation"))
    ]
    text = lines[0] if lines else type(e).__name__
    return text.split(". ")[0].rstrip(".")[:200]


def tensors_of(value: Any, f: SglangFile) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a value: a tensor, or a dict or list of tensors; anything else is refused."""
    items = (
        list(value.items())
        if isinstance(value, dict)
        else list(enumerate(value))
        if isinstance(value, (list, tuple)) and value
        else [(None, value)]
    )
    for key, t in items:
        if key is not None and not str(key).isprintable():
            raise CorruptDumpError(f"{f.shown}: holds a dict key {show(str(key))} that cannot name a tensor")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
            what = printable(str(t.layout if isinstance(t, torch.Tensor) else type(t).__name__))
            at = "" if key is None else f" at {show(key)}"
            raise CorruptDumpError(f"{f.shown}: holds {what}{at}, not a tensor or a dict of tensors")
    return [(f.name if key is None else f"{f.name}.{key}", t) for key, t in items]


def aux_field(value: Any, f: SglangFile) -> Any:
    """A root-forward field: a 1-D integer tensor as int64 numpy, or ``rids`` as a list of strings."""
    if f.name == "rids" and isinstance(value, (list, tuple)) and all(isinstance(r, (str, int)) for r in value):
        return [str(r) for r in value]
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point() or value.is_complex():
        what = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CorruptDumpError(f"{f.shown}: {f.name} must be a 1-D integer tensor, got {printable(str(what))}")
    return value.to(torch.int64).numpy()


def same_field(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) else a == b
