"""The one place a logprob verdict is made from two sources.

:func:`judge_sources` checks the vocabularies, resolves the thresholds (fixed, or derived from a
calibration: :func:`comparator.judging.noise_thresholds.resolve_logprob_thresholds`), picks how KL
is computed and hands back a :class:`LogprobJudgement`; ``comparator A B`` reaches it through
:func:`comparator.hidden.compare.compare_dumps`, ``comparator logprobs`` and calibration through
:func:`compare_logprob_sources`, which reads two paths first. Data only goes downward: sources ->
thresholds (judging) -> :func:`~comparator.logprobs.verdict.compare_logprobs` -> the noise check (judging).

Example::

    from comparator.logprobs.judge import compare_logprob_sources
    verdict = compare_logprob_sources("dumps/a", "sglang_responses.jsonl")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from comparator.judging.identity import check_distinct, check_identity
from comparator.judging.logprob_noise import LogprobNoise
from comparator.judging.logprob_thresholds import threshold_dtype
from comparator.judging.noise import NoiseModel
from comparator.judging.noise_thresholds import resolve_logprob_thresholds
from comparator.logprobs.kl_stream import Distributions, LogitsDistributions, stream_kl
from comparator.logprobs.sources import read_logprob_source
from comparator.logprobs.sources.source import LogprobSource, check_vocabulary, one_sided_parts
from comparator.logprobs.types import KlPass, LogprobVerdict
from comparator.logprobs.verdict import compare_logprobs
from dumper.errors import NotComparableError, UsageError

__all__ = ["LogprobJudgement", "judge_sources", "compare_logprob_sources"]


@dataclass(frozen=True)
class LogprobJudgement:
    """The verdict of two sources, and the logprob parts (logits rows, top-k lists) recorded on one side
    only, so not compared (:func:`~comparator.logprobs.sources.source.one_sided_parts`)."""

    verdict: LogprobVerdict
    only_baseline: tuple[str, ...] = ()
    only_target: tuple[str, ...] = ()


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


def judge_sources(
    base: LogprobSource,
    targ: LogprobSource,
    *,
    model: str | None = None,
    explicit: Mapping[str, float | None] | None = None,
    noise: LogprobNoise | None = None,
    noise_factor: float | None = None,
    noise_floors: Mapping[str, float] | None = None,
) -> LogprobJudgement:
    """The logprob verdict of two sources, with the parts recorded on one side only.

    Token ids are checked against the vocabulary when a side knows it; thresholds resolve for
    ``model`` (default: the baseline's) and the coarsest dtype of the sides, or from ``noise``
    with ``noise_factor`` and ``noise_floors``. KL is computed from logits rows when both sides
    hold them in memory, else streamed when both have full distributions.
    """
    check_vocabulary(base, targ)
    thresholds = resolve_logprob_thresholds(
        model or base.model,
        explicit=explicit,
        noise=noise,
        factor=noise_factor,
        floors=noise_floors,
        dtype=threshold_dtype(base.dtype, targ.dtype),
    )
    both = base.logits is not None and targ.logits is not None
    verdict = compare_logprobs(
        base.sequences,
        targ.sequences,
        thresholds,
        ref_logits=base.logits if both else None,
        tgt_logits=targ.logits if both else None,
        kl_pass=None if both else _streamed_kl(base, targ),
    )
    only_b, only_t = one_sided_parts(base, targ)
    return LogprobJudgement(verdict, tuple(only_b), tuple(only_t))


def compare_logprob_sources(
    baseline: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    model: str | None = None,
    explicit: Mapping[str, float | None] | None = None,
    allow_model_mismatch: bool = False,
    noise: NoiseModel | None = None,
    noise_factor: float | None = None,
    noise_floors: Mapping[str, float] | None = None,
) -> LogprobVerdict:
    """Compare the logprobs of two sources (paths) with :func:`judge_sources`; ``noise`` is a
    calibration of this baseline, which must hold logprob noise.

    Parts recorded on one side only are appended to the verdict's ``unmatched_baseline`` /
    ``unmatched_target``, after the unmatched request ids. Two dumps' model identities are
    checked first; sources that cannot be compared (no request in common, a request covering
    fewer positions on one side, different tokens) raise NotComparableError naming both paths.
    """
    check_distinct(baseline, target)
    if noise is not None and noise.logprobs is None:
        raise UsageError(
            f"{noise.source or 'the noise file'}: holds no logprob noise (its variants recorded no "
            "logprobs); calibrate from sources that record them"
        )
    base, targ = read_logprob_source(baseline), read_logprob_source(target)
    if base.manifest is not None and targ.manifest is not None:
        check_identity(
            base.manifest,
            targ.manifest,
            allow_mismatch=allow_model_mismatch,
            where=f"{targ.path} vs baseline {base.path}",
        )
    if noise is not None and base.manifest is not None:
        noise.check_baseline(base.manifest, f"the baseline {base.path}")
    try:
        judged = judge_sources(
            base,
            targ,
            model=model,
            explicit=explicit,
            noise=None if noise is None else noise.logprobs,
            noise_factor=noise_factor,
            noise_floors=noise_floors,
        )
    except NotComparableError as e:
        raise NotComparableError(f"{base.path} vs {targ.path}: {e}") from None
    verdict = judged.verdict
    caveat = None if noise is None else noise.mismatch_warning()
    if caveat is not None and verdict.noise is not None:  # a calibration across models: every verdict says so
        verdict = replace(verdict, noise=replace(verdict.noise, warnings=(caveat, *verdict.noise.warnings)))
    return replace(
        verdict,
        unmatched_baseline=verdict.unmatched_baseline + judged.only_baseline,
        unmatched_target=verdict.unmatched_target + judged.only_target,
    )
