"""Hidden-state comparison: two dumps in, a :class:`~comparator.hidden.types.Report` out.

- :mod:`~comparator.hidden.align`: the plan, from manifests only: which rows meet which;
- :mod:`~comparator.hidden.kernels` and :mod:`~comparator.hidden.metrics`: stream the row sums
  of each aligned pair (C kernel, float64 accumulation);
- :mod:`~comparator.hidden.registry`: the metrics, small functions of those sums registered by
  name (add one there, or from your own code with ``@metric``);
- :mod:`~comparator.hidden.compare`: ``compare_dumps``, the verdict per tensor;
- :mod:`~comparator.hidden.localize`, :mod:`~comparator.hidden.onset`, :mod:`~comparator.hidden.heatmap`:
  the first divergence, where it starts, the per-token picture around it;
- whether two dumps may be compared at all is :mod:`comparator.judging.identity`'s.

Example::

    from comparator.hidden.compare import compare_dumps
    report = compare_dumps("dumps/eager", "dumps/sdpa")
    print(report.passed, [t.metrics for t in report.tensors[:1]])
"""
