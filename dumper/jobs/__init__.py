"""Jobs that drive a model end to end: presets, the prefill run, logprobs, selfcheck, replay."""
