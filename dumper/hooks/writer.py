"""Background writer: turns captured tensors into fsynced safetensors shards off the forward path.

The hook thread only snapshots a tensor (a CPU clone, or a non-blocking device-to-pinned copy
plus a CUDA event on GPU) and enqueues it; this thread waits for the copy, groups a forward
pass's tensors into shards (a shard is closed once it holds ``shard_bytes``, or early when the
producer waits on a full queue) and writes each shard with
:func:`dumper.format.atomic.atomic_path` (a temporary name, fsync, rename, fsync of the folder),
so a shard exists under its final name only when it is whole. The writer never writes the
manifest: :class:`~dumper.hooks.capture.Capture` does, after :meth:`ShardWriter.close` returned,
so a failed write leaves a dump that never looks complete. Queued bytes are bounded so a slow
disk applies back-pressure instead of exhausting host memory.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dumper.errors import DumpError
from dumper.format.atomic import atomic_path, file_mode
from dumper.format.manifest import data_file_name

__all__ = ["ShardWriter", "snapshot", "WRITER_NICE"]

WRITER_NICE = 10
"""How much lower than the model's threads the writer thread runs (Linux niceness): the forward pass gets the
CPU first and the writer takes what the pass leaves; a writer that falls behind is bounded by back-pressure."""
_END_PASS = object()
_FLUSH = object()  # write what is pending now: a producer waits for the bytes it holds
_STOP = object()


@dataclass
class _Item:
    tensors: dict[str, tuple[torch.Tensor, Any]]  # key -> (snapshot, torch.cuda.Event | None), one file together
    forward_pass: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.tensors.values())


def snapshot(t: torch.Tensor, *, owned: bool = False) -> tuple[torch.Tensor, Any]:
    """A private, contiguous CPU copy of ``t`` that later in-place ops cannot change.

    On CUDA the copy goes into pinned memory with ``non_blocking=True`` and an event is
    returned; the writer waits on the event, so the forward pass never waits on the copy.
    ``owned``: ``t`` is already private (a fresh result nobody else holds, such as the kept
    rows of a pass), so a contiguous CPU ``t`` is taken as it is, without a second copy.
    """
    t = t.detach()
    if owned and t.device.type == "cpu" and t.is_contiguous():
        return t, None
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        buf.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(t.device))
        return buf, ev
    if t.device.type != "cpu":
        return t.to("cpu").contiguous(), None
    return t.clone(memory_format=torch.contiguous_format), None


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`WRITER_NICE` (Linux: niceness is per thread; elsewhere
    nothing changes). Copying into the page cache is CPU work in the kernel, which would otherwise preempt
    the engine's compute threads on a host whose cores they fill (a CPU engine; a busy GPU host's scheduler)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except OSError:  # not allowed here: the writer runs at the caller's priority
        pass


class ShardWriter:
    """Writes one rank's tensors to ``directory``; ``files`` maps written file -> byte size."""

    def __init__(
        self, directory: Path, rank: int, *, shard_bytes: int = 512 << 20, max_queued_bytes: int = 2 << 30
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.shard_bytes = shard_bytes
        self.max_queued_bytes = max_queued_bytes
        self.file_mode = file_mode()  # safetensors creates its files 0600; give them the user's umask
        self.files: dict[str, int] = {}
        self.locations: dict[tuple[int, str], str] = {}  # (pass, key) -> file
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queued = 0
        self._flush_asked = False
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="driftscope-writer", daemon=True)
        self._thread.start()

    def put(
        self,
        forward_pass: int,
        key: str,
        tensor: torch.Tensor,
        *,
        companions: dict[str, torch.Tensor] | None = None,
        owned: bool = False,
    ) -> None:
        """Snapshot ``tensor`` (and ``companions``, written to the same file under their keys) and queue it;
        blocks while too many bytes are queued. ``owned``: every one of them is private (see :func:`snapshot`).

        While it waits, the shard being gathered is written early (it would otherwise wait for
        bytes this call holds back: a shard bigger than the queue, or one huge tensor).
        """
        self._raise_if_failed()
        group = {key: tensor, **(companions or {})}
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        with self._cond:
            while self._queued > 0 and self._queued + nbytes > self.max_queued_bytes and self._error is None:
                if not self._flush_asked:
                    self._flush_asked = True
                    self._queue.put(_FLUSH)
                self._cond.wait()
            self._queued += nbytes
        self._queue.put(_Item({k: snapshot(t, owned=owned) for k, t in group.items()}, forward_pass))

    def end_pass(self) -> None:
        """Flush the current forward pass's tensors to their own shard(s)."""
        self._queue.put(_END_PASS)

    def close(self) -> None:
        """Write everything queued and stop; raises if any write failed."""
        self._queue.put(_STOP)
        self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, DumpError):
                raise err
            raise DumpError(f"{self.directory}: writing the dump failed ({type(err).__name__}: {err})") from err

    def _run(self) -> None:
        _lower_priority()
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = 0
        pending_pass: int | None = None
        next_shard: dict[int, int] = {}

        def flush() -> None:
            nonlocal pending, pending_bytes
            if pending and pending_pass is not None:
                shard = next_shard.get(pending_pass, 0)
                next_shard[pending_pass] = shard + 1
                self._write(pending_pass, shard, pending)
                self._release(pending_bytes)
                pending, pending_bytes = {}, 0

        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    flush()
                    return
                if item is _END_PASS or item is _FLUSH:
                    flush()
                    continue
                if item.forward_pass != pending_pass:
                    flush()
                    pending_pass = item.forward_pass
                for k, (tensor, event) in item.tensors.items():
                    if event is not None:
                        event.synchronize()
                    pending[k] = tensor
                pending_bytes += item.nbytes
                if pending_bytes >= self.shard_bytes:
                    flush()
            except BaseException as e:  # surfaced to the producer on its next call
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                if item is _STOP:
                    return

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._queued -= nbytes
            self._flush_asked = False
            self._cond.notify_all()

    def _write(self, forward_pass: int, shard: int, tensors: dict[str, torch.Tensor]) -> None:
        name = data_file_name(self.rank, forward_pass, shard)
        final = self.directory / name
        with atomic_path(final) as tmp:  # fsynced and renamed into place; removed if anything fails
            save_file(tensors, str(tmp))
            os.chmod(tmp, self.file_mode)  # safetensors replaces the file with one of its own, mode 0600
        self.files[name] = final.stat().st_size
        for key in tensors:
            self.locations[(forward_pass, key)] = name
