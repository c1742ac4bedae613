"""SGLang's own dumps as driftscope dumps: read the ``.pt`` files of SGLang's dumper, safely.

SGLang's dumper (``sglang.srt.debug_utils.dumper``, on with ``DUMPER_ENABLE=1``) writes one
``torch.save`` file per tensor into ``DUMPER_DIR/EXP_NAME/``, named by its tags,
``step=S___rank=R___dump_index=I___name=NAME___...[___layer_id=L].pt``, each holding
``{"value": ..., "meta": {...}}``. :func:`convert_sglang_dump` turns such a directory into a
driftscope dump, so ``python -m comparator`` compares it with an HF dump or another SGLang run.
Every file is read with ``torch.load(weights_only=True, mmap=True)``, one at a time: no pickled
object is ever built, and a file holding anything but tensors is refused in one line (reading
is :mod:`dumper.engines.sglang_files`; this module converts what it reads).

What becomes what:

- step ``S`` is forward pass ``S``, rank ``R`` rank ``R``; a name repeated in one pass is
  called 0, 1, ... in ``dump_index`` order.
- ``non_intrusive__{prefix}layers.{i}.self_attn.inputs.hidden_states`` (the ``all`` mode's
  name of the attention input) becomes the HF capture's ``{prefix}layers.{i}.self_attn.input``,
  point ``input``, layer ``i`` (the ``layer_id`` tag wins). ``names`` maps other names
  (``{layer}``: the ``layer_id`` tag); the rest keep their name; a dict or list of tensors
  becomes ``NAME.KEY`` each.
- ``input_ids``, ``positions``, ``seq_lens``, ``req_pool_indices`` and ``rids`` without a
  ``layer_id`` (the core mode's root-forward fields) describe the rows of the tensors after them
  in the same step and rank, and are not copied (nor their per-layer copies). A tensor with as
  many rows as ``positions`` gets them. Request ``r`` holds the rows up to position
  ``seq_lens[r] - 1`` (without ``seq_lens``: a new request wherever positions stop counting
  up); rows past the last request are padding.
- Sequence ids number requests in the order they first appear (send prompts in the order of
  the job you compare with). A request is followed across steps by its ``rids`` entry, else by
  its ``req_pool_indices`` slot while its positions continue, else as the earliest open request
  whose last position is one below its first; position 0 always starts a request.
- Without ``positions`` (non-intrusive mode ``off``) rows carry no positions, and the
  comparator matches those tensors by (name, pass, rank, call).

Example::

    from dumper.engines.sglang import convert_sglang_dump, open_dump_side
    convert_sglang_dump("/tmp/dumper/dump_20260101_120000_000123", "dumps/sglang")
    with open_dump_side("/tmp/dumper/dump_20260101_120000_000123") as target:
        report = compare_dumps("dumps/hf", target, CompareConfig())
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dumper.cli.common import Parser, add_import_sglang_flags, guarded_main
from dumper.engines.sglang_files import (
    AUX_NAMES,
    SglangFile,
    aux_field,
    index_files,
    is_sglang_dump,
    load_value,
    same_field,
    tensors_of,
)
from dumper.errors import EXIT_OK, CorruptDumpError, DriftscopeError, DumpError, UsageError
from dumper.format import (
    FORMAT_VERSION,
    PAD_SEQUENCE,
    Manifest,
    TensorRecord,
    dir_mode,
    encode_runs,
    fsync_dir,
    write_manifest,
)
from dumper.format.dtypes import DTYPES, torch_codes
from dumper.format.files import printable
from dumper.format.manifest import parse_manifest
from dumper.hooks.writer import ShardWriter
from dumper.version import __version__ as VERSION

__all__ = ["convert_sglang_dump", "open_dump_side", "main_import"]

_ATTN_INPUT = re.compile(
    r"non_intrusive__(?P<prefix>(?:.+\.)?layers\.)(?P<layer>[0-9]+)"
    r"\.self_attn\.inputs\.hidden_states"
)
_STORAGE_CODES = torch_codes()
"""torch dtype -> the dump format's dtype code (:mod:`dumper.format.dtypes`)."""
_Rows = tuple[np.ndarray, np.ndarray]
"""(positions, sequence ids) of one forward's rows."""


def _segments(pos: np.ndarray, seq_lens: np.ndarray | None, where: str) -> list[tuple[int, int]]:
    """(first row, row count) of each request in a flattened batch; rows after the last are padding."""
    if seq_lens is None:
        starts = [0, *(np.flatnonzero(np.diff(pos) != 1) + 1).tolist()] if pos.size else []
        return [(s, e - s) for s, e in zip(starts, [*starts[1:], pos.size], strict=True)]
    out, row = [], 0
    for r, end in enumerate(seq_lens.tolist()):
        n = end - int(pos[row]) if row < pos.size else 0
        if n < 1 or row + n > pos.size or not np.array_equal(pos[row : row + n], np.arange(end - n, end)):
            raise CorruptDumpError(
                f"{where}: positions and seq_lens disagree at request {r} "
                f"(seq_lens {seq_lens.tolist()[:8]}, {pos.size} positions)"
            )
        out.append((row, n))
        row += n
    return out


@dataclass
class _Sequences:
    """Sequence numbering across passes: ``rids`` shared by all ranks, slots and open requests per rank."""

    rids: dict[str, int] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    slots: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (rank, slot) -> (seq, last)
    open: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> seq -> last position
    tokens: dict[int, dict[int, int]] = field(default_factory=dict)  # seq -> position -> token id
    layer_aux: int = 0

    def _assign(self, rank: int, rid: str | None, slot: int | None, first: int, last: int, taken: set[int]) -> int:
        open_ = self.open.setdefault(rank, {})
        if rid is not None:
            seq: int | None = self.rids.setdefault(rid, len(self.rids))
        elif slot is not None:
            cur = self.slots.get((rank, slot))
            seq = cur[0] if cur is not None and first > 0 and cur[1] + 1 == first else None
        else:
            seq = next((s for s, end in open_.items() if first > 0 and end + 1 == first and s not in taken), None)
        if seq is None:
            seq = self.count[rank] = self.count.get(rank, -1) + 1
        if slot is not None:
            self.slots[(rank, slot)] = (seq, last)
        open_[seq] = last
        taken.add(seq)
        return seq

    def rows(self, rank: int, aux: dict[str, Any], where: str) -> _Rows:
        """(positions, sequence ids) of one forward's rows from its root fields; records its tokens."""
        pos, ids = aux["positions"], np.full(aux["positions"].size, PAD_SEQUENCE, dtype=np.int64)
        segs, taken = _segments(pos, aux.get("seq_lens"), where), set[int]()
        keys = [aux.get(k, [None] * len(segs)) for k in ("rids", "req_pool_indices")]
        if any(len(k) != len(segs) for k in keys):
            raise CorruptDumpError(
                f"{where}: {len(segs)} requests in positions but {len(keys[0])} rids and "
                f"{len(keys[1])} req_pool_indices"
            )
        for (row, n), rid, slot in zip(segs, *keys, strict=True):
            ids[row : row + n] = self._assign(
                rank, rid, None if slot is None else int(slot), int(pos[row]), int(pos[row + n - 1]), taken
            )
        tokens = aux.get("input_ids")
        if tokens is not None and tokens.size != pos.size:
            raise CorruptDumpError(f"{where}: {tokens.size} input_ids but {pos.size} positions")
        for s, p, t in zip(ids.tolist(), pos.tolist(), [] if tokens is None else tokens.tolist(), strict=False):
            if s != PAD_SEQUENCE:
                self.tokens.setdefault(s, {})[p] = t
        return pos, ids

    def input_ids(self) -> list[list[int]] | None:
        """Each sequence's token ids, when the dump holds every position of every sequence from 0."""
        whole = sorted(self.tokens) == list(range(len(self.tokens))) and all(
            sorted(t) == list(range(len(t))) and min(t.values()) >= 0 for t in self.tokens.values()
        )
        return (
            [[t[p] for p in range(len(t))] for _, t in sorted(self.tokens.items())] if whole and self.tokens else None
        )


def _canonical(name: str, layer: int | None, names: Mapping[str, str]) -> tuple[str, int | None, str | None]:
    """(driftscope name, layer, capture point) of an SGLang tensor name."""
    if name in names:
        target = names[name]
        if "{layer}" in target and layer is None:
            raise UsageError(f"--name {name}={target}: its files carry no layer_id to fill {{layer}}")
        target = target.replace("{layer}", str(layer))
        return target, layer, "input" if target.endswith(".input") else None
    m = _ATTN_INPUT.fullmatch(name)
    if m is None:
        return name, layer, None
    layer = int(m["layer"]) if layer is None else layer
    return f"{m['prefix']}{layer}.self_attn.input", layer, "input"


def _convert_pass(
    group: list[SglangFile], writer: ShardWriter, seqs: _Sequences, names: Mapping[str, str]
) -> list[TensorRecord]:
    """Write one (step, rank)'s tensors; return their records (file names filled in later)."""
    aux: dict[str, Any] = {}
    rows: _Rows | None = None
    calls: dict[str, int] = {}
    out: list[TensorRecord] = []
    step, rank = group[0].step, group[0].rank
    where = f"{printable(str(group[0].path.parent))} step {step} rank {rank}"
    for f in group:
        value = load_value(f)
        if f.name in AUX_NAMES:
            if f.layer is not None:  # SGLang's attention modules get positions= too: copies
                seqs.layer_aux += 1
                continue
            new = aux_field(value, f)
            if f.name in aux and same_field(aux[f.name], new):
                continue  # the same batch, seen again by a nested module
            if f.name in aux or rows is not None:  # the fields of another forward in this step
                if rows is None and "positions" in aux:
                    seqs.rows(rank, aux, where)
                aux, rows = {}, None
            aux[f.name] = new
            continue
        if rows is None and "positions" in aux:
            rows = seqs.rows(rank, aux, where)
        for raw, t in tensors_of(value, f):
            name, layer, point = _canonical(raw, f.layer, names)
            out.append(_put(writer, f, name, t, layer, point, rows, calls))
    if rows is None and "positions" in aux:
        seqs.rows(rank, aux, where)  # a forward with no tensors still continues its requests
    return out


def _put(
    writer: ShardWriter,
    f: SglangFile,
    name: str,
    t: torch.Tensor,
    layer: int | None,
    point: str | None,
    rows: _Rows | None,
    calls: dict[str, int],
) -> TensorRecord:
    """Queue ``t`` into the writer and return its record; exotic float dtypes (float8) widen to float32."""
    meta: dict[str, Any] = {"sglang_dump_index": f.index}
    if t.dtype not in _STORAGE_CODES:
        if not t.is_floating_point():
            raise DumpError(f"{f.shown}: dtype {t.dtype} cannot be stored in a driftscope dump")
        meta["sglang_dtype"], t = str(t.dtype).replace("torch.", ""), t.float()
    shape = tuple(int(s) for s in t.shape)
    n = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if len(shape) > 1 and shape[-1] == 0 and n > 0:
        raise DumpError(f"{f.shown}: a {list(shape)} tensor has rows but no columns; a driftscope dump cannot hold it")
    call = calls[name] = calls.get(name, -1) + 1
    key = name if call == 0 else f"{name}#{call}"
    writer.put(f.step, key, t)
    runs = (
        (encode_runs(rows[0], step=1), encode_runs(rows[1], step=0))
        if rows is not None and len(shape) > 1 and n == rows[0].size
        else (None, None)
    )
    return TensorRecord(
        name=name,
        file="",
        key=key,
        shape=shape,
        dtype=_STORAGE_CODES[t.dtype],
        forward_pass=f.step,
        rank=f.rank,
        call=call,
        layer=layer,
        point=point,
        positions=runs[0],
        sequence_ids=runs[1],
        meta=meta,
    )


def _manifest(
    src: Path,
    records: list[TensorRecord],
    files: dict[str, int],
    seqs: _Sequences,
    model: dict[str, Any] | None,
    n_files: int,
) -> Manifest:
    attn = [r for r in records if r.point == "input"]
    widths = {r.shape[-1] for r in attn if r.shape}
    width = widths.pop() if len(widths) == 1 else None
    if model is None:
        model = {
            "name": f"sglang:{src.name}",
            "architecture": None,
            "num_layers": None,
            "hidden_size": width,
            "config_hash": None,
            "weights_hash": None,
        }
    elif width is not None and model.get("hidden_size") not in (None, width):
        raise UsageError(
            f"--checkpoint {model['name']}: hidden_size {model['hidden_size']}, but the dumped "
            f"self_attn inputs are {width} wide; it is not the checkpoint of this run"
        )
    signature = {
        "layers": sorted({r.layer for r in attn if r.layer is not None}),
        "modules": sorted({r.name[: -len(".input")] for r in attn}),
        "points": ["input"] if attn else [],
        "num_layers": model.get("num_layers"),
        "world_size": max(r.rank for r in records) + 1,
        "dtype": DTYPES[attn[0].dtype].torch_name if attn else None,
    }
    extra: dict[str, Any] = {
        "job": "sglang-dump",
        "source": str(src),
        "sglang": {
            "files": n_files,
            "steps": len({r.forward_pass for r in records}),
            "per_layer_aux_skipped": seqs.layer_aux,
        },
    }
    if (ids := seqs.input_ids()) is not None:
        extra["input_ids"] = ids
    env = {"engine": "sglang", "engine_version": None, "driftscope": VERSION, "converted_from": "sglang dumper"}
    return Manifest(
        FORMAT_VERSION,
        _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model,
        signature,
        env,
        dict(sorted(files.items())),
        tuple(records),
        extra,
    )


def _convert(src: Path, out: Path, names: Mapping[str, str], checkpoint: str | None) -> Manifest:
    """Write every tensor of ``src`` into ``out`` (one shard writer per rank), then the manifest."""
    files = index_files(src)
    writers = dict[int, ShardWriter]()
    records = list[TensorRecord]()
    seqs = _Sequences()
    model = None
    if checkpoint is not None:  # read first: a bad checkpoint fails before any tensor is copied
        from dumper.engines.base import (
            hf_identity,  # imports transformers: only when asked
        )

        model = hf_identity(checkpoint)
    try:
        for (_, rank), group in groupby(files, key=lambda f: (f.step, f.rank)):
            if rank not in writers:
                writers[rank] = ShardWriter(out, rank, max_queued_bytes=256 << 20)
            records += _convert_pass(list(group), writers[rank], seqs, names)
            writers[rank].end_pass()
    finally:
        errors = []
        for w in writers.values():
            try:
                w.close()
            except DumpError as e:
                errors.append(e)
    if errors:
        raise errors[0]
    if not records:
        raise DumpError(f"{src}: holds only batch fields ({', '.join(sorted(AUX_NAMES))}), no tensors to compare")
    records = [replace(r, file=writers[r.rank].locations[(r.forward_pass, r.key)]) for r in records]
    files_out = {k: v for w in writers.values() for k, v in w.files.items()}
    manifest = _manifest(src, records, files_out, seqs, model, len(files))
    parse_manifest(json.loads(json.dumps(manifest.to_json())), f"{printable(str(src))} (as converted)")  # as read back
    write_manifest(out, manifest)
    return manifest


def convert_sglang_dump(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    names: Mapping[str, str] | None = None,
    checkpoint: str | None = None,
) -> Manifest:
    """Convert the SGLang dump ``src`` into a new driftscope dump ``dst``; return its manifest.

    ``names`` maps SGLang tensor names to driftscope names (``{layer}``: the ``layer_id`` tag);
    ``checkpoint``, an HF directory, supplies the model identity. ``dst`` must not exist: the
    dump is built in a temporary directory beside it, manifest last, and renamed into place, so
    ``dst`` appears complete or not at all.
    """
    src, dst = Path(src), Path(dst)
    if os.path.lexists(dst):
        raise DumpError(f"{dst}: already exists; choose a new directory for the converted dump")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    except OSError as e:
        raise DumpError(f"{dst}: cannot create the dump directory ({e.strerror})") from None
    try:
        manifest = _convert(src, tmp, names or {}, checkpoint)
        os.chmod(tmp, dir_mode())
        os.rename(tmp, dst)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _point_at(e, tmp, dst)
        raise
    fsync_dir(dst.parent)
    return manifest


@contextlib.contextmanager
def open_dump_side(
    path: str | os.PathLike[str],
    *,
    names: Mapping[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> Iterator[Path]:
    """Yield a driftscope dump for ``path``: itself, or an SGLang dump converted into a temporary directory.

    The conversion copies the tensors, so it needs their size on disk in ``workdir`` (default:
    the system temporary directory); it is removed on exit.
    """
    if not is_sglang_dump(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="driftscope-sglang-", dir=workdir) as tmp:
        out = Path(tmp) / Path(path).name
        try:
            convert_sglang_dump(path, out, names=names)
            yield out
        except (DriftscopeError, OSError) as e:
            _point_at(e, out, path)
            raise


def _point_at(e: BaseException, temp: Path, user: str | os.PathLike[str]) -> None:
    """Make an error about the temporary dump ``temp`` (or a file in it) name the user's ``user`` instead.

    The one boundary between a conversion and its user: the temporary folder is gone by the time
    the error is printed, and the user never named it.
    """
    names = "|".join(re.escape(t) for t in {str(temp), printable(str(temp))})  # as is, or as a message shows it
    where = re.compile(rf"(?:{names})(?:{re.escape(os.sep)}[\w.\-]+)*(?![\w.\-])")
    if isinstance(e, OSError) and e.filename is not None and where.fullmatch(os.fsdecode(e.filename)):
        e.filename = os.fspath(user)
    elif isinstance(e, DriftscopeError) and e.args and isinstance(e.args[0], str):
        e.args = (where.sub(lambda _: printable(os.fspath(user)), e.args[0]), *e.args[1:])


def _name_map(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        src, sep, dst = pair.partition("=")
        if not sep or not src or not dst:
            raise UsageError(f"--name {pair!r}: expected SGLANG_NAME=DRIFTSCOPE_NAME")
        out[src] = dst
    return out


def main_import(argv: Sequence[str] | None = None) -> int:
    """``python -m comparator import-sglang SRC --out DST``: convert an SGLang dump, print one line."""
    p = Parser(
        prog="python -m comparator import-sglang",
        description="Convert a directory of SGLang dumper .pt files into a driftscope dump.",
    )
    add_import_sglang_flags(p)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    m = convert_sglang_dump(args.src, args.out, names=_name_map(args.name), checkpoint=args.checkpoint)
    layers, info = m.capture_signature["layers"], m.extra["sglang"]
    attn = f", self_attn inputs of layers {layers[0]}..{layers[-1]}" if layers else ", no self_attn inputs"
    print(
        f"{args.out}: {len(m.tensors)} tensors from {info['files']} SGLang files ({info['steps']} steps, "
        f"{m.capture_signature['world_size']} ranks{attn})"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(guarded_main(main_import))
