"""driftscope comparator: compare two dumps and name the first divergent layer and token.

Example::

    from comparator import CompareConfig, compare_dumps
    report = compare_dumps("dumps/eager", "dumps/sdpa", CompareConfig())
    if not report:
        fd = report.first_divergent
        print(f"diverged at layer {fd.layer}, token {fd.token}")
    report.write_json("report.json")
"""

from .compare import compare_dumps
from .config import CompareConfig
from .metrics import PairStats, pair_stats, rel_diff
from .report import FirstDivergence, LayerSummary, ReplicaMismatch, Report, TensorComparison

__all__ = [
    "compare_dumps",
    "CompareConfig",
    "Report",
    "TensorComparison",
    "FirstDivergence",
    "ReplicaMismatch",
    "LayerSummary",
    "PairStats",
    "pair_stats",
    "rel_diff",
]
