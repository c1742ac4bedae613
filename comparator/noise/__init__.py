"""Measured noise: calibration (``calibrate``), NOISE.json on disk (``file``), logprob noise from verdicts
(``logprob_calibration``). The noise values and the thresholds derived from them are :mod:`comparator.judging`."""
