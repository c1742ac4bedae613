"""What decides pass or fail: threshold values, the logprob metric table, fixed logprob thresholds, the
noise value types and the thresholds derived from noise, and model identity (a leaf: it imports only the
shared core, :mod:`dumper.format.jsonfloat` and :mod:`comparator.settings`).

- :mod:`~comparator.judging.reldiff`: the one rel_diff ratio, from the sums each caller accumulates;
- :mod:`~comparator.judging.values`: the one parser of threshold values (flags, env vars, tables);
- :mod:`~comparator.judging.logprob_metrics`: the checked logprob metrics, one spec each (add one there);
- :mod:`~comparator.judging.logprob_thresholds`: fixed logprob thresholds, ``configs/logprob_thresholds.json``;
- :mod:`~comparator.judging.noise`, :mod:`~comparator.judging.logprob_noise`, :mod:`~comparator.judging.fields`:
  NOISE.json as values, read with exact types;
- :mod:`~comparator.judging.noise_thresholds`: thresholds derived from noise, a verdict against its noise;
- :mod:`~comparator.judging.identity`, :mod:`~comparator.judging.runmode`: whether two dumps may be compared.
"""
