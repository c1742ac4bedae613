"""The client side of a capture inside vLLM's processes: a token, marked requests, and the join of the parts.

:func:`spool_root` is the directory vLLM's processes record into (``DRIFTSCOPE_VLLM_SPOOL``;
set before the engine starts, so that its processes inherit it). After the marked requests
have run, :func:`wait_parts` waits for every rank's part of the token's directory (a worker
that lags its output by a moment, or one that dropped the capture and says why), and
:func:`take_parts` moves the parts' data files into the dump being written and hands their
records to its :class:`~dumper.hooks.capture.Capture`, whose manifest, written last, is the
only thing that makes the dump complete (:mod:`dumper.engines.vllm.spool` is the worker side).
:func:`join_dump` is the one join: the parts, the caller's own records (prompt logprobs, from
vLLM's ``RequestOutput``s or a server's answers) and the manifest, written last.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dumper.engines.base import EngineInfo
from dumper.engines.vllm.spool import check_token
from dumper.errors import DumpError, UsageError
from dumper.format import Manifest, TensorRecord, load_manifest
from dumper.format.atomic import atomic_path
from dumper.format.files import check_plain_name
from dumper.format.remote import download, is_url, listed, read_small, remove_prefix
from dumper.hooks.capture import Capture
from dumper.hooks.kv_cache import MAX_FAILURES
from dumper.hooks.parts import part_name, part_path, read_part, read_url_part
from dumper.settings import VLLM_SPOOL_ENV, env_settings

__all__ = [
    "RankParts",
    "spool_root",
    "new_token",
    "wait_parts",
    "take_parts",
    "join_dump",
    "remove_spool",
    "kv_cache_extra",
    "PART_TIMEOUT_S",
]

PART_TIMEOUT_S = 120.0
"""How long after the last marked request returned the client waits for every rank's part."""


@dataclass
class RankParts:
    """Every rank's part of one capture token: data files, records, and what rank 0 says of the engine."""

    directory: Path | str  # a URL spool's token prefix, or a local directory
    files: dict[int, dict[str, int]] = field(default_factory=dict)
    records: dict[int, tuple[TensorRecord, ...]] = field(default_factory=dict)
    infos: dict[int, dict[str, Any]] = field(default_factory=dict)  # what each rank's part says beside its records

    @property
    def info(self) -> dict[str, Any]:
        """What rank 0's part says (empty until it is there): the world size, the model, the engine."""
        return self.infos.get(0, {})

    @property
    def world_size(self) -> int:
        return int(self.info.get("world_size") or 1)

    @property
    def last_pass(self) -> int:
        """The highest forward pass any rank recorded (-1: none)."""
        return max((r.forward_pass for recs in self.records.values() for r in recs), default=-1)

    @property
    def engine_settings(self) -> dict[str, Any]:
        """How the engine ran the model, as rank 0's worker said (:func:`dumper.engines.vllm.spool.engine_settings`)."""
        return dict((self.info.get("extra") or {}).get("engine_settings") or {})


def spool_root() -> Path | str:
    """The spool vLLM's processes record into: ``$DRIFTSCOPE_VLLM_SPOOL`` (a directory or a URL), else a new
    directory, exported."""
    root = env_settings().vllm_spool
    if root and is_url(root):
        return root.rstrip("/")
    if not root:
        root = os.environ[VLLM_SPOOL_ENV] = tempfile.mkdtemp(prefix="driftscope-spool-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)  # ours: gone with this process
    path = Path(root)
    if not path.is_dir():
        raise UsageError(f"{VLLM_SPOOL_ENV}={root}: not a directory")
    return path


def new_token() -> str:
    """A fresh capture token (a plain directory name no other client will pick)."""
    token = f"c{secrets.token_hex(8)}"
    assert check_token(token) == token
    return token


def _failure(directory: Path | str) -> str | None:
    if isinstance(directory, str):  # a URL spool
        for name in listed(directory, "failed-r*.txt"):
            text = (read_small(f"{directory}/{name}") or b"").decode(errors="replace")
            return f"{name[len('failed-') : -len('.txt')]}: {text.strip()[:300]}"
        return None
    for path in sorted(directory.glob("failed-r*.txt")) if directory.is_dir() else ():
        return f"{path.name[len('failed-') : -len('.txt')]}: {path.read_text(errors='replace').strip()[:300]}"
    return None


def _part(directory: Path | str, rank: int) -> tuple[dict[str, int], tuple[TensorRecord, ...], dict[str, Any]] | None:
    """Rank ``rank``'s part in ``directory`` once it is there (a part is written after its rank's data files)."""
    if isinstance(directory, str):
        return read_url_part(directory, rank)
    path = part_path(directory, rank)
    return read_part(path) if path.is_file() else None


def wait_parts(directory: Path | str, *, timeout_s: float = PART_TIMEOUT_S, poll_s: float | None = None) -> RankParts:
    """Every rank's part in ``directory`` (rank 0's says the world size); a DumpError on a failure or time-out.

    A rank that dropped the capture (``failed-r{r}.txt``) fails at once, with its reason; one
    that wrote nothing in ``timeout_s`` fails naming the ranks that are missing.
    """
    parts = RankParts(directory)
    deadline = time.monotonic() + timeout_s
    poll_s = poll_s if poll_s is not None else 0.5 if isinstance(directory, str) else 0.05  # a URL: a request a poll
    while True:
        reason = _failure(directory)
        if reason is not None:
            raise DumpError(f"{directory}: vLLM's capture failed on rank {reason}; no dump was written")
        for rank in range(max(parts.world_size, 1)):
            found = None if rank in parts.files else _part(directory, rank)
            if found is not None:
                files, records, info = found
                parts.files[rank], parts.records[rank], parts.infos[rank] = files, records, info
        if parts.info and len(parts.files) == parts.world_size:
            return parts
        if time.monotonic() > deadline:
            missing = [r for r in range(max(parts.world_size, 1)) if r not in parts.files]
            raise DumpError(
                f"{directory}: no capture part from vLLM rank(s) {missing} within {timeout_s:.0f} s of "
                "the last request (a worker died, the server runs without the driftscope tap, or a pass "
                "ran where the tap is not read back, e.g. a full CUDA-graph replay); no dump was written"
            )
        time.sleep(poll_s)


def _move(src: Path, dst: Path) -> None:
    """Move one data file into the dump: a rename on the same filesystem, else a copy made atomic, then the source
    goes."""
    try:
        os.replace(src, dst)
        return
    except OSError:
        pass
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    src.unlink()


def take_parts(capture: Any, parts: RankParts) -> None:
    """Move every rank's data files into ``capture``'s dump directory and adopt their records (from a URL
    spool: streamed down, each refused unless it is the size its part says)."""
    for rank in sorted(parts.files):
        files = parts.files[rank]
        where = f"{parts.directory}/{part_name(rank)}"
        for name in files:
            check_plain_name(name, where, "files")  # a part names files of its own token's directory, nothing else
            if type(files[name]) is not int or files[name] < 0:
                raise DumpError(f"{where}: files.{name}: expected a size in bytes, got {files[name]!r}")
            target = capture.out_dir / name
            if target.exists():
                raise DumpError(f"{target}: already exists; the dump directory must hold no other data files")
            if isinstance(parts.directory, str):
                download(parts.directory, name, files[name], capture.out_dir)
            else:
                _move(parts.directory / name, target)
        capture.adopt(files, parts.records[rank])


def join_dump(
    out: str | os.PathLike[str],
    parts: RankParts,
    *,
    model_name: str | None,
    identity: dict[str, Any],
    engine: EngineInfo,
    job_extra: dict[str, Any],
    record: Callable[[Capture], None] | None = None,
) -> Manifest:
    """Write the dump at ``out``: every rank's records, ``record(capture)``'s own, and the manifest last.

    ``record`` adds what the caller holds (the prompt logprobs vLLM returned) into the capture,
    whose passes start after the parts' last one. The manifest's ``extra`` is ``job_extra`` with
    ``engine``; its environment is rank 0's, with the engine's settings as ``engine_*`` keys.
    """
    environment = {**dict(parts.info.get("environment") or {}), **engine.environment()}
    kv = kv_cache_extra(parts)
    cap = Capture(
        None,
        out,
        model_name=model_name,
        extra={**job_extra, "engine": engine.to_json(), **({"kv_cache": kv} if kv else {})},
        identity=identity,
        environment=environment,
        signature=parts.info.get("signature"),
        first_pass=parts.last_pass + 1,
    )
    with torch.inference_mode(), cap:
        take_parts(cap, parts)
        if record is not None:
            record(cap)
    return load_manifest(out)


def kv_cache_extra(parts: RankParts) -> dict[str, Any] | None:
    """The dump's ``extra.kv_cache``: rank 0's layout, and every rank's read-back checks added up (each failure
    says its rank)."""
    ranks = {r: (parts.infos.get(r) or {}).get("extra", {}).get("kv_cache") for r in parts.files}
    ranks = {r: kv for r, kv in ranks.items() if isinstance(kv, dict)}
    if not ranks:
        return None
    first = ranks[min(ranks)]
    checks = [kv.get("readback") or {} for kv in ranks.values()]
    failures = [
        {**f, "rank": r} for r, kv in sorted(ranks.items()) for f in (kv.get("readback") or {}).get("failures", [])
    ]
    return {
        **first,
        "readback": {
            "checked": sum(int(c.get("checked", 0)) for c in checks),
            "failed": sum(int(c.get("failed", 0)) for c in checks),
            "failures": failures[:MAX_FAILURES],
        },
    }


def remove_spool(directory: Path | str) -> None:
    """Delete a token's spool directory or URL prefix (what is left of a failed or joined capture)."""
    if isinstance(directory, str):
        remove_prefix(directory)
    else:
        shutil.rmtree(directory, ignore_errors=True)
