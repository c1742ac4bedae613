"""Two builds, op by op: compare the drill logs of one half of a layer and name the first module path that differs.

``python -m dumper drill`` records every op one half (attention or MLP) of a decoder layer
dispatches (:mod:`dumper.format.drill`). :func:`compare_drills` lines up the logs of two builds by
module path and slot, measures each pair of outputs against both sides' rounding, and names the
first path beyond ``factor``, with what each side dispatched there. The command line is
``python -m comparator drill A B`` (:mod:`comparator.cli.drill`).

Example::

    from comparator.drill import compare_drills

    result = compare_drills("drills/base", "drills/new")
    print(result.summary)
    # DIVERGED at model.layers.2.mlp.act_fn: A aten.silu [1, 30, 192] bfloat16 vs B aten.silu [1, 30, 192]
    # bfloat16, 28.5x the two sides' rounding at token 20 (the path before it agrees bit for bit)
    for p in result.paths:
        print(p.path, [o.op for o in p.ops_a], [o.op for o in p.ops_b], p.ratio, p.token, p.status.value)
"""

from comparator.drill.align import PathPlan, align_ops
from comparator.drill.compare import compare_drills, row_ratios
from comparator.drill.types import (
    Basis,
    DrillComparison,
    DrillSide,
    OpBrief,
    PairComparison,
    Pairing,
    PathComparison,
    PathStatus,
)

__all__ = [
    "compare_drills",
    "row_ratios",
    "align_ops",
    "PathPlan",
    "DrillComparison",
    "DrillSide",
    "PathComparison",
    "PairComparison",
    "OpBrief",
    "Basis",
    "Pairing",
    "PathStatus",
]
