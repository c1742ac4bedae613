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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "compare_dumps": "comparator.hidden.compare",
    "compare_logprobs": "comparator.logprobs",
    "compare_logprob_sources": "comparator.logprobs.sources",
    "SequenceLogprobs": "comparator.logprobs",
    "LogprobThresholds": "comparator.logprobs",
    "LogprobVerdict": "comparator.logprobs",
    "CompareConfig": "comparator.config",
    "Report": "comparator.results",
    "TensorComparison": "comparator.results",
    "FirstDivergence": "comparator.results",
    "Heatmap": "comparator.results",
    "ReplicaMismatch": "comparator.results",
    "LayerSummary": "comparator.results",
    "PairStats": "comparator.hidden.metrics",
    "pair_stats": "comparator.hidden.metrics",
    "rel_diff": "comparator.hidden.metrics",
    "regress": "comparator.store.regress",
    "RegressResult": "comparator.store.regress",
    "RunStore": "comparator.store",
    "select_baseline": "comparator.store",
}
"""Public name -> the module that defines it, imported on first use (PEP 562), so that
``python -m comparator`` and a library user load only what they touch."""

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

if TYPE_CHECKING:
    from comparator.config import CompareConfig
    from comparator.hidden.compare import compare_dumps
    from comparator.hidden.metrics import PairStats, pair_stats, rel_diff
    from comparator.logprobs import LogprobThresholds, LogprobVerdict, SequenceLogprobs, compare_logprobs
    from comparator.logprobs.sources import compare_logprob_sources
    from comparator.results import FirstDivergence, Heatmap, LayerSummary, ReplicaMismatch, Report, TensorComparison
    from comparator.store import RunStore, select_baseline
    from comparator.store.regress import RegressResult, regress


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'comparator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
