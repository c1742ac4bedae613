"""The prefill machinery every engine builds on, below the engines and the jobs: the job's settings and the
transformers run (:mod:`~dumper.prefill.run`: ``RunConfig``, ``dump_sequences``), the model presets, forward
passes in chunks and batches, logprob recording, greedy decode steps, and the observer check.
"""
