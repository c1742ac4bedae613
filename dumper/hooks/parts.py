"""Rank parts: what one rank of a capture recorded, before one manifest joins them.

Every rank of a multi-rank capture writes its records as a part, ``index-r{rank}.json`` (written
atomically, after its data files), beside its data files. A dump is complete only once one
manifest lists every rank's records; a part alone never looks complete (no ``manifest.json``).

Two ways join parts: ranks under one ``torch.distributed`` group (rank 0 writes the manifest
after a barrier, :func:`join_under_barrier`), and an engine whose ranks run in processes the
caller does not own (vLLM's workers): there the caller waits for the parts
(:func:`read_part`) and writes the manifest itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dumper.format import TensorRecord, write_json_atomic
from dumper.format.remote import read_small

__all__ = [
    "dist_rank_world",
    "part_path",
    "write_part",
    "read_part",
    "parse_part",
    "read_parts",
    "read_url_part",
    "join_under_barrier",
    "part_name",
    "PART_INFO_KEYS",
]

PART_INFO_KEYS = ("world_size", "signature", "identity", "environment", "extra")
"""What a part may say about its rank beside its files and tensors (a worker's model, engine and capture)."""


def dist_rank_world() -> tuple[int, int]:
    """(this process's rank, world size) under torch.distributed, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


_PART_LIMIT = 1 << 30
"""Most bytes of a part read from a URL (its records: a manifest's worth)."""


def part_name(rank: int) -> str:
    """The file name of rank ``rank``'s part (in a dump directory, or under a URL prefix)."""
    return f"index-r{rank}.json"


def part_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank``'s part of a dump in ``directory`` is written."""
    return directory / part_name(rank)


def write_part(directory: Path, rank: int, files: dict[str, int], records: Sequence[TensorRecord], **info: Any) -> Path:
    """Write rank ``rank``'s part atomically (its data files must already be in place)."""
    unknown = sorted(set(info) - set(PART_INFO_KEYS))
    if unknown:
        raise TypeError(f"write_part: unknown part fields {unknown}")
    path = part_path(directory, rank)
    write_json_atomic(path, {"files": files, "tensors": [r.to_json() for r in records], **info})
    return path


def read_part(path: Path) -> tuple[dict[str, int], tuple[TensorRecord, ...], dict[str, Any]]:
    """(data files, records, the other fields) of one part."""
    return parse_part(path.read_bytes())


def parse_part(raw: bytes) -> tuple[dict[str, int], tuple[TensorRecord, ...], dict[str, Any]]:
    """:func:`read_part` of a part's bytes (one read at a URL)."""
    part = json.loads(raw)
    info = {k: part[k] for k in PART_INFO_KEYS if k in part}
    return dict(part["files"]), tuple(TensorRecord.from_json(t) for t in part["tensors"]), info


def read_url_part(prefix: str, rank: int) -> tuple[dict[str, int], tuple[TensorRecord, ...], dict[str, Any]] | None:
    """:func:`read_part` of rank ``rank``'s part under the URL ``prefix``; None while it is not there."""
    raw = read_small(f"{prefix}/{part_name(rank)}", limit=_PART_LIMIT)
    return None if raw is None else parse_part(raw)


def read_parts(directory: Path, world_size: int) -> tuple[dict[str, int], tuple[TensorRecord, ...]]:
    """Every rank's data files and records, in rank order."""
    files: dict[str, int] = {}
    records: list[TensorRecord] = []
    for r in range(world_size):
        f, recs, _ = read_part(part_path(directory, r))
        files.update(f)
        records.extend(recs)
    return files, tuple(records)


def join_under_barrier(
    directory: Path,
    rank: int,
    world_size: int,
    files: dict[str, int],
    records: Sequence[TensorRecord],
    write_manifest: Any,
) -> bool:
    """Write this rank's part, wait for every rank's, and let rank 0 write the manifest of all.

    Every rank reads every part, so that every rank sees an empty run alike; returns whether
    any rank recorded anything (an empty run leaves no part behind).
    """
    index = write_part(directory, rank, files, records)
    torch.distributed.barrier()
    all_files, merged = read_parts(directory, world_size)
    if rank == 0 and merged:
        write_manifest(all_files, merged)
    torch.distributed.barrier()
    if not merged:
        index.unlink(missing_ok=True)
    return bool(merged)
