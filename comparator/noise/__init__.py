"""Measured noise: calibration files, noise-relative thresholds for hidden states and logprobs."""
