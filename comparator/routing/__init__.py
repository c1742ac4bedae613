"""MoE routing comparison: which experts each token went to, where routing first flips, and whether a flip is noise.

- :mod:`~dumper.format.routing`: one dump's routing records, a layer at a time, keyed by (sequence, position);
- :mod:`~comparator.routing.compare`: flips, their margins against noise, combine-weight errors;
- :mod:`~comparator.routing.types`: the result types a :class:`~comparator.hidden.types.Report` holds.
"""
