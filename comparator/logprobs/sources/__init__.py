"""Where logprobs come from: a driftscope dump, an engine's JSONL output (SGLang, vLLM, OpenAI),
or a llama.cpp KL-divergence base file (``llama-perplexity --kl-divergence-base``, told by its magic).

:func:`read_logprob_source` tells them apart; :func:`judge_sources` is the one place a logprob
verdict is made from two sources (``comparator logprobs`` through :func:`compare_logprob_sources`,
``comparator A B`` through :func:`comparator.hidden.compare.compare_dumps`). One module per kind:
:mod:`~comparator.logprobs.sources.dump` (a dump's logprob rows and logits),
:mod:`~comparator.logprobs.sources.engine_json` (engine JSONL),
:mod:`~comparator.logprobs.sources.llama_kld` (a base file's chunks are requests ``"0"``, ``"1"``,
..., its full distributions streamed from disk, against another base file or a dump's logits
rows); :mod:`~comparator.logprobs.sources.collect` writes engine JSONL from a live server.

Example::

    from comparator.logprobs.sources import compare_logprob_sources
    verdict = compare_logprob_sources("dumps/a", "sglang_responses.jsonl")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dumper.errors import NotComparableError, UsageError
from dumper.format import DumpReader
from dumper.format.files import file_kind

from comparator.hidden.identity import check_distinct, check_identity
from comparator.logprobs.kl_stream import Distributions, LogitsDistributions, stream_kl
from comparator.logprobs.sources.dump import dump_logprobs
from comparator.logprobs.sources.engine_json import read_logprobs_jsonl
from comparator.logprobs.sources.llama_kld import KldFile, is_kld_file
from comparator.logprobs.sources.source import LogprobSource, check_vocabulary, one_sided_parts
from comparator.logprobs.types import KlPass
from comparator.logprobs.verdict import LogprobVerdict, compare_logprobs
from comparator.noise.logprobs import resolve_logprob_thresholds, threshold_dtype

if TYPE_CHECKING:
    from comparator.noise.logprobs import LogprobNoise
    from comparator.noise.model import NoiseModel

__all__ = ["LogprobSource", "dump_logprobs", "read_logprob_source", "check_vocabulary", "one_sided_parts",
           "judge_sources", "compare_logprob_sources"]


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


def _streamed_kl(base: LogprobSource, targ: LogprobSource) -> KlPass | None:
    """KL streamed from disk when a side is a llama.cpp base file and the other has distributions too."""
    def dist(src: LogprobSource) -> Distributions | None:
        if src.distributions is not None:
            return src.distributions
        return None if src.logits is None else LogitsDistributions(src.logits, src.path)

    ref, tgt = dist(base), dist(targ)
    if ref is None or tgt is None:
        return None
    return lambda samples: stream_kl(ref, tgt, samples)


def judge_sources(base: LogprobSource, targ: LogprobSource, *, model: str | None = None,
                  explicit: Mapping[str, float | None] | None = None, noise: LogprobNoise | None = None,
                  noise_factor: float | None = None, noise_floors: Mapping[str, float] | None = None,
                  ) -> tuple[LogprobVerdict, list[str], list[str]]:
    """The logprob verdict of two sources, and the parts recorded on one side only (:func:`one_sided_parts`).

    Token ids are checked against the vocabulary when a side knows it; thresholds resolve for
    ``model`` (default: the baseline's) and the coarsest dtype of the sides, or from ``noise``
    with ``noise_factor`` and ``noise_floors``
    (:func:`comparator.noise.logprobs.resolve_logprob_thresholds`). KL is computed from logits
    rows when both sides hold them in memory, else streamed when both have full distributions.
    """
    check_vocabulary(base, targ)
    thresholds = resolve_logprob_thresholds(model or base.model, explicit=explicit, noise=noise,
                                            factor=noise_factor, floors=noise_floors,
                                            dtype=threshold_dtype(base.dtype, targ.dtype))
    both = base.logits is not None and targ.logits is not None
    verdict = compare_logprobs(base.sequences, targ.sequences, thresholds,
                               ref_logits=base.logits if both else None, tgt_logits=targ.logits if both else None,
                               kl_pass=None if both else _streamed_kl(base, targ))
    return (verdict, *one_sided_parts(base, targ))


def compare_logprob_sources(baseline: str | os.PathLike[str], target: str | os.PathLike[str], *,
                            model: str | None = None, explicit: Mapping[str, float | None] | None = None,
                            allow_model_mismatch: bool = False, noise: NoiseModel | None = None,
                            noise_factor: float | None = None,
                            noise_floors: Mapping[str, float] | None = None) -> LogprobVerdict:
    """Compare the logprobs of two sources (paths) with :func:`judge_sources`; ``noise`` is a
    calibration of this baseline, which must hold logprob noise.

    Parts recorded on one side only are appended to the verdict's ``unmatched_baseline`` /
    ``unmatched_target``, after the unmatched request ids. Two dumps' model identities are
    checked first; sources that cannot be compared (no request in common, a request covering
    fewer positions on one side, different tokens) raise NotComparableError naming both paths.
    """
    check_distinct(baseline, target)
    if noise is not None and noise.logprobs is None:
        raise UsageError(f"{noise.source or 'the noise file'}: holds no logprob noise (its variants recorded no "
                         "logprobs); calibrate from sources that record them")
    base, targ = read_logprob_source(baseline), read_logprob_source(target)
    if base.manifest is not None and targ.manifest is not None:
        check_identity(base.manifest, targ.manifest, allow_mismatch=allow_model_mismatch,
                       where=f"{targ.path} vs baseline {base.path}")
    if noise is not None and base.manifest is not None:
        noise.check_baseline(base.manifest, f"the baseline {base.path}")
    try:
        verdict, only_b, only_t = judge_sources(base, targ, model=model, explicit=explicit,
                                                noise=None if noise is None else noise.logprobs,
                                                noise_factor=noise_factor, noise_floors=noise_floors)
    except NotComparableError as e:
        raise NotComparableError(f"{base.path} vs {targ.path}: {e}") from None
    caveat = None if noise is None else noise.mismatch_warning()
    if caveat is not None and verdict.noise is not None:  # a calibration across models: every verdict says so
        verdict = replace(verdict, noise=replace(verdict.noise, warnings=(caveat, *verdict.noise.warnings)))
    return replace(verdict, unmatched_baseline=verdict.unmatched_baseline + tuple(only_b),
                   unmatched_target=verdict.unmatched_target + tuple(only_t))
