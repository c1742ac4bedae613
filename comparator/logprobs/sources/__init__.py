"""Where logprobs come from: a driftscope dump, an engine's JSONL output (SGLang, vLLM, OpenAI),
or a llama.cpp KL-divergence base file (``llama-perplexity --kl-divergence-base``, told by its magic).

:func:`read_logprob_source` (:mod:`~comparator.logprobs.sources.read`) tells them apart; a verdict
is made from two sources by :mod:`comparator.logprobs.judge`. One module per kind:
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

from comparator.exports import lazy_exports

# each name loads its module on first use (the CLIs' --api/--timeout flags import dumper.server.flags alone)
_EXPORTS = {
    "LogprobSource": "comparator.logprobs.sources.source",
    "check_vocabulary": "comparator.logprobs.sources.source",
    "one_sided_parts": "comparator.logprobs.sources.source",
    "dump_logprobs": "comparator.logprobs.sources.dump",
    "read_logprob_source": "comparator.logprobs.sources.read",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["LogprobSource", "dump_logprobs", "read_logprob_source", "check_vocabulary", "one_sided_parts"]
