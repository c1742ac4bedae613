"""The main job: a teacher-forced prefill of each prompt through a model with capture on.

Example::

    from dumper.run import RunConfig, run_dump
    manifest = run_dump(RunConfig(out="dumps/a", model="tiny-llama", attn="sdpa"))
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InternalError, UsageError
from .format import Manifest, load_manifest
from .hooks import capture
from .presets import load_model

__all__ = ["RunConfig", "run_dump", "prefill", "pad_batch", "cache_kwarg", "read_prompts_file", "BUILTIN_PROMPTS"]

BUILTIN_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Inference engines change daily: a new attention "
    "backend, a fused kernel, another chunked-prefill cut. Each can shift the numerics without any error.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
)


@dataclass(frozen=True)
class RunConfig:
    """What ``python -m dumper run`` does; defaults give the no-network tiny-preset job."""

    out: str
    model: str = "tiny-llama"
    prompts: tuple[str, ...] = ()
    input_ids: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    attn: str = "eager"
    layers: str | None = None
    modules: str | None = None
    device: str = "cpu"
    seed: int = 0
    chunk_size: int | None = None
    batch_size: int = 1
    padding_side: str = "right"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size < 1:
            raise UsageError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.padding_side not in ("left", "right"):
            raise UsageError(f"--padding-side must be left or right, got {self.padding_side!r}")


def read_prompts_file(path: str | Path) -> tuple[list[str], list[list[int]]]:
    """Read JSONL prompts: each line ``{"text": ...}`` (or ``"prompt"``) or ``{"input_ids": [...]}``."""
    texts: list[str] = []
    ids: list[list[int]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"{path}: cannot read prompts file ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
            ids.append([int(i) for i in obj["input_ids"]])
        elif isinstance(obj, dict) and isinstance(obj.get("text", obj.get("prompt")), str):
            texts.append(obj.get("text", obj.get("prompt")))
        else:
            raise UsageError(f'{path}:{n}: expected {{"text": "..."}} or {{"input_ids": [...]}}')
    if not texts and not ids:
        raise UsageError(f"{path}: no prompts in file")
    return texts, ids


def _sequences(cfg: RunConfig, tokenizer, vocab_size: int) -> list[list[int]]:
    seqs: list[list[int]] = [list(s) for s in cfg.input_ids]
    texts = list(cfg.prompts)
    if not seqs and not texts:
        texts = list(BUILTIN_PROMPTS)
    if texts:
        if tokenizer is None:
            raise UsageError(f"{cfg.model}: the model directory has no tokenizer; pass --input-ids instead of text")
        seqs = [tokenizer.encode(t) for t in texts] + seqs
    for i, s in enumerate(seqs):
        if not s:
            raise UsageError(f"prompt {i} is empty")
        bad = [t for t in s if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return seqs


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes a KV cache.

    transformers 5.x takes ``cache=``; 4.x takes ``past_key_values=`` and silently ignores an
    unknown ``cache=``, so the name must come from the signature, not from a guess.
    """
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UsageError(f"{type(model).__name__}.forward takes no KV cache argument; --chunk-size needs one")


def pad_batch(seqs: list[list[int]], *, side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` input ids and attention mask (1 = real token), padded on ``side``."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(length - len(s), length)
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, chunk_size: int | None) -> None:
    """Teacher-forced prefill of a padded batch: one forward pass, or one per chunk through the KV cache.

    Positions are ``cumsum(mask) - 1`` so that each real token has its absolute position in
    its own sequence whatever the padding; the mask is passed only when there is padding.
    """
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    padded = bool((mask == 0).any())
    if chunk_size is None:
        model(input_ids=ids, attention_mask=mask if padded else None, position_ids=positions, use_cache=False)
        return
    kw = cache_kwarg(model)
    cache = None
    length = ids.shape[1]
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end] if padded else None,
                    position_ids=positions[:, start:end], use_cache=True, **{kw: cache})
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        grown = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else -1
        if grown != end:
            raise InternalError(f"{type(model).__name__}: the KV cache holds {grown} tokens after a chunk "
                                f"ending at {end}; the cache argument {kw!r} was not used")


def run_dump(cfg: RunConfig) -> Manifest:
    """Load the model and prefill every prompt under capture; return the manifest.

    Prompts go ``batch_size`` at a time (padded on ``padding_side``), each batch in one forward
    pass or in chunks of ``chunk_size`` tokens through the KV cache. Sequence ids are the
    prompts' indices, so dumps of different layouts align by (sequence, position).
    """
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    seqs = _sequences(cfg, tokenizer, vocab)
    extra = {"job": "prefill", "input_ids": seqs, "dtype": cfg.dtype, "attn": cfg.attn, "seed": cfg.seed,
             "chunk_size": cfg.chunk_size, "batch_size": cfg.batch_size, "padding_side": cfg.padding_side,
             **cfg.extra}
    device = next(model.parameters()).device
    pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    with torch.inference_mode(), capture(model, cfg.out, layers=cfg.layers, modules=cfg.modules,
                                         model_name=cfg.model, extra=extra) as cap:
        for first in range(0, len(seqs), cfg.batch_size):
            batch = seqs[first:first + cfg.batch_size]
            cap.set_sequence_ids(range(first, first + len(batch)))
            ids, mask = pad_batch(batch, side=cfg.padding_side, pad_id=pad_id)
            prefill(model, ids.to(device), mask.to(device), chunk_size=cfg.chunk_size)
    return load_manifest(cfg.out)


def parse_input_ids(spec: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``["1,2,3", "4,5"]`` -> ((1, 2, 3), (4, 5)); one sequence per ``--input-ids`` flag."""
    out = []
    for s in spec:
        try:
            out.append(tuple(int(t) for t in s.split(",") if t.strip()))
        except ValueError:
            raise UsageError(f"--input-ids {s!r}: expected comma-separated integers") from None
    return tuple(out)
