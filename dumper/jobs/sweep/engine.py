"""What an invariance sweep asks of an engine: its KV block size, its own checks of a cell, the engine it holds.

Only vLLM keeps an engine between runs (:func:`dumper.engines.vllm.load_llm` reuses the one it
holds when the settings are identical), so only vLLM has something to say here; the sweep
goes through the adapters' public functions and never into vLLM itself, but for the block size
of the engine it loaded (``llm.llm_engine.vllm_config.cache_config.block_size``).

Example::

    block = engine_block_size(template)              # 16 for transformers; vLLM: from the engine
    template = pinned_engine_args(template, grid_keys={"lengths"})
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from dumper.engines import engine_adapter
from dumper.errors import UsageError
from dumper.prefill.run import RunConfig

__all__ = ["HF_BLOCK_SIZE", "engine_block_size", "pinned_engine_args", "preflight", "held_engine"]

HF_BLOCK_SIZE = 16
"""The block size a ``lengths=block`` axis assumes for the HF engine, whose cache has no blocks."""

_MAX_MODEL_LEN = "max_model_len"


def _vllm_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` of ``cfg`` (its prompts are ``cfg.input_ids``), with vLLM's adapter's checks."""
    from dumper.engines.base import check_checkpoint_dir
    from dumper.engines.vllm.engine import engine_kwargs

    checkpoint = check_checkpoint_dir(cfg.model, "vllm")
    return engine_kwargs(cfg, checkpoint, [list(s) for s in cfg.input_ids])


def engine_block_size(cfg: RunConfig) -> int:
    """The KV block size of ``cfg``'s engine: :data:`HF_BLOCK_SIZE` for transformers; vLLM's from the
    engine it loads for ``cfg`` (which the first cell with these settings then reuses)."""
    if cfg.engine == "transformers":
        return HF_BLOCK_SIZE
    if cfg.engine == "vllm":
        from dumper.engines.vllm.engine import load_llm

        llm = load_llm(_vllm_kwargs(cfg), device=cfg.device)
        return int(llm.llm_engine.vllm_config.cache_config.block_size)
    raise UsageError(
        f"--grid lengths=block: the KV block size of --engine {cfg.engine} is not known; pass --block-size N"
    )


def pinned_engine_args(cfg: RunConfig, grid_keys: Collection[str], *, new_tokens: int = 0) -> RunConfig:
    """``cfg`` with the engine settings that would otherwise follow the prompts fixed, so that every cell
    with the same grid settings gets the same engine.

    vLLM's ``max_model_len`` defaults from the longest prompt and the tokens it generates; a
    ``lengths`` cell has shorter prompts, a ``new_tokens`` cell other counts, so without the pin
    each would build a new engine. It is pinned to the value of the full job with the most new
    tokens of any cell (``new_tokens``), unless given or swept.
    """
    if cfg.engine != "vllm" or _MAX_MODEL_LEN in grid_keys or cfg.engine_arg(_MAX_MODEL_LEN) is not None:
        return cfg
    value = _vllm_kwargs(replace(cfg, new_tokens=max(cfg.new_tokens, new_tokens)))[_MAX_MODEL_LEN]
    return replace(cfg, engine_args=(*cfg.engine_args, (_MAX_MODEL_LEN, str(value))))


def preflight(cfg: RunConfig) -> None:
    """The engine adapter's own checks of a cell's settings that need no engine (vLLM: batch size,
    ``max_num_seqs`` against ``chunk_size``, ...), so that a bad cell fails before the first one runs."""
    if cfg.engine == "vllm":
        _vllm_kwargs(cfg)


def held_engine(engine: str) -> Callable[[], Any] | None:
    """A weak reference to the engine ``engine``'s adapter keeps between runs (None: it keeps none).

    The sweep takes one before and after a cell: the same object means the cell reused the engine.
    """
    if engine != "vllm":
        return None
    llm = engine_adapter(engine).ENGINE.llm  # the engine load_llm keeps
    if llm is None:
        return None
    try:
        return weakref.ref(llm)
    except TypeError:
        return lambda: llm
