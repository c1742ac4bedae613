"""Read a logprob source from a path: a dump directory, a llama.cpp KL-divergence base file or engine JSONL.

The one function that tells the three kinds apart (:func:`read_logprob_source`); each kind is
read by its own module.
"""

from __future__ import annotations

import os
from pathlib import Path

from comparator.logprobs.sources.dump import dump_logprobs
from comparator.logprobs.sources.engine_json import read_logprobs_jsonl
from comparator.logprobs.sources.llama_kld import KldFile, is_kld_file
from comparator.logprobs.sources.source import LogprobSource
from dumper.errors import UsageError
from dumper.format import DumpReader
from dumper.format.files import file_kind
from dumper.format.remote import is_url

__all__ = ["read_logprob_source"]


def read_logprob_source(path: str | os.PathLike[str]) -> LogprobSource:
    """A dump directory or dump URL (with logprobs), a llama.cpp KL-divergence base file or an engine JSONL file."""
    p = Path(path)
    if is_url(path) or p.is_dir():  # a URL is a dump's (read in place, dumper.format.remote_read)
        reader = DumpReader(path)
        src = dump_logprobs(reader)
        if src is None:
            raise UsageError(
                f"{reader.directory}: the dump holds no logprobs (record them with `python -m dumper run --logprobs`)"
            )
        return src
    if not p.is_file():
        try:
            kind = file_kind(os.stat(p).st_mode)  # stat only: opening a FIFO could block
        except OSError:
            raise UsageError(f"{p}: no such dump directory or JSONL file") from None
        raise UsageError(f"{p}: {kind}, not a dump directory or a regular file; refusing to read it")
    if is_kld_file(p):
        kld = KldFile(p)
        return LogprobSource(
            str(p), None, kld.sequences(), vocab_size=kld.vocab_size, distributions=kld, dtype="float16"
        )
    return LogprobSource(str(p), None, tuple(read_logprobs_jsonl(p)))
