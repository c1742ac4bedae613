"""The main job: a teacher-forced prefill of each prompt through a model with capture on.

Example::

    from dumper.jobs.run import RunConfig, run_dump
    manifest = run_dump(RunConfig(out="dumps/a", model="tiny-llama", attn="sdpa"))
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dumper.errors import (
    DriftscopeError,
    InternalError,
    ModelError,
    UsageError,
    error_reason,
)
from dumper.format import (
    LOGITS,
    LOGITS_POINT,
    LOGPROB_POINT,
    LOGPROB_TOKEN_ID,
    LOGPROB_TOP_ID,
    LOGPROB_TOP_VALUE,
    LOGPROB_VALUE,
    Manifest,
    load_manifest,
)
from dumper.format.sketch import SketchSpec
from dumper.hooks.capture import Capture
from dumper.hooks.families import HFFamily
from dumper.hooks.layers import ATTN_INPUT, ROUTER, parse_points
from dumper.hooks.tap import install_tap, remove_tap, tap_of, unwrap_compiled
from dumper.jobs.logprobs import LOGPROB_CHUNK_ROWS, row_logprobs
from dumper.jobs.observer import LogprobSink, ObserverCheck, mark_observer
from dumper.jobs.presets import load_model, model_label
from dumper.progress import ProgressFn
from dumper.prompts import BUILTIN_PROMPTS, parse_input_ids, read_prompts_file  # noqa: F401 - re-exported

__all__ = ["RunConfig", "LogprobSpec", "run_dump", "dump_sequences", "prefill", "record_logprobs",
           "record_token_logprobs", "reference_sequences", "pad_batch", "cache_kwarg", "call_model", "cache_length",
           "prompt_token_ids", "check_scored_positions", "read_prompts_file",
           "parse_input_ids", "BUILTIN_PROMPTS"]



OBSERVER_ENGINES = ("transformers", "vllm")
ENGINE_POINTS = {"vllm": (ATTN_INPUT, ROUTER), "llama.cpp": (ATTN_INPUT, ROUTER)}
"""The capture points an engine other than transformers (which records every point) records; absent: input only."""
"""Engines whose capture runs in this process, so that ``--observer-check`` can tell what it changes."""

MAX_SEED = (1 << 63) - 1
"""Largest ``--seed``: :func:`torch.manual_seed` takes 64 bits, and the manifest keeps integers within int64."""


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
    points: tuple[str, ...] = (ATTN_INPUT,)
    """Capture points (:data:`dumper.hooks.layers.POINTS`): ``input`` (default), ``residual``, or both."""
    device: str = "cpu"
    seed: int = 0
    chunk_size: int | None = None
    batch_size: int = 1
    padding_side: str = "right"
    logprobs: LogprobSpec | None = None
    extra: dict = field(default_factory=dict)
    engine: str = "transformers"
    engine_args: tuple[tuple[str, str], ...] = ()
    """Engine-specific settings (``--engine-arg KEY=VALUE``); each adapter in :mod:`dumper.engines` names its keys."""
    compile: bool = False
    """``--compile``: run the HF model under ``torch.compile``, captured through the tap (:mod:`dumper.hooks.tap`)."""
    observer_check: bool = False
    """``--observer-check``: run the job again without capture and compare its logprobs bit for bit."""
    warm_prefix_cache: bool = False
    """Run the prompts once unrecorded before the recorded run, so that it reads the prefix cache (vLLM)."""
    sketch: SketchSpec | None = None
    """``--sketch K``: hidden-state rows stored as projections (:mod:`dumper.format.sketch`)."""

    def engine_arg(self, key: str, default: str | None = None) -> str | None:
        """The ``--engine-arg`` value of ``key`` (the last one given), else ``default``."""
        return next((v for k, v in reversed(self.engine_args) if k == key), default)

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size < 1:
            raise UsageError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be in 0..{MAX_SEED} (a torch.manual_seed int64), got {self.seed}")
        if self.padding_side not in ("left", "right"):
            raise UsageError(f"--padding-side must be left or right, got {self.padding_side!r}")
        object.__setattr__(self, "points", parse_points(self.points))
        allowed = ENGINE_POINTS.get(self.engine, (ATTN_INPUT,))
        if self.engine != "transformers" and not set(self.points) <= set(allowed):
            raise UsageError(f"--points {','.join(self.points)}: engine {self.engine} records the "
                             f"{' and '.join(map(repr, allowed))} point{'s' if len(allowed) > 1 else ''} only; "
                             "the others need --engine transformers")
        if self.compile and self.engine != "transformers":
            raise UsageError(f"--compile: --engine {self.engine} runs its own default mode (vLLM: compiled; "
                             "--engine-arg enforce_eager=true for eager); --compile is for --engine transformers")
        if self.observer_check and self.logprobs is None:
            raise UsageError("--observer-check compares the logprobs of a run with and without capture; add --logprobs")
        if self.observer_check and self.engine not in OBSERVER_ENGINES:
            raise UsageError(f"--observer-check: engine {self.engine} runs outside this process, where capture adds "
                             f"nothing to check; it is for --engine {' or '.join(OBSERVER_ENGINES)}")


def prompt_token_ids(cfg: RunConfig, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """``cfg``'s prompts as token ids: texts (default: the built-in ones) by ``tokenizer``, then ``--input-ids``.

    Every id must lie in ``[0, vocab_size)``; a text prompt needs a tokenizer (``None``: pass ids).
    """
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
    params = inspect.signature(unwrap_compiled(model).forward).parameters
    names = HFFamily.cache_kwargs  # the names the hooks read the cache by, too
    for name in names:
        if name in params:
            return name
    raise ModelError(f"{model_label(model)}: {type(model).__name__}.forward takes no KV cache argument "
                     f"({' or '.join(n + '=' for n in names)}); --chunk-size and selfcheck need one")


def call_model(model: torch.nn.Module, **inputs: Any) -> Any:
    """``model(**inputs)``; an exception from the model's own code becomes a :class:`ModelError` naming the model.

    The forward pass is a trust boundary: input ids the model cannot embed or a config that
    builds but cannot run are the model's problem (exit 2), not driftscope's. driftscope's own
    hooks run inside the call too, but they raise only :class:`DriftscopeError` or
    :class:`InternalError` (see :mod:`dumper.hooks.capture`), which pass through, so a bug still exits 3.
    """
    try:
        return model(**inputs)
    except (DriftscopeError, InternalError):
        raise
    except Exception as e:  # noqa: BLE001 - the forward boundary
        raise ModelError(f"{model_label(model)}: the forward pass failed ({error_reason(e)})") from e


def cache_length(out: Any) -> tuple[Any, int | None]:
    """The KV cache a forward pass returned (``cache`` on transformers 5.x, ``past_key_values`` on 4.x) and its length.

    The length is ``None`` when there is no cache or it cannot say how many tokens it holds
    (a state-space model's cache raises on ``get_seq_length``).
    """
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    get = getattr(cache, "get_seq_length", None)
    try:
        return cache, (int(get()) if callable(get) else None)
    except Exception:  # noqa: BLE001 - the model's cache object: any failure means "cannot say"
        return cache, None


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


@dataclass(frozen=True)
class LogprobSpec:
    """What a run records besides hidden states: input-token logprobs, top-k, full logits rows."""

    top_k: int = 0
    start_len: int = 0
    save_logits: bool = False
    chunk_rows: int = LOGPROB_CHUNK_ROWS


def record_logprobs(cap: LogprobSink, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    positions: torch.Tensor, start: int, seq_ids: Sequence[int], spec: LogprobSpec) -> None:
    """Record the logprobs of a pass whose logits [B, s, V] cover columns ``start .. start+s-1``.

    Row (b, c) scores the token in column c+1 when that column is a real token past
    ``spec.start_len``: across chunk boundaries too, since ``ids`` holds the whole batch.
    """
    batch, s, _ = logits.shape
    length = ids.shape[1]
    cols = torch.arange(start, start + s, device=ids.device)
    nxt = (cols + 1).clamp(max=length - 1)
    valid = (cols + 1 < length)[None, :] & (mask[:, cols] == 1) & (mask[:, nxt] == 1) \
        & (positions[:, cols] + 1 > spec.start_len)
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    rows = logits[b_idx, t_idx]  # [n, V]
    targets = ids[b_idx, start + t_idx + 1]
    meta = {"positions": positions[b_idx, start + t_idx] + 1,
            "sequence_ids": torch.as_tensor(list(seq_ids), device=ids.device)[b_idx]}
    r = row_logprobs(rows, targets, top_k=spec.top_k, chunk_rows=spec.chunk_rows)
    record_token_logprobs(cap, meta["positions"], meta["sequence_ids"], targets, r.logprobs,
                          r.top_ids if spec.top_k else None, r.top_logprobs if spec.top_k else None)
    if spec.save_logits:
        cap.record(LOGITS, rows, point=LOGITS_POINT, **meta)


def record_token_logprobs(cap: LogprobSink, positions: Any, sequence_ids: Any, token_ids: Any, logprobs: Any,
                          top_ids: Any = None, top_logprobs: Any = None) -> None:
    """Record ``logprobs[r]`` of ``token_ids[r]`` at ``positions[r]`` of sequence ``sequence_ids[r]`` into ``cap``.

    ``top_ids`` / ``top_logprobs`` [rows, k] are the top-k of the distribution that predicted
    that position's token. The one writer of the ``LOGPROB_*`` records, for the HF job and for
    engines that compute logprobs themselves (vLLM's ``prompt_logprobs``).
    """
    meta = {"positions": torch.as_tensor(positions, dtype=torch.int64).reshape(-1),
            "sequence_ids": torch.as_tensor(sequence_ids, dtype=torch.int64).reshape(-1)}
    cap.record(LOGPROB_TOKEN_ID, torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1, 1),
               point=LOGPROB_POINT, **meta)
    cap.record(LOGPROB_VALUE, torch.as_tensor(logprobs, dtype=torch.float32).reshape(-1, 1),
               point=LOGPROB_POINT, **meta)
    if top_ids is not None and top_logprobs is not None:
        cap.record(LOGPROB_TOP_ID, torch.as_tensor(top_ids, dtype=torch.int64), point=LOGPROB_POINT, **meta)
        cap.record(LOGPROB_TOP_VALUE, torch.as_tensor(top_logprobs, dtype=torch.float32), point=LOGPROB_POINT, **meta)


def _record_pass_logprobs(cap: LogprobSink, ids: torch.Tensor, mask: torch.Tensor, seq_ids: Sequence[int],
                          spec: LogprobSpec, logits: torch.Tensor, start: int, positions: torch.Tensor) -> None:
    record_logprobs(cap, logits, ids, mask, positions, start, seq_ids, spec)


def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, chunk_size: int | None,
            on_logits: Callable[[torch.Tensor, int, torch.Tensor], None] | None = None) -> None:
    """Teacher-forced prefill of a padded batch: one forward pass, or one per chunk through the KV cache.

    Positions are ``cumsum(mask) - 1`` so that each real token has its absolute position in
    its own sequence whatever the padding; the mask is passed only when there is padding.
    ``on_logits(logits, first_column, positions)`` sees each pass's logits.
    """
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    padded = bool((mask == 0).any())
    if chunk_size is None:
        out = call_model(model, input_ids=ids, attention_mask=mask if padded else None, position_ids=positions,
                         use_cache=False)
        if on_logits is not None:
            on_logits(out.logits, 0, positions)
        return
    kw = cache_kwarg(model)
    cache = None
    length = ids.shape[1]
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        out = call_model(model, input_ids=ids[:, start:end], attention_mask=mask[:, :end] if padded else None,
                         position_ids=positions[:, start:end], use_cache=True, **{kw: cache})
        cache, grown = cache_length(out)
        if grown != end:  # the model's cache, not driftscope: a sliding window, a cache it ignores, none at all
            held = "no KV cache" if cache is None else \
                f"a {type(cache).__name__} holding {'an unknown number of' if grown is None else grown} tokens"
            raise ModelError(f"{model_label(model)}: --chunk-size needs a KV cache that grows by each chunk; "
                             f"after the chunk ending at token {end} the model returned {held} "
                             f"(cache argument {kw!r})")
        if on_logits is not None:
            on_logits(out.logits, start, positions)


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Load the model and prefill every prompt under capture; return the manifest.

    Prompts go ``batch_size`` at a time (padded on ``padding_side``), each batch in one forward
    pass or in chunks of ``chunk_size`` tokens through the KV cache. Sequence ids are the
    prompts' indices, so dumps of different layouts align by (sequence, position).
    ``progress(done_tokens, total_tokens)`` is called after each batch.
    """
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    return dump_sequences(model, prompt_token_ids(cfg, tokenizer, vocab), cfg, progress=progress)


def check_scored_positions(cfg: RunConfig, seqs: Sequence[Sequence[int]]) -> None:
    """With ``--logprobs``, refuse prompts of which none has a position past ``--logprob-start-len`` to score."""
    if cfg.logprobs is not None and all(len(s) - 1 <= cfg.logprobs.start_len for s in seqs):
        raise UsageError(f"--logprobs: no prompt has a position to score (the longest has {max(map(len, seqs))} "
                         f"tokens; --logprob-start-len {cfg.logprobs.start_len} leaves none, scored positions are "
                         "start_len+1 .. len-1)")


def compiled_model(model: torch.nn.Module, cfg: RunConfig, seqs: Sequence[Sequence[int]]) -> torch.nn.Module:
    """``torch.compile(model)`` with the tap installed first, sized for the job's largest forward pass."""
    rows = min(cfg.batch_size, len(seqs)) * (cfg.chunk_size or max(map(len, seqs)))
    if tap_of(model) is None:
        install_tap(model, layers=cfg.layers, modules=cfg.modules, points=cfg.points, max_tokens=rows)
    return torch.compile(model)


def dump_sequences(model: torch.nn.Module, seqs: list[list[int]], cfg: RunConfig, *,
                   progress: ProgressFn | None = None) -> Manifest:
    """:func:`run_dump` with a model already in hand (say, one with a bug injected) and token ids.

    ``cfg`` gives the output, layout, layers and logprob settings; ``cfg.model`` only names the
    model in the manifest. With ``cfg.observer_check`` the job runs again without capture
    (:func:`reference_sequences`) and the manifest returned carries ``extra["observer"]``
    (:mod:`dumper.jobs.observer`).
    """
    check_scored_positions(cfg, seqs)
    extra = {"job": "prefill", "input_ids": seqs, "dtype": cfg.dtype, "attn": cfg.attn, "seed": cfg.seed,
             "compiled": cfg.compile,
             "chunk_size": cfg.chunk_size, "batch_size": cfg.batch_size, "padding_side": cfg.padding_side,
             "logprobs": None if cfg.logprobs is None else vars(cfg.logprobs), **cfg.extra}
    run_model = compiled_model(model, cfg, seqs) if cfg.compile else model
    with torch.inference_mode(), Capture(run_model, cfg.out, layers=cfg.layers, modules=cfg.modules,
                                         points=cfg.points, model_name=cfg.model, extra=extra,
                                         sketch=cfg.sketch) as cap:
        _prefill_job(model, run_model, seqs, cfg, cap, progress)
    if not cfg.observer_check or cfg.logprobs is None:
        return load_manifest(cfg.out)
    check = ObserverCheck(cfg.out, logits=cfg.logprobs.save_logits)
    reference_sequences(model, seqs, cfg, check)
    return mark_observer(cfg.out, check.result())


def reference_sequences(model: torch.nn.Module, seqs: list[list[int]], cfg: RunConfig, sink: LogprobSink) -> None:
    """``cfg``'s job once more with nothing of driftscope on the model, its logprobs recorded into ``sink``.

    No capture is active and no hook is added. With ``cfg.compile`` the tap comes off the model
    (it stays off) and the model is compiled afresh without it, after
    :func:`torch.compiler.reset`: Dynamo does not guard on hooks, so a cached graph would
    still call the tap. The reset drops every compiled graph of this process.
    """
    run_model = model
    if cfg.compile:
        remove_tap(model)
        torch.compiler.reset()
        run_model = torch.compile(model)
    with torch.inference_mode():
        _prefill_job(model, run_model, seqs, cfg, sink, None)


def _prefill_job(model: torch.nn.Module, run_model: torch.nn.Module, seqs: list[list[int]], cfg: RunConfig,
                 sink: LogprobSink, progress: ProgressFn | None) -> None:
    """Prefill ``seqs`` through ``run_model`` in ``cfg``'s batches and chunks, logprobs into ``sink``.

    ``sink`` is the capture (or the observer check): it is told each batch's sequence ids.
    """
    device = next(model.parameters()).device
    pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    done, total = 0, sum(map(len, seqs))
    for first in range(0, len(seqs), cfg.batch_size):
        batch = seqs[first:first + cfg.batch_size]
        seq_ids = list(range(first, first + len(batch)))
        sink.set_sequence_ids(seq_ids)
        ids, mask = pad_batch(batch, side=cfg.padding_side, pad_id=pad_id)
        ids, mask = ids.to(device), mask.to(device)
        on_logits = None if cfg.logprobs is None else functools.partial(
            _record_pass_logprobs, sink, ids, mask, seq_ids, cfg.logprobs)
        prefill(run_model, ids, mask, chunk_size=cfg.chunk_size, on_logits=on_logits)
        done += sum(map(len, batch))
        if progress is not None:
            progress(done, total)
