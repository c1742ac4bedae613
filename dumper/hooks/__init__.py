"""The capture side: hooks on a model's own forward, pass-row metadata, layer discovery,
per-family adapters, the background shard writer and the environment fingerprint (torch)."""
