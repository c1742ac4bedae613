"""Where logprobs come from: a driftscope dump, an engine's JSONL output (SGLang, vLLM, OpenAI),
or a llama.cpp KL-divergence base file (``llama-perplexity --kl-divergence-base``, told by its magic).

:func:`read_logprob_source` tells them apart; a verdict is made from two sources by
:mod:`comparator.logprobs.judge`. One module per kind:
:mod:`~comparator.logprobs.sources.dump` (a dump's logprob rows and logits),
:mod:`~comparator.logprobs.sources.engine_json` (engine JSONL),
:mod:`~comparator.logprobs.sources.llama_kld` (a base file's chunks are requests ``"0"``, ``"1"``,
..., its full distributions streamed from disk, against another base file or a dump's logits
rows); :mod:`~comparator.logprobs.sources.collect` writes engine JSONL from a live server;
:mod:`~comparator.logprobs.sources.input_caps` bounds what one source may hold.

Example::

    from comparator.logprobs.sources import read_logprob_source
    source = read_logprob_source("sglang_responses.jsonl")
"""

from __future__ import annotations

import os
from pathlib import Path

from dumper.errors import UsageError
from dumper.format import DumpReader
from dumper.format.files import file_kind

from comparator.logprobs.sources.dump import dump_logprobs
from comparator.logprobs.sources.engine_json import read_logprobs_jsonl
from comparator.logprobs.sources.llama_kld import KldFile, is_kld_file
from comparator.logprobs.sources.source import LogprobSource, check_vocabulary, one_sided_parts

__all__ = ["LogprobSource", "dump_logprobs", "read_logprob_source", "check_vocabulary", "one_sided_parts"]


def read_logprob_source(path: str | os.PathLike[str]) -> LogprobSource:
    """A dump directory (with logprobs), a llama.cpp KL-divergence base file or an engine JSONL file."""
    p = Path(path)
    if p.is_dir():
        src = dump_logprobs(DumpReader(p))
        if src is None:
            raise UsageError(f"{p}: the dump holds no logprobs (record them with `python -m dumper run --logprobs`)")
        return src
    if not p.is_file():
        try:
            kind = file_kind(os.stat(p).st_mode)  # stat only: opening a FIFO could block
        except OSError:
            raise UsageError(f"{p}: no such dump directory or JSONL file") from None
        raise UsageError(f"{p}: {kind}, not a dump directory or a regular file; refusing to read it")
    if is_kld_file(p):
        kld = KldFile(p)
        return LogprobSource(str(p), None, kld.sequences(), vocab_size=kld.vocab_size, distributions=kld,
                             dtype="float16")
    return LogprobSource(str(p), None, tuple(read_logprobs_jsonl(p)))
