"""driftscope comparator: compare two dumps and name the first divergent layer and token.

Example::

    from comparator import CompareConfig, compare_dumps
    report = compare_dumps("dumps/eager", "dumps/sdpa", CompareConfig())
    if not report:
        fd = report.first_divergent
        print(f"diverged at layer {fd.layer}, token {fd.token}")
    report.write_json("report.json")

Golden baselines for CI (a run store, see :mod:`comparator.store`)::

    from comparator import regress
    result = regress("dumps/nightly", "s3://bucket/driftscope", bootstrap=False)
    raise SystemExit(result.exit_code)      # 0 passed, 1 divergence, 2 unusable
"""

from comparator.hidden.compare import compare_dumps
from comparator.config import CompareConfig
from comparator.logprobs import LogprobThresholds, LogprobVerdict, SequenceLogprobs, compare_logprobs
from comparator.hidden.metrics import PairStats, pair_stats, rel_diff
from comparator.store.regress import RegressResult, regress
from comparator.results import FirstDivergence, Heatmap, LayerSummary, ReplicaMismatch, Report, TensorComparison
from comparator.logprobs.sources import compare_logprob_sources
from comparator.store import RunStore, select_baseline

__all__ = [
    "compare_dumps",
    "compare_logprobs",
    "compare_logprob_sources",
    "SequenceLogprobs",
    "LogprobThresholds",
    "LogprobVerdict",
    "CompareConfig",
    "Report",
    "TensorComparison",
    "FirstDivergence",
    "Heatmap",
    "ReplicaMismatch",
    "LayerSummary",
    "PairStats",
    "pair_stats",
    "rel_diff",
    "regress",
    "RegressResult",
    "RunStore",
    "select_baseline",
]
