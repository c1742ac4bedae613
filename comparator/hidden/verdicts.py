"""The verdicts a hidden-state comparison holds besides its tensors: logprobs and MoE routing.

Each loads only when a manifest holds such records (a plain comparison imports neither verdict);
a decode comparison cuts the logprobs at each fork first (:mod:`comparator.hidden.decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from comparator.config import CompareConfig
from comparator.hidden.decode import DecodePlan, cut_logprobs
from comparator.hidden.subset import subset_logprobs
from dumper.format import LOGPROB_NAMES, LOGPROB_POINT, ROUTER_POINTS, DumpReader, Manifest, TensorRecord

if TYPE_CHECKING:
    from comparator.logprobs import LogprobVerdict
    from comparator.logprobs.sources.source import LogprobSource
    from comparator.routing.types import RouterComparison

__all__ = ["has_logprobs", "logprob_verdict", "routing_verdict", "holds"]


def has_logprobs(manifest: Manifest) -> bool:
    return any(r.point == LOGPROB_POINT for r in manifest.tensors)


def logprob_verdict(
    br: DumpReader, tr: DumpReader, config: CompareConfig, decode: DecodePlan | None
) -> tuple[LogprobVerdict | None, list[str], list[str], LogprobSource | None]:
    """The logprob verdict when both dumps recorded logprobs (else None), the logprob parts (logits
    rows, top-k lists) that only one side recorded, so were not compared, and the baseline's logprobs
    as read (a decode fork's gap is read from them)."""
    if not holds(br, tr, lambda r: r.name in LOGPROB_NAMES):
        return None, [], [], None  # what dump_logprobs says of two dumps without them, without importing it
    from comparator.logprobs.judge import judge_sources
    from comparator.logprobs.sources.dump import dump_logprobs

    read, targ = dump_logprobs(br), dump_logprobs(tr)
    if read is None or targ is None:
        return None, [], [], read
    base = read
    if decode is not None and decode.limits:  # two decode runs: nothing from a fork on
        base, targ = cut_logprobs(base, decode.limits), cut_logprobs(targ, decode.limits)
    if config.subset:
        base = subset_logprobs(base, targ)
    judged = judge_sources(
        base,
        targ,
        model=config.model,
        explicit=dict(config.logprob_thresholds),
        noise=config.noise.logprobs if config.noise is not None else None,
        noise_factor=config.noise_factor,
        noise_floors=dict(config.noise_floors),
    )
    return judged.verdict, list(judged.only_baseline), list(judged.only_target), read


def routing_verdict(br: DumpReader, tr: DumpReader, config: CompareConfig) -> RouterComparison | None:
    """The routing verdict when both dumps recorded routing (else None)."""
    if not holds(br, tr, lambda r: r.point in ROUTER_POINTS):
        return None  # what compare_routing says of two dumps without routing, without importing it
    from comparator.routing.compare import compare_routing

    return compare_routing(
        br, tr, noise=config.noise.router if config.noise is not None else None, factor=config.noise_factor
    )


def holds(br: DumpReader, tr: DumpReader, wanted: Callable[[TensorRecord], bool]) -> bool:
    """Whether either dump's manifest lists a record that is ``wanted``."""
    return any(wanted(r) for reader in (br, tr) for r in reader.manifest.tensors)
