"""The capture side (torch): hooks on a model's own forward that record hidden states into a dump.

Example::

    import dumper
    with dumper.capture(model, "dumps/a", layers="all"):   # dumper.hooks.capture.Capture
        model(input_ids)

One module per concern:

- :mod:`~dumper.hooks.capture`: :class:`~dumper.hooks.capture.Capture`, its lifecycle, hooks and records;
- :mod:`~dumper.hooks.tap`: the graph-safe tap (a custom op) that records inside compiled models;
- :mod:`~dumper.hooks.active`: the active capture, :func:`~dumper.hooks.active.dump` and
  :func:`~dumper.hooks.active.step` from anywhere, ``DRIFTSCOPE_DUMP_DIR``;
- :mod:`~dumper.hooks.families`: per-family adapters (a registry): which modules to hook and
  where a call's hidden states, positions and sequence ids come from;
- :mod:`~dumper.hooks.rows`: the row metadata (positions, sequence ids) of a pass;
- :mod:`~dumper.hooks.layers`: layer specs, capture points, decoder-layer discovery;
- :mod:`~dumper.hooks.checks`: what a record is refused for, before it is stored;
- :mod:`~dumper.hooks.writer`: the background shard writer;
- :mod:`~dumper.hooks.fingerprint`: the model identity and environment of the manifest.
"""
