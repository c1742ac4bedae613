"""A capture whose dump lives at an fsspec URL (``s3://bucket/prefix``): each rank sends its own files there.

``dumper.capture(model, "s3://bucket/dumps/a")`` records as a local capture does, into a local
staging directory of this process, and on a clean exit sends the data to the URL (several files
at once), the manifest last (:mod:`dumper.format.remote`): a reader never takes a prefix without
its manifest for a dump. Under ``torch.distributed`` every rank sends its own data files and
then its part (``index-r{rank}.json``) straight to the URL, so ranks on other hosts need no
shared disk; after a barrier rank 0 reads the parts there and writes the one manifest. An
engine's worker (``part=True``, :mod:`dumper.engines.vllm.spool` with a URL spool) sends its
files and then its part, for the client that joins them. A capture that fails or records
nothing sends nothing that looks complete; the staging directory is removed either way.
Credentials come from fsspec's usual places (``AWS_ENDPOINT_URL``, ``~/.aws``, ...).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dumper.format import MANIFEST_NAME, TensorRecord
from dumper.format.remote import check_free, is_url, remove_prefix, upload_files
from dumper.hooks.capture import Capture
from dumper.hooks.parts import part_name, read_url_part, write_part

__all__ = ["RemoteCapture", "capture_class"]


def capture_class(out_dir: str | os.PathLike[str]) -> type[Capture]:
    """:class:`RemoteCapture` for a URL, :class:`~dumper.hooks.capture.Capture` for a local directory."""
    return RemoteCapture if is_url(out_dir) else Capture


class RemoteCapture(Capture):
    """A :class:`~dumper.hooks.capture.Capture` into a local staging directory, sent to ``out_dir``'s URL at the end."""

    def __init__(self, model: Any, out_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        self.url = os.fspath(out_dir).rstrip("/")
        self._staging = Path(tempfile.mkdtemp(prefix="driftscope-staging-"))
        try:
            super().__init__(model, self._staging / "dump", **kwargs)
        except BaseException:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise

    def __enter__(self) -> Capture:
        try:
            if not self._part:  # an engine worker's part goes into a fresh token prefix
                check_free(self.url)
            return super().__enter__()
        except BaseException:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise

    def _finish(self, *, complete: bool) -> None:
        if self._writer is None:
            return
        try:
            super()._finish(complete=complete)
            if not complete:
                return
            if self._part or self.world_size == 1:
                # the staging's data files, then what completes them: a worker's part, or the manifest
                last = part_name(self.rank) if self._part else MANIFEST_NAME
                names = [p.name for p in self.out_dir.iterdir() if p.name != last and p.is_file()]
                upload_files(self.out_dir, self.url, names, last=last)
        finally:
            shutil.rmtree(self._staging, ignore_errors=True)

    def _join_ranks(self, files: dict[str, int], records: tuple[TensorRecord, ...]) -> bool:
        """Every rank sends its data and its part to the URL; rank 0 reads all parts there and writes the manifest."""
        write_part(self.out_dir, self.rank, files, records)
        part = part_name(self.rank)
        upload_files(self.out_dir, self.url, files, last=part)
        torch.distributed.barrier()
        all_files: dict[str, int] = {}
        merged: list[TensorRecord] = []
        for r in range(self.world_size):
            got = read_url_part(self.url, r)
            if got is None:
                raise RuntimeError(f"{self.url}: rank {r}'s part is missing after the barrier")
            f, recs, _ = got
            all_files.update(f)
            merged.extend(recs)
        if self.rank == 0 and merged:
            self._write_manifest(all_files, tuple(merged))
            upload_files(self.out_dir, self.url, (), last=MANIFEST_NAME)
        torch.distributed.barrier()
        if not merged:
            remove_prefix(f"{self.url}/{part}")  # an empty run leaves no part behind
        return bool(merged)
