"""The main job: a teacher-forced prefill of each prompt through a model with capture on.

Example::

    from dumper.run import RunConfig, run_dump
    manifest = run_dump(RunConfig(out="dumps/a", model="tiny-llama", attn="sdpa"))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .capture import capture
from .errors import UsageError
from .format import Manifest, load_manifest
from .presets import load_model

__all__ = ["RunConfig", "run_dump", "read_prompts_file", "BUILTIN_PROMPTS"]

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
    extra: dict = field(default_factory=dict)


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


def run_dump(cfg: RunConfig) -> Manifest:
    """Load the model, prefill every prompt (one forward pass each) under capture, return the manifest."""
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    seqs = _sequences(cfg, tokenizer, vocab)
    extra = {"job": "prefill", "input_ids": seqs, "dtype": cfg.dtype, "attn": cfg.attn, "seed": cfg.seed,
             **cfg.extra}
    device = next(model.parameters()).device
    with torch.inference_mode(), capture(model, cfg.out, layers=cfg.layers, modules=cfg.modules,
                                         model_name=cfg.model, extra=extra) as cap:
        for i, seq in enumerate(seqs):
            cap.set_sequence_ids([i])
            ids = torch.tensor([seq], dtype=torch.long, device=device)
            model(input_ids=ids, use_cache=False)
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
