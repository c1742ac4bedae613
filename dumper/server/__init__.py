"""The live-server client: JSON over HTTP with deadlines and retries (:mod:`~dumper.server.client`, its wire
half :mod:`~dumper.server.wire`), the flags of a command that talks to a server (:mod:`~dumper.server.flags`),
and what each server API is asked for prompt logprobs and answers (:mod:`~dumper.server.api`).

It judges nothing and imports nothing of the comparator, which reads the answers
(``comparator.logprobs.sources.collect``); ``dumper collect`` and ``dumper selfcheck --server`` use it too.
"""
